"""``Eagle3Draft``: the EAGLE3 draft head (``fc``, one decoder layer, ``norm``, ``lm_head``, ``d2t``), its fused
forward over 2D rows, and the engine's calls ``propose`` and ``extend``.

Its rotary tables (``rotary.DraftRotary``) and fused weights (``fused.FusedWeights``) are mixins in their own
modules. Imports torch and the draft's modules; must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.counts import Counts, valid_counts
from pipespec.engine.draft.fused import Fused, FusedWeights, linear_add
from pipespec.engine.draft.kv_cache import DraftKVCache
from pipespec.engine.draft.layer import Eagle3DraftLayer, RMSNorm
from pipespec.engine.draft.rotary import DraftRotary


class Eagle3Draft(DraftRotary, FusedWeights, nn.Module):
    """EAGLE3 draft head. Parameter names match Format A (``midlayer.*``); see ``draft_checkpoint``.

    ``forward``, ``extend`` and ``propose`` run one fused implementation of the layer over 2D rows
    (``B·T`` of them): one q/k/v matmul, one gate/up matmul, residual adds inside ``addmm``, one
    ``rms_norm`` op per norm, rotary factors gathered from a per-position table, cache writes with one
    ``index_put_`` each, and grouped-query attention with the query heads of a key/value head as extra
    query rows (no expanded key/value copies). ``extend``, whose outputs nobody reads, runs only the key/value
    side (``_project``, cache writes). The per-module helpers (``Eagle3DraftLayer.qkv``,
    ``finish``, ``attend``, ``rotary``, ``logits``) compute the same layer the plain way; training code
    (``bench/train_demo.py``) uses them.
    """

    def __init__(self, config: Eagle3DraftConfig, with_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3DraftLayer(config)
        self.norm = RMSNorm(hidden, float(config.layer.rms_norm_eps))
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # None until the checkpoint provides one or the target's module is shared in (embed.py).
        self.register_module("embed_tokens", nn.Embedding(config.vocab_size, hidden) if with_embedding else None)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Not a registered buffer owner: ``.to(torch.bfloat16)`` would round ``inv_freq`` (transformers
        # computes rotary angles in float32 from it); rotary() moves it to the input's device instead.
        self.reset_rotary()

    # ------------------------------------------------------------------------------ pieces
    def _aux_features(self, aux: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        x = aux if isinstance(aux, torch.Tensor) else torch.cat(list(aux), dim=-1)
        if x.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"the draft's fc takes {self.fc.in_features} features ({self.config.num_aux} aux states x "
                f"{self.config.target_hidden_size}) but got {x.shape[-1]}"
            )
        dtype = self.fc.weight.dtype
        return x if x.dtype == dtype else x.to(dtype)

    def combine_aux(self, aux: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc(cat(aux states))``: k tensors ``[B, T, H_t]`` in id order → ``[B, T, H]``."""
        return self.fc(self._aux_features(aux))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed_rows(input_ids, self.fc.weight.dtype)

    def _embed_rows(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        embed = self._modules.get("embed_tokens")
        if embed is None:
            raise RuntimeError(
                "the draft has no embed_tokens: load one from the checkpoint or share the target's input "
                "embedding with pipespec.contract.embed.maybe_share_target_embed(draft, target_embed)"
            )
        out = embed(input_ids)
        return out if out.dtype == dtype else out.to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm hidden states."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: ``id + d2t[id]``."""
        return draft_ids + self.d2t[draft_ids]

    def greedy_target_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.to_target_ids(self.logits(hidden).argmax(dim=-1))

    def new_cache(self, batch_size: int, capacity: int = 256) -> DraftKVCache:
        weight = self.fc.weight
        layer = self.midlayer
        return DraftKVCache(
            batch_size, layer.num_kv_heads, layer.head_dim, capacity=capacity, dtype=weight.dtype, device=weight.device
        )

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        cache: DraftKVCache | None = None,
        num_valid: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass of the draft layer over ``T`` input pairs; returns the pre-norm output ``[B, T, H]``.

        ``hidden_states`` are fc features (first pass over verified positions) or the draft's own earlier
        outputs. With a ``cache`` the positions are ``cache.lengths[b] + i`` and the new keys/values are
        appended (``num_valid[b]`` of them count for row ``b``); without one the block is causal on its
        own with ``position_ids`` (default ``0..T-1``).
        """
        bsz, steps = input_ids.shape
        counts = None
        if cache is not None:
            counts = valid_counts(num_valid, cache.batch_size, steps, cache.device, minimum=0)
        dtype = self.fc.weight.dtype
        hidden = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)
        out = self._pass(self._fused(), input_ids, hidden.reshape(bsz * steps, -1), cache, counts, position_ids)
        return out.view(bsz, steps, -1)

    def _pass(
        self,
        f: Fused,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cache: DraftKVCache | None,
        counts: Counts | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` on 2D rows: ``input_ids [B, T]``, ``hidden [B·T, H]`` → ``[B·T, H]``; advances ``cache``."""
        bsz, steps = input_ids.shape
        ids = input_ids.reshape(-1)
        if cache is None:
            size: int | None = steps
            if position_ids is None:
                positions = torch.arange(steps, device=hidden.device).expand(bsz, steps)
            else:
                positions, size = position_ids.expand(bsz, steps), None
            if steps == 1:
                positions = positions.reshape(bsz)
            return self._layer(f, ids, hidden, bsz, steps, positions, None, steps, steps > 1, size)
        cache.reserve(steps)
        host = cache._host
        # One key span serves every row unmasked only when all rows are known to hold the same length.
        masked = steps > 1 or host is None or any(n != host[0] for n in host)
        positions = self._new_positions(cache, steps)
        out = self._layer(f, ids, hidden, bsz, steps, positions, cache, cache.max_length + steps, masked, cache.capacity)
        cache._advance(steps, counts)
        return out

    def _append(
        self, f: Fused, input_ids: torch.Tensor, hidden: torch.Tensor, cache: DraftKVCache, counts: Counts | None
    ) -> None:
        """``_pass`` with a cache when its outputs are not wanted (``extend``): only the key/value side runs.

        The keys/values of all ``B·T`` rows come from ``_project`` exactly as in ``_pass`` (same ops on the
        same rows, so the cache ends bit-for-bit the same) and are stored and counted likewise; the query
        side (attention, ``o_proj``, MLP), whose outputs only ``propose`` reads, is skipped.
        """
        bsz, steps = input_ids.shape
        cache.reserve(steps)
        positions = self._new_positions(cache, steps)
        _, _, k, v = self._project(f, input_ids.reshape(-1), hidden, positions, cache.capacity)
        self._store(cache, k, v, bsz, steps, positions)
        cache._advance(steps, counts)

    @staticmethod
    def _new_positions(cache: DraftKVCache, steps: int) -> torch.Tensor:
        """Positions (= slots) of ``steps`` new entries per row: ``lengths [B]`` when ``T == 1``, else ``[B, T]``."""
        lengths = cache.lengths
        return lengths if steps == 1 else lengths.unsqueeze(1) + cache.slot_ids(steps)

    def _project(
        self, f: Fused, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, table_size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input side over ``N`` rows, row by row: (residual ``[N, H]``, rotated queries
        ``[N, heads, d]``, rotated keys ``[N, kv_heads, d]``, values ``[N, kv_heads, d]``).

        The input norms, one q/k/v matmul and the rotary factors of ``positions`` (see ``_layer``).
        """
        heads, kv_heads, head_dim = f.heads, f.kv_heads, f.head_dim
        shape = (hidden.shape[-1],)
        normed = F.rms_norm(hidden, shape, *f.hidden_norm)
        x = torch.cat((F.rms_norm(self._embed_rows(ids, hidden.dtype), shape, *f.input_norm), normed), dim=-1)
        residual = normed if f.norm_before_residual else hidden
        projected = F.linear(x, f.qkv, f.qkv_bias).view(-1, heads + 2 * kv_heads, head_dim)
        cos, signed_sin = self._rope_factors(hidden, positions, table_size)
        # Rotated over all heads of the contiguous projection (CUDA's roll copies a strided input first);
        # the value heads' rotation is dropped.
        rotated = torch.addcmul(projected * cos, projected.roll(head_dim // 2, -1), signed_sin)
        q, k, _ = rotated.split((heads, kv_heads, kv_heads), dim=1)
        return residual, q, k, projected[:, heads + kv_heads :]

    @staticmethod
    def _store(
        cache: DraftKVCache, k: torch.Tensor, v: torch.Tensor, bsz: int, steps: int, positions: torch.Tensor
    ) -> None:
        """Write ``_project``'s keys/values ``[B·T, kv_heads, d]`` at slots ``positions`` (lengths untouched)."""
        if steps == 1:
            cache._put(k, v, positions)
        else:
            kv_heads, head_dim = k.shape[1], k.shape[2]
            cache._put(k.view(bsz, steps, kv_heads, head_dim), v.view(bsz, steps, kv_heads, head_dim), positions)

    def _layer(
        self,
        f: Fused,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        bsz: int,
        steps: int,
        positions: torch.Tensor,
        cache: DraftKVCache | None,
        span: int,
        masked: bool,
        table_size: int | None,
    ) -> torch.Tensor:
        """The decoder layer over ``N = B·T`` rows (row ``b·T + t``): ``ids [N]``, ``hidden [N, H]`` → ``[N, H]``.

        ``positions`` are ``[B]`` when ``T == 1``, else ``[B, T]``. With a ``cache`` the new keys/values are
        stored at those slots (lengths untouched) and the queries read slots ``[0, span)``, masked by position
        when ``masked`` (without a mask every row must see exactly that span); without a cache the block
        attends to itself, causally by position. ``table_size`` bounds the positions for the rotary table
        (None: compute the factors directly).

        The key/value side is ``_project`` (+ ``_store``); the query side (attention over the span, ``o_proj``
        with the residual, post-norm, MLP) runs for all ``N`` rows. It is not narrowed to the rows a caller
        reads (``propose`` reads one per row): on CPU, MKL's float32 matmuls and SDPA round a row
        differently when given fewer rows, so the drafts' hidden states would no longer be bit-identical.
        """
        heads, kv_heads, head_dim = f.heads, f.kv_heads, f.head_dim
        groups = heads // kv_heads
        shape = (hidden.shape[-1],)
        residual, q, k, v = self._project(f, ids, hidden, positions, table_size)

        # Grouped-query attention without expanding keys/values: the query heads sharing a key/value head
        # are rows of that head's query block, ordered (group, step); the mask is repeated to match.
        if steps == 1:
            query = q.view(bsz, kv_heads, groups, head_dim)
            query_pos = positions.reshape(bsz, 1, 1, 1) if masked else None
        else:
            query = q.view(bsz, steps, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
            query = query.reshape(bsz, kv_heads, groups * steps, head_dim)
            by_row = positions.repeat(1, groups) if groups > 1 else positions
            query_pos = by_row.reshape(bsz, 1, groups * steps, 1) if masked else None
        if cache is not None:
            self._store(cache, k, v, bsz, steps, positions)
            keys, values = cache.key.narrow(2, 0, span), cache.value.narrow(2, 0, span)
            mask = None if query_pos is None else cache.slot_ids(span) <= query_pos
        else:
            keys = k.view(bsz, steps, kv_heads, head_dim).transpose(1, 2)
            values = v.view(bsz, steps, kv_heads, head_dim).transpose(1, 2)
            mask = None if query_pos is None else positions.reshape(bsz, 1, 1, steps) <= query_pos
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
        if steps == 1:
            attn = out.reshape(bsz, heads * head_dim)
        else:
            attn = out.view(bsz, kv_heads, groups, steps, head_dim).permute(0, 3, 1, 2, 4)
            attn = attn.reshape(bsz * steps, heads * head_dim)

        hidden = linear_add(residual, attn, f.o_t, f.o_bias)
        gate, up = F.linear(F.rms_norm(hidden, shape, *f.post_norm), f.gate_up, f.gate_up_bias).chunk(2, dim=-1)
        return linear_add(hidden, f.act(gate) * up, f.down_t, f.down_bias)

    def _greedy(self, f: Fused, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target ids ``[N]`` of pre-norm rows ``[N, H]``."""
        normed = F.rms_norm(hidden, (hidden.shape[-1],), *f.final_norm)
        return f.target_ids.take(F.linear(normed, f.lm_head).argmax(dim=-1))

    # ----------------------------------------------------------------------------- the engine's calls
    def _verified(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_valid: torch.Tensor | Sequence[int] | None,
        *,
        minimum: int,
        want_last: bool,
    ) -> tuple[torch.Tensor, Counts | None, Fused]:
        """The first pass's inputs over verified positions: (fc features ``[B·T, H]``, the parsed counts, weights).

        ``propose`` runs the whole layer over them (``_pass``), ``extend`` its key/value side (``_append``).
        """
        if next_ids.dim() != 2 or next_ids.shape[0] != cache.batch_size:
            raise ValueError(f"next_ids has shape {tuple(next_ids.shape)}, expected (batch={cache.batch_size}, T)")
        features = self._aux_features(aux)
        if tuple(features.shape[:2]) != tuple(next_ids.shape):
            raise ValueError(
                f"aux states cover (batch, positions) = {tuple(features.shape[:2])} but next_ids has shape "
                f"{tuple(next_ids.shape)}"
            )
        bsz, steps = next_ids.shape
        counts = valid_counts(num_valid, bsz, steps, cache.device, minimum=minimum, want_last=want_last)
        f = self._fused()
        return F.linear(features.reshape(bsz * steps, -1), f.fc), counts, f

    @torch.no_grad()
    def extend(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_valid: torch.Tensor | Sequence[int] | None = None,
    ) -> None:
        """Append target-verified positions to the cache without drafting (a round with no speculation).

        Same inputs as ``propose``; ``num_valid`` entries may be 0 (a row with nothing new this round keeps
        its cache as it was). Afterwards drafting resumes with full context. Only the new positions' keys and
        values are computed (``_append``); the cache ends bit-for-bit as a pass of the whole layer leaves it.
        """
        if next_ids.dim() == 2 and next_ids.shape[1] == 0:
            return
        hidden, counts, f = self._verified(aux, next_ids, cache, num_valid, minimum=0, want_last=False)
        self._append(f, next_ids, hidden, cache, counts)

    @torch.no_grad()
    def propose(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_tokens: int,
        num_valid: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Extend the cache with target-verified positions, then draft ``num_tokens`` target ids per row.

        ``aux``: the target's aux states at the new verified positions (k tensors ``[B, T, H_t]`` in id
        order, or their concatenation); ``next_ids [B, T]``: the token following each of those positions;
        ``num_valid [B]``: how many of the ``T`` are real per row (default all; at least 1 each, checked
        when given as host integers). Returns ``[B, num_tokens]`` target ids; the cache afterwards holds
        only verified positions. No device value is read back to the host.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if next_ids.dim() == 2 and next_ids.shape[1] == 0:
            raise ValueError("propose needs at least one new verified position (next_ids has T = 0); use extend")
        hidden, counts, f = self._verified(aux, next_ids, cache, num_valid, minimum=1, want_last=True)
        # The whole layer over all B·T verified positions (see _layer for why not just the rows read below).
        out = self._pass(f, next_ids, hidden, cache, counts, None)
        bsz, steps = next_ids.shape
        if steps == 1:
            last = out
        elif counts is None or counts.device is None:
            last = out[steps - 1 :: steps]
        elif counts.last is not None:
            last = out.index_select(0, counts.last)
        else:  # counts on the device, unvalidated: clamp rather than index out of range
            last = out.index_select(0, (counts.device - 1).clamp(min=0) + cache._rows(True) * steps)
        token = self._greedy(f, last)
        if num_tokens == 1:
            return token.unsqueeze(1)
        # Draft steps write their keys/values past every row's length and attend through an explicit span;
        # the cache's lengths never move, so it holds exactly the verified positions afterwards.
        cache.reserve(num_tokens - 1)
        host = cache._host
        masked = host is None or any(n != host[0] for n in host)
        position, span = cache.lengths, cache.max_length
        drafts = [token]
        for i in range(num_tokens - 1):
            if i:
                position = position + 1
            span += 1
            last = self._layer(f, token, last, bsz, 1, position, cache, span, masked, cache.capacity)
            token = self._greedy(f, last)
            drafts.append(token)
        return torch.stack(drafts, dim=1)
