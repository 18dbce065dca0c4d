"""The rows of one batched target forward on one stage: a batched KV cache whose rows have their own
lengths, with rejected positions kept as masked *holes* instead of being cropped row by row.

The engine runs a micro-batch's sequences as the rows of one forward per round. A row verifies
``[x_n, d_1..d_k]`` and keeps only ``a + 1`` of those positions; other rows keep other counts, and a
shared ``[B, heads, L, d]`` cache cannot be cropped per row. So every forward appends ``T`` slots to
every row (``T`` = the longest row's token count this round; shorter rows are padded) and a boolean
slot mask records which slots hold real, committed tokens:

* the forward's ``attention_mask`` is ``[B, L + T]``: the mask of the stored slots, then ``j < n_b``
  for the row's ``n_b`` new tokens (padding is masked). transformers combines it with its causal mask
  over slot indices, so a query attends to the committed tokens before it and never to a hole;
* rotary positions are explicit per row (``committed_b + j``), so a row's positions count its tokens,
  not its slots, and a key keeps the position it was written with wherever its slot ends up;
* when the round's message says how many of the new tokens each row kept, ``resolve`` marks the rest
  as holes, crops the columns that are holes in every row (for a single row that is exactly
  ``StageCache.crop``: the same cache state as per-sequence decoding), and compacts the cache when the
  holes grow past a quarter of the longest row (a gather that moves each row's slots to the front, in
  order, so causality by slot index still holds).

Holes only work for full attention: a sliding window counts slots, and linear-attention or
convolution states have no slots to mask. ``batchable(config)`` says whether a model's caches may hold
several rows; where they may not, the engine runs every sequence as its own one-row batch (no
padding, no holes, and the cache is cropped like per-sequence decoding).

The slot mask and the row lengths live on the host (the schedule knows them), so building the mask,
deciding to crop or compact costs no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import functional as F
from transformers.cache_utils import DynamicLayer

from pipespec.engine.row_moves import fill_gaps_order

__all__ = ["RowBatch", "batchable", "pack_bytes", "pad_rows", "to_device", "to_device_many", "unpack_bytes"]


def pad_rows(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Token rows as one host ``[B, max len]`` long tensor, each row right-padded with 0 (padded as lists and
    made with one ``torch.tensor``: a tensor per row cost 0.1 ms at 32 rows, twice a round, on one H200's host)."""
    width = max(len(r) for r in rows)
    return torch.tensor([[*row, *([0] * (width - len(row)))] for row in rows], dtype=torch.long)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory on CUDA, since a copy from pageable memory
    waits for the whole stream first."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pack_bytes(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Host tensors of any dtypes back to back in one uint8 buffer (each at an 8-byte aligned offset, so
    every dtype can be viewed in place on the other side); returns the buffer and the offsets."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 8) * 8
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for t, offset in zip(tensors, offsets):
        flat = t.contiguous().reshape(-1)
        buffer[offset : offset + flat.numel() * flat.element_size()].copy_(flat.view(torch.uint8))
    return buffer, offsets


def unpack_bytes(buffer: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` (made by ``pack_bytes``, possibly copied to a device) shaped and typed as ``like``."""
    return [buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, like)]


def to_device_many(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Several host tensors on ``device`` with one copy: packed into one pinned buffer on CUDA (each copy
    from the host costs tens of microseconds of host time, a round makes three); as they are elsewhere."""
    if device.type != "cuda":
        return list(tensors)
    buffer, offsets = pack_bytes(tensors, pin=True)
    return unpack_bytes(buffer.to(device, non_blocking=True), offsets, tensors)


def batchable(config: Any) -> bool:
    """Whether the model of ``config`` may run several rows with holes: every layer of its cache is a
    plain full-attention ``DynamicLayer``.

    Decided for the whole model, not one stage, so that every stage runs the same forwards: a stage
    with only full-attention layers of a hybrid model must still run one forward per sequence.
    """
    from transformers.cache_utils import DynamicCache

    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config(decoder=True) if callable(get_text_config) else config
    layers = DynamicCache(config=text).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class RowBatch:
    """One batched KV cache on one stage and the requests that are its rows (see the module doc).

    ``rows`` are request ids in row order. ``draft_cache`` is the draft's cache with the same rows, on
    the last stage (``None`` elsewhere or without a draft).
    """

    def __init__(self, cache: Any, rows: Sequence[int], device: torch.device, mask_dtype: torch.dtype | None = None) -> None:
        self.cache = cache
        self.rows = list(rows)
        self.device = device
        self.mask_dtype = mask_dtype  # None: a boolean mask (sdpa, True = attend); else additive (eager: 0 / min)
        self.valid = torch.zeros(len(self.rows), 0, dtype=torch.bool)  # host-side slot mask [B, L]
        self.draft_cache: Any = None
        self._pending: tuple[int, list[int]] | None = None  # (first new slot, committed per row) of the open forward
        self.compactions = 0

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def open(self) -> bool:
        """A forward was run whose kept positions are not known yet (its round's message is due)."""
        return self._pending is not None

    @property
    def slots(self) -> int:
        return int(self.valid.shape[1])

    def _owned_layers(self) -> list[Any]:
        return [self.cache.layers[i] for i in range(self.cache.start_layer, self.cache.end_layer)]

    # ------------------------------------------------------------------------------ one forward
    def inputs(
        self, tokens: Sequence[Sequence[int]], committed: Sequence[int], width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """Inputs of this round's forward: ``(input_ids [B, T], position_ids [B, T], attention_mask or
        None, T)`` for each row's new ``tokens`` after its ``committed`` ones.

        ``attention_mask`` is the finished 4D mask ``[B, 1, T, L + T]`` (transformers uses a 4D mask as
        given): a query sees the stored slots and new tokens that are real and not after it. Built on
        the host from the host-side slot mask, it costs the GPU one copy and no synchronisation, where
        transformers' own mask creation from a 2D mask checks it on the device. ``None`` when there is
        nothing to mask (no hole, no padding), which keeps a one-row batch on exactly the per-sequence
        code path. ``width``: the key width of a fixed-size cache (``pipespec.engine.slot_cache``, whose
        forwards attend to all its slots): the mask is always built, and slots past the new tokens are
        masked.
        """
        if len(tokens) != self.size or len(committed) != self.size:
            raise ValueError(f"{len(tokens)} token rows / {len(committed)} lengths for a batch of {self.size} rows")
        if self._pending is not None:
            raise RuntimeError("the previous forward of this batch was not resolved yet")
        steps = max(len(t) for t in tokens)
        if min(len(t) for t in tokens) < 1:
            raise ValueError("every row needs at least one new token")
        ids = pad_rows(tokens)
        new_valid = torch.arange(steps) < torch.tensor([len(t) for t in tokens])[:, None]
        positions = torch.tensor(committed, dtype=torch.long)[:, None] + torch.arange(steps)
        holes = bool((~self.valid).any()) or not bool(new_valid.all())
        mask = self._mask(torch.cat((self.valid, new_valid), dim=1), steps, width) if holes or width else None
        self._pending = (self.slots, list(committed))
        self.valid = torch.cat((self.valid, torch.zeros(self.size, steps, dtype=torch.bool)), dim=1)
        device = self.device
        if mask is None:
            ids, positions = to_device_many([ids, positions], device)
            return ids, positions, None, steps
        ids, positions, mask = to_device_many([ids, positions, mask], device)
        return ids, positions, mask, steps

    def _mask(self, keys: torch.Tensor, steps: int, width: int | None = None) -> torch.Tensor:
        """The 4D attention mask for real ``keys [B, L + T]`` and ``steps`` new queries at slots L.. ;
        ``width`` > L + T pads it with masked slots."""
        total = keys.shape[1]
        first = total - steps
        if width is not None:
            if width < total:
                raise RuntimeError(f"{total} slots do not fit a cache of width {width}")
            keys = F.pad(keys, (0, width - total))
        causal = torch.arange(keys.shape[1])[None, :] <= (first + torch.arange(steps))[:, None]  # [T, width]
        allowed = (keys[:, None, :] & causal[None])[:, None]  # [B, 1, T, width]
        if self.mask_dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=self.mask_dtype).masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)

    def resolve(self, committed: Sequence[int]) -> None:
        """Close the open forward: row ``b`` now has ``committed[b]`` tokens (it kept ``committed[b]``
        minus its count before the forward of the new slots; the others become holes)."""
        if self._pending is None:
            raise RuntimeError("no forward of this batch is open")
        start, before = self._pending
        self._pending = None
        for b, (old, new) in enumerate(zip(before, committed, strict=True)):
            kept = new - old
            if not 0 <= kept <= self.slots - start:
                raise RuntimeError(f"row {b} (request {self.rows[b]}) kept {kept} of {self.slots - start} new positions")
            self.valid[b, start : start + kept] = True
        self._trim()

    # ------------------------------------------------------------------------------ housekeeping
    def _trim(self) -> None:
        """Crop the trailing all-hole columns; compact when holes exceed a quarter of the longest row (and 8):
        a compaction costs one copy of the cache, which every forward of a DynamicCache already pays."""
        used = self.valid.any(dim=0).nonzero()
        length = int(used.max()) + 1 if used.numel() else 0
        if length < self.slots or getattr(self.cache, "record_past", False):
            self.cache.crop(length)  # at equal length this only trims what sliding-window layers recorded
            self.valid = self.valid[:, :length]
        longest = int(self.valid.sum(dim=1).max()) if self.size else 0
        if self.slots > longest + max(8, longest // 4):
            self._compact(longest)

    def _compact(self, longest: int) -> None:
        """Move each row's committed slots to the front (in order); shorter rows end in holes."""
        index = torch.zeros(self.size, longest, dtype=torch.long)
        valid = torch.zeros(self.size, longest, dtype=torch.bool)
        for b in range(self.size):
            kept = self.valid[b].nonzero().flatten()
            index[b, : kept.numel()] = kept
            valid[b, : kept.numel()] = True
        gather = to_device(index, self.device)
        for layer in self._owned_layers():
            layer.keys = _gather_slots(layer.keys, gather)
            layer.values = _gather_slots(layer.values, gather)
        self.valid = valid
        self.compactions += 1

    def drop(self, requests: set[int]) -> None:
        """Remove the rows of ``requests`` (finished or cancelled), from the draft cache too. The last rows
        fill the gaps (``pipespec.engine.row_moves``): the order of rows is free, and fixed buffers then
        copy only the rows that move."""
        keep = [b for b, r in enumerate(self.rows) if r not in requests]
        if len(keep) == self.size:
            return
        order = fill_gaps_order(self.size, keep)
        index = torch.tensor(order, dtype=torch.long)
        if order:
            on_device: torch.Tensor | None = None
            for layer in self._owned_layers():
                if layer.keys is None or not layer.keys.numel():
                    continue
                select_rows = getattr(layer, "select_rows", None)  # a SlotLayer moves rows in place
                if select_rows is not None:
                    select_rows(order)
                    continue
                if on_device is None:
                    on_device = to_device(index, self.device)
                layer.keys = layer.keys.index_select(0, on_device)
                layer.values = layer.values.index_select(0, on_device)
            if self.draft_cache is not None:
                self.draft_cache = self.draft_cache.select(order)
        self.rows = [self.rows[b] for b in order]
        self.valid = self.valid[index]
        if keep:
            self._trim()

    @classmethod
    def merge(cls, batches: Sequence[RowBatch]) -> RowBatch:
        """One batch holding the rows of ``batches`` in order (none may have an open forward); shorter
        caches are padded with holes at the end. The first batch's cache object is reused."""
        if not batches:
            raise ValueError("nothing to merge")
        if any(b._pending is not None for b in batches):
            raise RuntimeError("cannot merge a batch whose forward is still open")
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        length = max(b.slots for b in batches)
        layers = [b._owned_layers() for b in batches]
        for i, layer in enumerate(layers[0]):
            parts = [ls[i] for ls in layers]
            layer.keys = torch.cat([_pad_slots(p.keys, length) for p in parts], dim=0)
            layer.values = torch.cat([_pad_slots(p.values, length) for p in parts], dim=0)
        merged = cls(first.cache, [r for b in batches for r in b.rows], first.device, first.mask_dtype)
        merged.valid = torch.cat([F.pad(b.valid, (0, length - b.slots)) for b in batches], dim=0)
        if first.draft_cache is not None:
            merged.draft_cache = type(first.draft_cache).concat([b.draft_cache for b in batches])
        return merged


def _pad_slots(t: torch.Tensor, length: int) -> torch.Tensor:
    """Pad ``[B, heads, L, d]`` to ``length`` slots (zeros: masked holes)."""
    return F.pad(t, (0, 0, 0, length - t.shape[2])) if t.shape[2] < length else t


def _gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[b, :, index[b], :]`` for ``[B, heads, L, d]`` and ``index [B, L']``."""
    bsz, heads, _, dim = t.shape
    return t.gather(2, index[:, None, :, None].expand(bsz, heads, index.shape[1], dim))
