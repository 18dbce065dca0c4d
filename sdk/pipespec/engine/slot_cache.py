"""Fixed-address KV storage for a micro-batch's running rows: what a CUDA graph of a decode forward needs.

A captured CUDA graph replays the very kernels it recorded, on the very addresses. transformers'
``DynamicLayer`` grows its keys by concatenation, so every forward writes to new memory; a graph of
it would replay into freed memory. ``SlotStore`` keeps, per micro-batch and stage, one preallocated
``[max_rows, kv_heads, capacity, head_dim]`` key and value buffer per owned layer, for as long as the
run lasts, and puts ``SlotLayer``s over them in a ``StageCache``:

* a forward's ``T`` new keys/values go to slots ``[length, length + T)`` of every row with
  ``index_copy_`` through a device index tensor that ``SlotStore.begin(T)`` fills before the forward
  (a graph reads it at replay, so the write position is not baked into the graph);
* attention always reads all ``capacity`` slots of the first ``rows`` rows, and the engine's 4D mask
  (``RowBatch.inputs(..., width=capacity)``) hides every slot that is not a committed token of the row
  or a new token before the query; a shape ``(rows, T)`` therefore has one graph whatever the length;
* the ``RowBatch`` housekeeping keeps working unchanged: assigning ``layer.keys``/``layer.values``
  (compaction's gather, dropping rows, merging new rows in, adopting a freshly prefilled batch) copies
  into the buffers in place, and ``crop`` only moves the length.

Lengths and row counts are host integers (the schedule knows them), the same on every owned layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from pipespec.engine.row_moves import in_place_moves

__all__ = ["SlotLayer", "SlotStore", "slot_bytes"]


def slot_bytes(config: Any, layers: int, rows: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of one ``SlotStore``'s buffers for ``layers`` owned layers of the model of ``config``: keys
    and values of ``rows`` x ``capacity`` slots per layer (made before any is used, so the engine can
    check they fit first)."""
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config(decoder=True) if callable(get_text_config) else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * layers * rows * kv_heads * capacity * head_dim * torch.empty(0, dtype=dtype).element_size()


class SlotLayer(DynamicLayer):
    """One layer's keys/values in fixed buffers (see the module doc); ``keys``/``values`` read as the
    filled part ``[rows, heads, length, d]`` and assigning them copies into the buffers."""

    def __init__(self, store: SlotStore, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        # No super().__init__: it would assign keys/values = None through the properties below.
        self.store = store
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        # (rows, length) filled, for keys and values apart: code that assigns keys and then reads the
        # layer's values to build its own (RowBatch.merge) must see the values as they still are.
        self._filled = {"keys": (0, 0), "values": (0, 0)}
        self.is_initialized = True
        self.device = key_buffer.device
        self.dtype = key_buffer.dtype

    # --------------------------------------------------------------------------- the filled part
    @property
    def rows(self) -> int:
        return self._common()[0]

    @property
    def length(self) -> int:
        return self._common()[1]

    @length.setter
    def length(self, length: int) -> None:
        rows = self.rows
        self._filled = {"keys": (rows, length), "values": (rows, length)}

    def _common(self) -> tuple[int, int]:
        keys, values = self._filled["keys"], self._filled["values"]
        if keys != values:
            raise RuntimeError(f"a slot layer's keys hold (rows, slots) {keys} but its values {values}")
        return keys

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor:
        rows, length = self._filled["keys"]
        return self.key_buffer[:rows, :, :length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("keys", self.key_buffer, value)

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor:
        rows, length = self._filled["values"]
        return self.value_buffer[:rows, :, :length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("values", self.value_buffer, value)

    def _assign(self, which: str, buffer: torch.Tensor, value: torch.Tensor | None) -> None:
        if value is None:  # transformers' reset: empty, storage kept
            self._filled[which] = (0, 0)
            return
        rows, heads, length, dim = value.shape
        if rows > buffer.shape[0] or length > buffer.shape[2] or (heads, dim) != (buffer.shape[1], buffer.shape[3]):
            raise RuntimeError(
                f"{rows} rows x {length} slots of [{heads}, {dim}] do not fit the slot buffers "
                f"[{buffer.shape[0]}, {buffer.shape[1]}, {buffer.shape[2]}, {buffer.shape[3]}]"
            )
        if value.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            value = value.clone()  # a view of the buffer itself: overlapping copies are undefined
        buffer[:rows, :, :length].copy_(value)
        self._filled[which] = (rows, length)

    def select_rows(self, order: Sequence[int]) -> None:
        """Keep the rows ``order`` (old row indices, in their new order). When every row that moves comes
        from past the new row count (``RowBatch.drop``'s order: the last rows fill the gaps) they are copied
        in place, row by row; otherwise the whole filled part is gathered and copied back."""
        rows, length = self._common()
        moves = in_place_moves(order, rows)
        if moves is not None:
            for dst, src in moves:
                self.key_buffer[dst, :, :length].copy_(self.key_buffer[src, :, :length])
                self.value_buffer[dst, :, :length].copy_(self.value_buffer[src, :, :length])
            self._filled = {"keys": (len(order), length), "values": (len(order), length)}
            return
        index = torch.tensor(list(order), dtype=torch.long, device=self.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    # --------------------------------------------------------------------------- transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the buffers exist from the start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, _, steps, _ = key_states.shape
        held, length = self._common()
        if rows != held:
            raise RuntimeError(f"a forward of {rows} rows on a slot cache holding {held}")
        if length + steps > self.key_buffer.shape[2]:
            raise RuntimeError(f"{length} + {steps} slots exceed the slot cache's capacity {self.key_buffer.shape[2]}")
        index = self.store.write_index(steps)
        self.key_buffer[:rows].index_copy_(2, index, key_states.to(self.dtype))
        self.value_buffer[:rows].index_copy_(2, index, value_states.to(self.dtype))
        self.length = length + steps
        return self.key_buffer[:rows], self.value_buffer[:rows]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # type: ignore[override]
        return int(self.key_buffer.shape[2]), 0

    def get_max_length(self) -> int:
        return int(self.key_buffer.shape[2])

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` forgets the last ``n`` slots (transformers' convention); nothing is moved."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of slots to remove")
        self.length = max(self.length + tokens_to_remove, 0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]


class SlotStore:
    """One micro-batch's fixed KV storage on one stage, and the ``StageCache`` over it (``cache``).

    ``max_rows`` rows of ``capacity`` slots per owned layer; the buffers are made at the first ``adopt``
    (their head count and size come from the adopted cache's layers) and kept for the whole run.
    """

    def __init__(self, new_cache: Any, max_rows: int, capacity: int, device: torch.device) -> None:
        self.cache = new_cache()  # a StageCache: its owned layers become SlotLayers at the first adopt
        self.max_rows, self.capacity, self.device = max_rows, capacity, device
        self._slots = torch.arange(capacity, device=device)
        self._index = torch.zeros(capacity, dtype=torch.long, device=device)
        self._steps = 0

    @property
    def layers(self) -> list[SlotLayer]:
        return [self.cache.layers[i] for i in range(self.cache.start_layer, self.cache.end_layer)]

    @property
    def ready(self) -> bool:
        return isinstance(self.cache.layers[self.cache.start_layer], SlotLayer)

    def adopt(self, cache: Any) -> Any:
        """Copy the rows of ``cache`` (a StageCache of the same stage) into the buffers; returns ``self.cache``."""
        if cache is self.cache:
            return cache
        owned = range(self.cache.start_layer, self.cache.end_layer)
        if not self.ready:
            for i in owned:
                keys = cache.layers[i].keys
                shape = (self.max_rows, keys.shape[1], self.capacity, keys.shape[3])
                self.cache.layers[i] = SlotLayer(
                    self, torch.zeros(shape, dtype=keys.dtype, device=self.device),
                    torch.zeros(shape, dtype=keys.dtype, device=self.device),
                )
        for i in owned:
            layer, source = self.cache.layers[i], cache.layers[i]
            layer.keys, layer.values = source.keys, source.values
        return self.cache

    @property
    def length(self) -> int:
        """Slots in use (the same on every owned layer)."""
        return self.layers[0].length

    @property
    def rows(self) -> int:
        return self.layers[0].rows

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def begin(self, steps: int) -> None:
        """Before a forward of ``steps`` new slots per row: point the write index at ``[length, length + steps)``."""
        length = self.length
        if length + steps > self.capacity:
            raise RuntimeError(f"{length} + {steps} slots exceed the slot cache's capacity {self.capacity}")
        torch.add(self._slots[:steps], length, out=self._index[:steps])
        self._steps = steps

    def write_index(self, steps: int) -> torch.Tensor:
        if steps != self._steps:
            raise RuntimeError(f"a forward of {steps} new slots after begin({self._steps})")
        return self._index[:steps]
