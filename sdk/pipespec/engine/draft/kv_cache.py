"""``DraftKVCache``: per-row keys/values of the draft's one attention layer, position-aligned with the target.

Rows are selected, concatenated, cropped (validated rollback) and written with host-known lengths where
possible, so no call reads a device value back. Imports torch and ``counts``; ``storage`` only for types
(it imports this module); must not import the model or the engine.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from pipespec.engine.draft.counts import Counts, long_on, valid_counts
from pipespec.engine.row_moves import in_place_moves

if TYPE_CHECKING:
    from pipespec.engine.draft.storage import DraftStorage


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[start, stop)`` covering ``rows`` in order (so selection needs no index tensor)."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


class DraftKVCache:
    """Per-row key/value storage of the draft's single attention layer, position-aligned with the target.

    ``lengths[b]`` (a device tensor) is how many positions row ``b`` holds; slot ``t`` is target position
    ``t``. Writes of a ragged batch put every row's ``T`` new entries at ``lengths[b] ..`` and advance
    ``lengths`` by that row's valid count only: padded entries lie beyond ``lengths`` and are masked out
    and overwritten later. ``crop`` rolls rows back; nothing is freed.

    ``max_length`` is a host-side upper bound of ``max(lengths)``: it sizes writes and attention spans
    without a device sync. While every update came with host-known counts (``num_valid`` as integers, int
    or list crops) the cache also keeps ``host_lengths``, and ``max_length`` is then exact.

    A cache may be *adopted* into a ``DraftStorage`` (``storage`` is then that storage): it then works in
    place in fixed tensors; see ``DraftStorage``.
    """

    def __init__(
        self, batch_size: int, num_kv_heads: int, head_dim: int, *, capacity: int = 256,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        if batch_size < 0 or capacity < 0:
            raise ValueError(f"a draft cache needs batch_size >= 0 and capacity >= 0, got {batch_size} and {capacity}")
        key = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._set(key, torch.zeros_like(key), lengths, 0, [0] * batch_size)

    def _set(
        self, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, max_length: int, host: list[int] | None,
        static: DraftStorage | None = None,
    ) -> None:
        self.key, self.value = key, value
        self._static = static  # the storage this cache is adopted into (its tensors are views of it), or None
        self._generation = 0 if static is None else static.generation
        self._lengths = lengths
        self._host = host
        self.max_length = max_length
        self._slot_ids: torch.Tensor | None = None  # arange over slots on the cache's device, grown lazily
        self._row_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # arange(B) as [B] and [B, 1], kept

    @classmethod
    def _of(
        cls, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, max_length: int, host: list[int] | None,
        static: DraftStorage | None = None,
    ) -> DraftKVCache:
        cache = cls.__new__(cls)
        cache._set(key, value, lengths, max_length, host, static)
        return cache

    # ------------------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        return int(self.key.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[1])

    @property
    def capacity(self) -> int:
        return int(self.key.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.key.shape[3])

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def device(self) -> torch.device:
        return self.key.device

    @property
    def storage(self) -> DraftStorage | None:
        """The ``DraftStorage`` this cache is adopted into, or None."""
        return self._static

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        # Set from outside: the host copy can no longer be trusted (max_length must stay an upper bound).
        if self._static is not None:
            self._static.check(self)
            self._lengths.copy_(value)
        else:
            self._lengths = value
        self._host = None

    @property
    def host_lengths(self) -> tuple[int, ...] | None:
        """Every row's length as host integers, when all updates were host-known; else None."""
        return None if self._host is None else tuple(self._host)

    # ------------------------------------------------------------------------------ rows
    def select(self, rows: Sequence[int]) -> DraftKVCache:
        """A new cache holding copies of ``rows`` (in that order); same capacity, dtype and device.

        On an adopted cache the rows are written back into its storage (packed to the front) and the
        result is adopted there too; this cache is stale afterwards. Where only rows from past the new row
        count move into its gaps (``RowBatch.drop``'s order) just those rows are copied, within the storage.
        """
        if self._static is not None:
            self._static.check(self)
        size = self.batch_size
        picked = [operator.index(r) for r in rows]
        bad = [r for r in picked if not 0 <= r < size]
        if bad:
            raise ValueError(f"select rows {bad} are outside the cache's {size} rows")
        host = None if self._host is None else [self._host[r] for r in picked]
        max_length = self.max_length if host is None else max(host, default=0)
        if self._static is not None:
            moves = in_place_moves(picked, size)
            if moves is not None:  # the rows past the new count fill its gaps: move them within the storage
                return self._static._move(moves, len(picked), max_length, host)
        runs = _runs(picked)

        def take(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[a:b] for a, b in runs]) if runs else t[:0].clone()

        picked_rows = DraftKVCache._of(take(self.key), take(self.value), take(self._lengths), max_length, host)
        if self._static is None:
            return picked_rows
        return self._static._fill(0, [picked_rows], max_length, host)

    @classmethod
    def concat(cls, caches: Sequence[DraftKVCache]) -> DraftKVCache:
        """One cache holding the rows of ``caches`` in order; smaller capacities are padded to the largest.

        When the first cache is adopted, the others' rows are written into its storage after its own (which
        stay in place) and the result is adopted there, with the storage's capacity; the first is stale
        afterwards.
        """
        parts = list(caches)
        if not parts:
            raise ValueError("DraftKVCache.concat needs at least one cache")
        first = parts[0]
        for i, part in enumerate(parts[1:], start=1):
            mine = (part.num_kv_heads, part.head_dim, part.dtype, part.device)
            theirs = (first.num_kv_heads, first.head_dim, first.dtype, first.device)
            if mine != theirs:
                raise ValueError(
                    f"cannot concat draft caches: cache {i} has {mine[0]} kv heads, head_dim {mine[1]}, {mine[2]} on "
                    f"{mine[3]}; cache 0 has {theirs[0]} kv heads, head_dim {theirs[1]}, {theirs[2]} on {theirs[3]}"
                )
        host: list[int] | None = []
        for part in parts:
            host = None if host is None or part._host is None else host + part._host
        static = first._static
        if static is not None:
            static.check(first)
            return static._fill(first.batch_size, parts[1:], max(part.max_length for part in parts), host)
        capacity = max(part.capacity for part in parts)

        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            padded = [t if t.shape[2] == capacity else F.pad(t, (0, 0, 0, capacity - t.shape[2])) for t in tensors]
            return torch.cat(padded)

        return cls._of(
            stack([p.key for p in parts]), stack([p.value for p in parts]), torch.cat([p._lengths for p in parts]),
            max(part.max_length for part in parts), host,
        )

    # ------------------------------------------------------------------------------ storage
    def reserve(self, extra: int) -> None:
        """Grow storage (doubling) so ``extra`` more positions fit after the longest row.

        An adopted cache never grows: past its storage's capacity this raises.
        """
        needed = self.max_length + extra
        if self._static is not None:
            self._static.check(self)
            if needed > self.capacity:
                raise ValueError(
                    f"the draft cache is adopted into static storage of capacity {self.capacity}, which does not "
                    f"grow: {extra} more positions after the longest row ({self.max_length}) need {needed}; size "
                    "the capacity for the longest sequence plus the widest update plus the draft's lookahead"
                )
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        pad = new_cap - self.capacity
        self.key = F.pad(self.key, (0, 0, 0, pad))
        self.value = F.pad(self.value, (0, 0, 0, pad))

    def slot_ids(self, count: int) -> torch.Tensor:
        """``arange(count)`` on the cache's device, sliced from a kept range (no kernel per call)."""
        ids = self._slot_ids
        if ids is None or ids.shape[0] < count:
            ids = torch.arange(max(count, self.capacity), device=self.key.device)
            self._slot_ids = ids
        return ids[:count]

    def crop(self, lengths: int | Sequence[int] | torch.Tensor) -> None:
        """Keep only the first ``lengths`` positions (an int for every row, or one per row).

        Rolling forward is refused: a row cannot claim positions it never wrote. Validation reads lengths on
        the host: free for ints and lists while ``host_lengths`` is known, a device sync otherwise.
        """
        size = self.batch_size
        if isinstance(lengths, torch.Tensor):
            if lengths.dim() > 1 or (lengths.dim() == 1 and lengths.shape[0] != size):
                raise ValueError(f"crop lengths have shape {tuple(lengths.shape)}, the cache has {size} rows")
            values = [int(lengths)] * size if lengths.dim() == 0 else [int(n) for n in lengths.tolist()]
        elif isinstance(lengths, int):
            values = [lengths] * size
        else:
            values = [operator.index(n) for n in lengths]
            if len(values) != size:
                raise ValueError(f"crop lengths have shape ({len(values)},), the cache has {size} rows")
        if self._static is not None:
            self._static.check(self)
        current = self._host if self._host is not None else [int(n) for n in self._lengths.tolist()]
        if any(not 0 <= new <= old for new, old in zip(values, current, strict=True)):
            raise ValueError(f"crop to {values} is outside the cached lengths {current}")
        if self._static is not None:  # in place: the storage's addresses stay
            if isinstance(lengths, int):
                self._lengths.fill_(lengths)
            else:
                self._lengths.copy_(long_on(values, self._lengths.device))
        elif isinstance(lengths, int):
            self._lengths = torch.full_like(self._lengths, lengths)
        else:
            self._lengths = long_on(values, self._lengths.device)
        self._host = values
        self.max_length = max(values, default=0)

    def write(
        self, key: torch.Tensor, value: torch.Tensor, num_valid: torch.Tensor | Sequence[int] | None,
    ) -> torch.Tensor:
        """Store ``[B, kvh, T, d]`` new entries; return their slot indices ``[B, T]`` (pre-advance)."""
        steps = key.shape[2]
        counts = valid_counts(num_valid, self.batch_size, steps, self.device, minimum=0)
        self.reserve(steps)
        slots = self._lengths[:, None] + self.slot_ids(steps)
        self._put(key.transpose(1, 2), value.transpose(1, 2), slots)
        self._advance(steps, counts)
        return slots

    def _rows(self, flat: bool) -> torch.Tensor:
        """``arange(B)`` on the cache's device: ``[B]`` (``flat``) or ``[B, 1]``; made once per cache."""
        rows = self._row_ids
        if rows is None:
            ids = torch.arange(self.batch_size, device=self.key.device)
            rows = self._row_ids = (ids, ids.unsqueeze(1))
        return rows[0] if flat else rows[1]

    def _put(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[B, T, kvh, d]`` at ``slots [B, T]``, or ``[B, kvh, d]`` at ``slots [B]``.

        One ``index_put_`` per tensor: the entries go in their projection layout (no transpose, no index
        expansion). Slots must fit the capacity (``reserve``); lengths are not advanced (``_advance``).
        """
        index = [self._rows(slots.dim() == 1), None, slots]
        dtype = self.key.dtype
        torch.ops.aten.index_put_(self.key, index, key if key.dtype == dtype else key.to(dtype))
        torch.ops.aten.index_put_(self.value, index, value if value.dtype == dtype else value.to(dtype))

    def _advance(self, steps: int, counts: Counts | None) -> None:
        """Count ``steps`` newly written positions for every row, or ``counts`` of them where given."""
        added: torch.Tensor | int = steps if counts is None or counts.device is None else counts.device
        if self._static is not None:  # in place: the storage's addresses stay
            self._lengths.add_(added)
        else:
            self._lengths = self._lengths + added
        self._count(steps, None if counts is None else counts.host, every=isinstance(added, int))

    def _count(self, steps: int, host_counts: Sequence[int] | None, *, every: bool) -> None:
        """The host side of an advance (device lengths untouched): every row by ``steps`` (``every``), or
        by ``host_counts`` when known (else the host lengths are lost and ``max_length`` grows by ``steps``)."""
        if every:
            self._host = None if self._host is None else [n + steps for n in self._host]
            self.max_length += steps
        elif self._host is not None and host_counts is not None:
            self._host = [n + c for n, c in zip(self._host, host_counts, strict=True)]
            self.max_length = max(self._host, default=0)
        else:
            self._host = None
            self.max_length += steps
