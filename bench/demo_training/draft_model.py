"""The demo's EAGLE3 draft as training sees it: its pruned vocabulary, a fresh or pruned-from-trained draft,
its trainable state (everything but the target's shared embedding), and the test-time-training forward.

The draft model itself is ``pipespec.engine.draft``'s (the one inference runs); nothing here imports
transformers or vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from bench.demo_training.presets import Preset
from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.info import TargetInfo
from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint

EMBED = "embed_tokens."  # the target's embedding, shared with the draft: never trained, never saved here


def draft_vocabulary(stream: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids in the training stream, sorted (EAGLE3's vocabulary pruning);
    all ``vocab`` of them when ``size`` is larger (e.g. a 320-token target under the full preset's 512)."""
    counts = torch.bincount(stream.long(), minlength=vocab)
    return counts.topk(min(size, vocab)).indices.sort().values


def make_draft(p: Preset, target_config: Any, draft_ids: torch.Tensor, aux_ids: Sequence[int]) -> Eagle3Draft:
    """A freshly initialised draft of ``p``'s sizes whose vocabulary is ``draft_ids`` (target ids, sorted)."""
    config = Eagle3DraftConfig.make(
        hidden_size=p.hidden_size, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        intermediate_size=p.draft_intermediate_size, vocab_size=int(target_config.vocab_size),
        draft_vocab_size=int(draft_ids.numel()), target_hidden_size=int(target_config.hidden_size),
        num_aux=len(aux_ids), rms_norm_eps=1e-5, max_position_embeddings=1024, rope_theta=10000.0,
    )
    draft = Eagle3Draft(config, with_embedding=False)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        draft.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        draft.t2d.zero_()
        draft.t2d[draft_ids] = True
    return draft


def draft_parameters(draft: Eagle3Draft) -> int:
    """Parameters the draft owns (the target's shared embedding left out)."""
    return sum(q.numel() for name, q in draft.named_parameters() if not name.startswith(EMBED))


def trainable_state(draft: Eagle3Draft, clone: bool = False) -> dict[str, torch.Tensor]:
    """The draft's state without the shared embedding (detached copies with ``clone``)."""
    return {k: (v.detach().clone() if clone else v) for k, v in draft.state_dict().items() if not k.startswith(EMBED)}


def load_trainable_state(draft: Eagle3Draft, state: dict[str, torch.Tensor], what: str) -> None:
    """Load ``state`` (as ``trainable_state`` gives it) into ``draft``; ``what`` names it in the error."""
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith(EMBED)]:
        raise RuntimeError(f"{what} does not fit the draft (missing {missing}, unexpected {unexpected})")


def pruned_draft(path: Path, target: Any, sizes: Preset, aux_ids: Sequence[int]) -> tuple[Eagle3Draft, dict[str, Any]]:
    """A trained draft (``path``) as the starting point, its MLP cut to ``sizes.draft_intermediate_size``
    units: the units whose output (``down_proj`` column norm x ``up_proj`` row norm) is smallest go."""
    loaded = load_draft_checkpoint(path, TargetInfo.from_config(target.config), dtype=torch.float32,
                                   target_embed=target.get_input_embeddings())
    old = loaded.model
    if list(loaded.info.aux_layers) != list(aux_ids):
        raise RuntimeError(f"--init-draft {path}: aux layers {list(loaded.info.aux_layers)}, expected {list(aux_ids)}")
    draft_ids = old.to_target_ids(torch.arange(old.d2t.numel()))
    draft = make_draft(sizes, target.config, draft_ids, aux_ids)
    state = trainable_state(old)
    mlp = old.midlayer.mlp
    units = mlp.up_proj.weight.shape[0]
    keep_n = sizes.draft_intermediate_size
    if keep_n > units:
        raise RuntimeError(f"--init-draft {path}: {units} MLP units, cannot grow to {keep_n}")
    score = mlp.down_proj.weight.norm(dim=0) * mlp.up_proj.weight.norm(dim=1)
    keep = score.topk(keep_n).indices.sort().values
    for name in ("gate_proj", "up_proj"):
        state[f"midlayer.mlp.{name}.weight"] = state[f"midlayer.mlp.{name}.weight"][keep]
    state["midlayer.mlp.down_proj.weight"] = state["midlayer.mlp.down_proj.weight"][:, keep]
    load_trainable_state(draft, state, f"--init-draft {path}: state")
    return draft, {"from": str(path), "intermediate_from": units, "intermediate_to": keep_n}


def ttt_logits(draft: Eagle3Draft, feats: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits for ``steps`` unrolled steps over every root position at once.

    Root ``t`` (0 ≤ t ≤ T-2) at step i sits at position ``t + i``, reads token ``x_{t+1+i}`` and
    predicts ``x_{t+2+i}``; its hidden input is ``fc(aux_t)`` at step 0 and its own step i-1 output
    after. It attends to step-0 keys of roots ``≤ t`` (the verified positions at inference) and to its
    own chain's keys of steps 1..i (the draft's speculative cache entries) — the diagonal of each step.
    Tokens past the end are padding; the caller masks their labels.
    """
    layer = draft.midlayer
    bsz, length = ids.shape
    roots = length - 1
    groups = layer.num_heads // layer.num_kv_heads
    scale = layer.head_dim**-0.5
    causal = torch.ones(roots, roots, dtype=torch.bool, device=ids.device).tril()
    hidden = draft.combine_aux(feats[:, :roots])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    for i in range(steps):
        tokens = F.pad(ids[:, 1 + i :], (0, i))
        positions = (torch.arange(roots, device=ids.device) + i).expand(bsz, roots)
        cos, sin = draft.rotary(hidden, positions)
        residual, q, k, v = layer.qkv(draft.embed(tokens), hidden, cos, sin)
        keys.append(k.repeat_interleave(groups, dim=1))
        values.append(v.repeat_interleave(groups, dim=1))
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * keys[j]).sum(-1, keepdim=True) * scale for j in range(1, i + 1)]
        weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        attn = weights[..., :roots] @ values[0]
        for j in range(1, i + 1):
            attn = attn + weights[..., roots + j - 1 : roots + j] * values[j]
        hidden = layer.finish(residual, attn)
        out.append(draft.logits(hidden))
    return out
