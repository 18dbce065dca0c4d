"""The EAGLE3 draft model that runs on the last pipeline stage, with its own rollback-able KV cache.

Modules: ``config`` (``Eagle3DraftConfig``), ``layer`` (``RMSNorm``, ``Eagle3DraftLayer``: the layer the
plain way), ``rotary`` (rotary factors and the draft's rotary tables), ``counts`` (``num_valid`` parsing),
``kv_cache`` (``DraftKVCache``), ``storage`` (``DraftStorage``, fixed storage for CUDA graphs),
``fused`` (the fused inference weights), ``model`` (``Eagle3Draft``), ``propose`` (``propose`` and
``extend``, the engine's calls). This package imports torch and transformers' Llama pieces only; it must
not import the engine's loop (worker, row batches), ``pipespec.pp`` or vllm.

API (stable; for users of the package: pipespec's own modules import each name from its defining module)::

    from pipespec.engine.draft import Eagle3Draft, Eagle3DraftConfig, DraftKVCache
    from pipespec.engine.draft_checkpoint import inspect_draft_checkpoint, load_draft_checkpoint, TargetInfo

    # every stage, before loading target weights (reads config.json + tensor headers only):
    info = inspect_draft_checkpoint(draft_dir, TargetInfo.from_config(target_config), aux_convention=None)
    model.set_aux_hidden_state_layers(info.aux_layers)        # input-index ids, sorted, unique
    print(info.aux_convention, info.aux_convention_source, info.aux_layers, info.warnings)

    # last stage only:
    loaded = load_draft_checkpoint(draft_dir, target_info, aux_convention=None, dtype=torch.float32,
                                   device="cpu", target_embed=model.model.embed_tokens)
    draft: Eagle3Draft = loaded.model          # loaded.info is the DraftCheckpointInfo above
    cache = draft.new_cache(batch_size, capacity=max_total_len)

    # after the target's prefill of prompt x_0..x_{n-1} that sampled x_n:
    #   aux      = list of k tensors [B, n, H_t] in id order (mixin.collect + own captures)
    #   next_ids = [x_1, ..., x_n]  ([B, n]; per-row valid counts in num_valid for ragged batches)
    drafts = draft.propose(aux, next_ids, cache, num_tokens=K, num_valid=None)   # [B, K] target ids
    # after a verify step where a_b drafts of row b were accepted (+ one bonus token):
    #   aux      = the target's aux states at the a_b + 1 accepted positions (padded to a common T)
    #   next_ids = [d_1, ..., d_{a_b}, bonus]  (the tokens that follow those positions)
    drafts = draft.propose(aux, next_ids, cache, num_tokens=K, num_valid=[a_b + 1 for each row])
    # a round without speculation: keep the draft's cache in step with the target, draft nothing
    #   (num_valid entries may be 0 here: such a row is left as it was)
    draft.extend(aux, next_ids, cache, num_valid=counts)

    # batches of sequences (one cache row each) are regrouped between rounds:
    merged = DraftKVCache.concat([cache_a, cache_b, cache_c])   # rows stacked in order, capacities padded
    kept = merged.select([0, 2])                                # a copy holding those rows, in that order
    cache.crop(lengths)                                         # validated rollback (see crop)

    # fixed storage for CUDA graphs (pipespec.engine.draft_graph): an *adopted* cache lives in it
    storage = DraftStorage(max_rows, num_kv_heads, head_dim, capacity=C, dtype=dtype, device=device)
    cache = storage.adopt(cache)                 # rows copied in; select/concat keep it adopted, in place

``num_valid`` is best passed as host integers (a list, or a CPU tensor): they are validated, copied to
the device once (pinned, non-blocking on CUDA), and let the cache keep exact host-side lengths, so
attention spans never drift past the longest row. A device tensor is used as is, unvalidated. Neither
``propose`` nor ``extend`` ever reads a device value back to the host (no ``.item()``, ``.tolist()``,
``bool(tensor)``): the engine's own ``drafts.tolist()`` is the one synchronisation a round needs.

Semantics (EAGLE3): at target position ``t`` the draft's input pair is (feature ``f_t = fc(cat(aux
states at t))``, token ``x_{t+1}``) and its output predicts ``x_{t+2}``; later draft steps feed back the
draft's own pre-norm output hidden and the token it drafted. The draft cache is position-aligned with
the target: cache slot ``t`` holds the draft's key/value for target position ``t``, and rotary positions
are the slot indices. ``propose`` leaves the cache holding exactly the target-verified positions (it
drops its own speculative entries before returning), so the engine never rolls the draft cache back
itself; ``DraftKVCache.crop`` is public for engines that want a different policy.

Architecture: ``fc`` (k·H_t → H, no bias), ONE Llama-style decoder layer (``midlayer``) whose attention
q/k/v read ``cat(input_layernorm(embeds), hidden_norm(h))`` (2H inputs) and whose residual is ``h``
(or ``hidden_norm(h)`` when ``norm_before_residual``, as speculators allows), post-attention norm + MLP,
final ``norm``, ``lm_head`` over the draft vocabulary, and ``d2t`` offsets (target id = draft id +
``d2t[draft id]``). Token embeddings come from ``embed_tokens``: the draft's own, or the target's module
shared via ``pipespec.contract.embed.maybe_share_target_embed``. Rotary embeddings follow the layer's Llama config
(any ``rope_parameters`` transformers understands, e.g. llama3 scaling), computed exactly as transformers'
``LlamaRotaryEmbedding`` does.
"""

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.kv_cache import DraftKVCache
from pipespec.engine.draft.layer import Eagle3DraftLayer, RMSNorm
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft.storage import DraftStorage

__all__ = ["DraftKVCache", "DraftStorage", "Eagle3Draft", "Eagle3DraftConfig", "Eagle3DraftLayer", "RMSNorm"]
