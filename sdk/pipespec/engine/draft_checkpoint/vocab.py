"""The draft's vocabulary maps: ``d2t`` offsets (target id = draft id + ``d2t[id]``) and the ``t2d`` mask.

Imports torch; must not read files or import the draft model or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from pipespec.errors import CheckpointError


def vocab_maps(
    tensors: Mapping[str, torch.Tensor], draft_vocab: int, target_vocab: int, path: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from a checkpoint's tensors, checked; zeros offsets and the implied mask when absent."""
    d2t = tensors.get("d2t")
    if d2t is None:
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{path}: d2t has dtype {d2t.dtype}, expected an integer tensor of offsets")
    d2t = d2t.long()
    t2d = tensors.get("t2d")
    check_vocab_maps(d2t, t2d, target_vocab, path)
    if t2d is None:
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True
    return d2t, t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor | None, target_vocab: int, path: Path) -> None:
    target_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t
    bad = ((target_ids < 0) | (target_ids >= target_vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise CheckpointError(
            f"{path}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the target vocabulary "
            f"[0, {target_vocab}) ({bad.numel()} such ids): d2t holds offsets, target id = draft id + d2t[id]"
        )
    if t2d is not None:
        if t2d.numel() != target_vocab:
            raise CheckpointError(f"{path}: t2d has {t2d.numel()} entries but the target vocabulary has {target_vocab}")
        mapped = torch.zeros(target_vocab, dtype=torch.bool)
        mapped[target_ids] = True
        if not torch.equal(mapped, t2d.bool()):
            raise CheckpointError(f"{path}: t2d disagrees with d2t: they mark different target ids as in the draft vocabulary")

