"""``DraftStorage``: fixed storage that *adopted* draft caches live in, so CUDA graphs see fixed addresses.

Imports ``DraftKVCache`` (whose adopted caches it makes); must not import the model or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec.engine.draft.kv_cache import DraftKVCache


class DraftStorage:
    """Fixed storage for up to ``max_rows`` cache rows that *adopted* caches live in (for CUDA graphs).

    An adopted ``DraftKVCache`` holds views of the storage's first ``B`` rows (keys, values, lengths), so
    the addresses a captured graph reads and writes never change. Whatever would give an adopted cache
    new tensors works in place instead: its lengths advance and crop in place, ``select`` and ``concat``
    (with an adopted cache first) write their rows into the same storage, packed to the front, and return
    a new adopted cache, and ``reserve`` never grows it (past ``capacity`` it is an error). Each of those
    writes makes the storage's earlier adopted caches stale (their views now show other rows): using one
    again raises instead of reading them. Only one adopted cache of a storage is current at a time.

    Slots past a row's length may hold another row's old entries; they are never read (attention is
    bounded or masked by position), as with the padded writes of ragged batches.
    """

    def __init__(
        self, max_rows: int, num_kv_heads: int, head_dim: int, *, capacity: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        if max_rows < 1 or capacity < 1:
            raise ValueError(f"draft storage needs max_rows >= 1 and capacity >= 1, got {max_rows} and {capacity}")
        # Plain tensors even when made inside inference_mode: adopted caches may be written outside it too.
        with torch.inference_mode(False):
            self.key = torch.zeros(max_rows, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
            self.value = torch.zeros_like(self.key)
            self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.generation = 0  # bumped by every write of rows: adopted caches of older generations are stale

    @property
    def max_rows(self) -> int:
        return int(self.key.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.key.shape[2])

    def adopt(self, cache: DraftKVCache) -> DraftKVCache:
        """A cache in this storage with ``cache``'s rows, lengths and host lengths (copied in); ``cache``
        itself when it already lives here. Its earlier adopted caches become stale."""
        if cache._static is self:
            self.check(cache)
            return cache
        return self._fill(0, [cache], cache.max_length, cache._host)

    def check(self, cache: DraftKVCache) -> None:
        """Refuse a stale adopted cache (one whose rows a later adopt/select/concat rewrote)."""
        if cache._generation != self.generation:
            raise RuntimeError(
                "this draft cache is stale: its rows lived in static storage that a later adopt/select/concat "
                "rewrote; use the cache that call returned"
            )

    def _move(
        self, moves: Sequence[tuple[int, int]], rows: int, max_length: int, host: list[int] | None,
    ) -> DraftKVCache:
        """Copy row ``src`` over row ``dst`` for each of ``moves`` (sources at or past ``rows``, so none is
        overwritten before it is read); the adopted cache of the first ``rows`` rows."""
        for dst, src in moves:
            self.key[dst].copy_(self.key[src])
            self.value[dst].copy_(self.value[src])
            self.lengths[dst].copy_(self.lengths[src])
        self.generation += 1
        with torch.inference_mode(False):  # plain views, as in _fill
            key, value, lengths = self.key[:rows], self.value[:rows], self.lengths[:rows]
        return DraftKVCache._of(key, value, lengths, max_length, None if host is None else list(host), static=self)

    def _fill(
        self, start: int, parts: Sequence[DraftKVCache], max_length: int, host: list[int] | None,
    ) -> DraftKVCache:
        """Copy ``parts``' rows in after the first ``start`` rows (kept as they are); the adopted cache of all."""
        rows = start + sum(part.batch_size for part in parts)
        capacity = self.capacity
        if rows > self.max_rows:
            raise ValueError(
                f"{rows} draft cache rows do not fit static storage of {self.max_rows} rows (max_rows); "
                "make the storage (DraftGraphRunner max_rows) as large as the biggest batch"
            )
        mine = (self.key.shape[1], self.key.shape[3], self.key.dtype, self.key.device)
        for part in parts:
            theirs = (part.num_kv_heads, part.head_dim, part.dtype, part.device)
            if theirs != mine:
                raise ValueError(
                    f"cannot place a draft cache with {theirs[0]} kv heads, head_dim {theirs[1]}, {theirs[2]} on "
                    f"{theirs[3]} in static storage with {mine[0]} kv heads, head_dim {mine[1]}, {mine[2]} on {mine[3]}"
                )
            if part.max_length > capacity:
                raise ValueError(
                    f"a draft cache holding up to {part.max_length} positions does not fit static storage of "
                    f"capacity {capacity}; size the capacity for the longest sequence plus the draft's lookahead"
                )
            if part._static is self:  # the current cache: rows [0, start), disjoint from where we write
                self.check(part)
        offset = start
        for part in parts:
            count, width = part.batch_size, min(part.capacity, capacity)
            if count:
                self.key[offset : offset + count, :, :width].copy_(part.key[:, :, :width])
                self.value[offset : offset + count, :, :width].copy_(part.value[:, :, :width])
                self.lengths[offset : offset + count].copy_(part._lengths)
            offset += count
        self.generation += 1
        with torch.inference_mode(False):  # plain views: in-place writes must work inside and outside it
            key, value, lengths = self.key[:rows], self.value[:rows], self.lengths[:rows]
        return DraftKVCache._of(key, value, lengths, max_length, None if host is None else list(host), static=self)
