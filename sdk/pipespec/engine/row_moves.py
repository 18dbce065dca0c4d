"""Which rows move when rows leave a batch: the order that fills each gap from the end, and the copies it takes.

Dropping finished rows from a batched cache by gathering the rows left (``index_select``) copies every
row, into new memory, and the fixed buffers of CUDA graphs (``pipespec.engine.slot_cache``,
``pipespec.engine.draft.storage``) then copy it all back. On one H200 at c = 32 each such drop cost a
decode round 3-7 ms more (the rounds are ~3 ms), for every sequence that finished before the others.
The rows of a batch have no order that matters (every consumer keys them by request), so the rows past
the new row count fill the gaps left below it instead: only as many rows move as left, and they move
within the buffers.

Pure Python; must not import torch, the engine or the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fill_gaps_order", "in_place_moves"]


def fill_gaps_order(size: int, keep: Sequence[int]) -> list[int]:
    """The new row order (old indices) of a batch of ``size`` rows that keeps the rows ``keep``: each kept
    row below ``len(keep)`` stays where it is, and the kept rows at or past it fill the gaps, in order."""
    kept = set(keep)
    if len(kept) != len(keep) or any(not 0 <= row < size for row in keep):
        raise ValueError(f"rows to keep {list(keep)} are not distinct rows of a batch of {size}")
    count = len(keep)
    movers = iter(sorted(row for row in kept if row >= count))
    return [row if row in kept else next(movers) for row in range(count)]


def in_place_moves(order: Sequence[int], size: int) -> list[tuple[int, int]] | None:
    """The ``(destination, source)`` row copies that turn a batch of ``size`` rows into ``order`` in place,
    or None when one would overwrite a row still to be read (some row moves from below ``len(order)``)."""
    count = len(order)
    if count > size or any(not 0 <= row < size for row in order):
        raise ValueError(f"row order {list(order)} does not select rows of a batch of {size}")
    moves = [(dst, src) for dst, src in enumerate(order) if src != dst]
    if any(src < count for _, src in moves) or len({src for _, src in moves}) != len(moves):
        return None
    return moves
