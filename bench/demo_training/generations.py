"""``--retrain-draft``'s data: the target's own greedy generations and its aux states over them.

EAGLE3's recipe trains the draft on what the target writes, so every label is the target's greedy token.
Imports pipespec's engine helper for the aux states; nothing of vllm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipespec.engine.reference import target_aux_states
from pipespec.integrations.transformers.adapt import cache_kwarg_name, returned_cache


@torch.no_grad()
def greedy_generations(target: Any, prompts: torch.Tensor, new_tokens: int, batch: int,
                       log: Callable[[str], None]) -> torch.Tensor:
    """The target's greedy continuations (KV-cached, no stop at EOS): ``[N, prompt + new_tokens]`` ids."""
    out: list[torch.Tensor] = []
    t0 = time.perf_counter()
    # transformers 5.24 renamed the KV cache keyword (and output field) ``past_key_values`` -> ``cache``; the
    # old name warns there and goes in 5.40, and releases before 5.24 know only the old one.
    kwarg = cache_kwarg_name(type(target))
    for lo in range(0, prompts.shape[0], batch):
        seq = prompts[lo : lo + batch]
        step = target(input_ids=seq, use_cache=True)
        past, pieces = returned_cache(step), [seq]
        nxt = step.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            pieces.append(nxt)
            step = target(input_ids=nxt, use_cache=True, **{kwarg: past})
            past, nxt = returned_cache(step), step.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(nxt)
        out.append(torch.cat(pieces, dim=1))
        if lo == 0 or (lo // batch) % 8 == 7:
            log(f"generations: {lo + seq.shape[0]}/{prompts.shape[0]} sequences  {time.perf_counter() - t0:6.1f}s")
    return torch.cat(out)


@torch.no_grad()
def aux_features(target: Any, seqs: torch.Tensor, aux_ids: Sequence[int], batch: int) -> torch.Tensor:
    """``cat(aux states)`` of the target over every sequence, fp16 ``[N, L, len(aux_ids) * H]`` (computed once:
    the target is frozen, so every draft step reads the same states). Written into one preallocated tensor:
    no second copy at the end (at 131072 sequences of 160 tokens it is 24 GB)."""
    width = len(aux_ids) * int(target.config.hidden_size)
    out = torch.empty(seqs.shape[0], seqs.shape[1], width, dtype=torch.float16, device=seqs.device)
    for lo in range(0, seqs.shape[0], batch):
        _, aux = target_aux_states(target, seqs[lo : lo + batch], aux_ids)
        out[lo : lo + batch].copy_(torch.cat(aux, dim=-1))
    return out
