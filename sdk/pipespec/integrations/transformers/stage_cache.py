"""A KV cache for one pipeline stage whose size queries answer from the stage's own layers.

The trap (DESIGN.md, transformers 5.x): ``cache.get_seq_length()`` reads layer 0 and
``create_causal_mask(..., layer_idx=None)`` sizes the mask from the first full-attention layer. A stage
that does not own those layers sees them empty forever, so after the first step its positions restart
at 0 and its masks are one step short — silently wrong decoding at PP >= 2.

``StageCache`` is a ``DynamicCache`` laid out over all N layers with global indices (the model's own
attention code indexes the cache by its global ``layer_idx``), where every layer outside
``[start_layer, end_layer)`` is a ``DummyLayer`` where transformers has one: it stores nothing for other
stages' layers, and a forward that strays into a layer it does not own fails loudly (``update``
refuses it, in every release). Every size query for a layer the stage does not own (``get_seq_length``,
``get_mask_sizes``, ``get_query_offset``) is answered from the stage's first owned layer of the same
kind (sliding or not). transformers 5.2x up to 5.24 skipped dummy layers in those queries itself; 5.25
does not (``DynamicCache.get_seq_length(0)`` reads layer 0, and its ``DummyLayer`` has no
``get_seq_length``), and 5.17 has no dummy layers, so the cache does it in every release.

``crop(max_length)`` keeps the first ``max_length`` positions (speculative rollback); a negative
argument removes that many tokens (transformers 5.24's own ``crop`` convention).
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

try:  # transformers >= 5.2x: layers that hold nothing, skipped by every size query
    from transformers.cache_utils import DummyLayer
except ImportError:  # older 5.x (e.g. 5.17): StageCache remaps size queries itself
    DummyLayer = None

__all__ = ["StageCache", "new_stage_cache"]


class StageCache(DynamicCache):
    """``DynamicCache`` for the layers ``[start_layer, end_layer)`` of one pipeline stage."""

    def __init__(self, config: Any, start_layer: int, end_layer: int, record_past: bool = False) -> None:
        super().__init__(config=config)
        n = len(self.layers)
        if not 0 <= start_layer < end_layer <= n:
            raise ValueError(f"stage layers [{start_layer}, {end_layer}) are not inside the cache's {n} layers")
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.record_past = record_past
        # Each layer's kind, read before other stages' layers become dummies (which have no kind).
        self._sliding = [bool(getattr(layer, "is_sliding", False)) for layer in self.layers]
        if DummyLayer is not None:
            for idx in range(n):
                if not start_layer <= idx < end_layer:
                    self.layers[idx] = DummyLayer()
        if record_past:
            # Sliding-window layers drop old tokens as they go; rollback beyond the window needs them kept
            # until the next crop.
            for layer in self.layers:
                if isinstance(layer, DynamicSlidingWindowLayer):
                    layer.activate_past_recording()

    # --- size queries answer from this stage's own layers ----------------------------------------------
    def _owned(self, layer_idx: int) -> int:
        """``layer_idx`` if this stage owns it, else its first owned layer of the same kind (sliding or not)."""
        if self.start_layer <= layer_idx < self.end_layer:
            return layer_idx
        sliding = self._sliding[layer_idx] if 0 <= layer_idx < len(self._sliding) else False
        for idx in range(self.start_layer, self.end_layer):
            if self._sliding[idx] == sliding:
                return idx
        return self.start_layer

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        """A layer this stage does not own refuses updates in every release (transformers' ``DummyLayer``
        does so where it exists; 5.17-5.19 have none): a stage that strays into another's layers fails."""
        if not self.start_layer <= layer_idx < self.end_layer and not (key_states is None and value_states is None):
            raise NotImplementedError(f"layer {layer_idx} belongs to another pipeline stage: this stage's cache "
                                      f"holds layers [{self.start_layer}, {self.end_layer})")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._owned(layer_idx))

    def get_mask_sizes(self, query_length: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._owned(layer_idx), *args, **kwargs)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return super().get_query_offset(self._owned(layer_idx))  # type: ignore[misc]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions of every owned layer (``max_length < 0``: drop that many)."""
        length = self.get_seq_length()
        if max_length < 0:
            max_length = max(length + max_length, 0)
        if max_length > length:
            raise ValueError(f"cannot crop the stage cache to {max_length} positions: it holds {length}")
        if max_length == length:
            # Nothing to drop. A recording sliding-window layer still trims the past it kept for rollback
            # (transformers' crop(0)); full-attention layers are left alone (crop(0) means "keep 0" in
            # some 5.x releases).
            if self.record_past:
                for idx in range(self.start_layer, self.end_layer):
                    if isinstance(self.layers[idx], DynamicSlidingWindowLayer):
                        self.layers[idx].crop(0)
            return
        for idx in range(self.start_layer, self.end_layer):  # unowned layers hold nothing to crop
            self.layers[idx].crop(max_length - length)

    def __repr__(self) -> str:
        return f"StageCache(layers [{self.start_layer}, {self.end_layer}) of {len(self.layers)}, seq_length={self.get_seq_length()})"


def new_stage_cache(model: Any, record_past: bool = False) -> StageCache:
    """A cache for the stage ``model`` runs (after ``model.set_pipeline_stage(...)``).

    ``record_past=True`` keeps sliding-window layers rollback-able past the window (call ``crop`` after
    every verification step, as speculative decoding does).
    """
    config = model.config
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config(decoder=True)
    return StageCache(config, model.start_layer, model.end_layer, record_past=record_past)
