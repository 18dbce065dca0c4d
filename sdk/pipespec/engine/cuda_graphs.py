"""Decode forwards of one stage replayed from CUDA graphs (``--cuda-graphs``).

A small or medium model's decode step on a GPU is bound by the host: measured on an H200, a 4-layer
stage forward costs ~3.5 ms of Python and kernel launches for ~0.3 ms of kernels
(``pipespec.bench.phases``). A CUDA graph records those kernels once and replays them with one launch.

``GraphedForwards`` runs the verify forwards of one micro-batch, whose running rows live in a
``SlotStore`` (fixed addresses; ``pipespec.engine.slot_cache``). Per shape ``(rows, T)`` it keeps
static input tensors (token ids or the received hidden states, positions, the 4D mask) and captures
``TargetStage.forward`` once: a warm-up run on a side stream, then the capture, both on the real
inputs (they write the very slots the replay writes again). Every later forward of that shape copies
its inputs into the static tensors, points the store's write index at the next free slots and replays;
its outputs are the graph's static outputs, valid until the next forward of this micro-batch (the
engine consumes them first: the hop sender packs them into its own buffer, the last stage reads its
logits and hands the aux states to the draft). All graphs of a stage share one memory pool; they are
replayed one at a time on one stream.

A shape whose capture fails (an operation that reads a device value on the host, say) is run eagerly
from then on, with one warning. Prefill forwards (a new length each time) are never graphed.

``mode="emulate"`` (CPU, for tests) keeps everything the same except the graph: the captured callable
is re-executed on the static tensors, so the static-input plumbing, the fixed shapes and the slot
bookkeeping are exercised without a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.engine.slot_cache import SlotStore

__all__ = ["GraphedForwards", "GraphMode"]

GraphMode = Literal["cuda", "emulate"]


@dataclass
class _Entry:
    """One captured shape: its static inputs and the replay (which returns the static output)."""

    ids: torch.Tensor | None
    received: dict[str, torch.Tensor] | None
    positions: torch.Tensor
    mask: torch.Tensor
    run: Callable[[], Any]  # replays (cuda) or re-executes (emulate); returns the output


class GraphedForwards:
    """The graphed verify forwards of one micro-batch on one stage (see the module doc)."""

    def __init__(self, target: Any, store: SlotStore, mode: GraphMode, pool: Any = None) -> None:
        self.target, self.store, self.mode, self.pool = target, store, mode, pool
        self.entries: dict[tuple[int, int], _Entry | None] = {}  # None: this shape runs eagerly
        self.captured = 0
        self.replays = 0
        self.eager_forwards = 0

    def __call__(
        self, positions: torch.Tensor, mask: torch.Tensor, input_ids: torch.Tensor | None = None,
        received: Mapping[str, torch.Tensor] | None = None,
    ) -> Any:
        """``TargetStage.forward`` of this micro-batch's rows on the store's cache, from a graph when possible."""
        store = self.store
        rows, steps = positions.shape
        key = (rows, steps)
        store.begin(steps)
        if key not in self.entries:
            self.entries[key] = self._capture(positions, mask, input_ids, received)
        entry = self.entries[key]
        if entry is None:
            self.eager_forwards += 1
            return self._forward(positions, mask, input_ids, received)
        entry.positions.copy_(positions, non_blocking=True)
        entry.mask.copy_(mask, non_blocking=True)
        if entry.ids is not None:
            assert input_ids is not None
            entry.ids.copy_(input_ids, non_blocking=True)
        if entry.received is not None:
            assert received is not None
            for name, static in entry.received.items():
                static.copy_(received[name], non_blocking=True)
        length = store.length
        output = entry.run()
        store.set_length(length + steps)  # a replay does not run the layers' Python bookkeeping
        self.replays += 1
        return output

    def eager(
        self, positions: torch.Tensor, mask: torch.Tensor, input_ids: torch.Tensor | None = None,
        received: Mapping[str, torch.Tensor] | None = None,
    ) -> Any:
        """The same forward run eagerly on the store's cache (a forward with hooks that cannot be graphed)."""
        self.store.begin(positions.shape[1])
        self.eager_forwards += 1
        return self._forward(positions, mask, input_ids, received)

    def _forward(self, positions: torch.Tensor, mask: torch.Tensor, input_ids: torch.Tensor | None,
                 received: Mapping[str, torch.Tensor] | None) -> Any:
        recv = IntermediateTensors(dict(received)) if received is not None else None
        return self.target.forward(self.store.cache, positions, input_ids=input_ids, received=recv, attention_mask=mask)

    def _capture(self, positions: torch.Tensor, mask: torch.Tensor, input_ids: torch.Tensor | None,
                 received: Mapping[str, torch.Tensor] | None) -> _Entry | None:
        """Static inputs for this shape and its graph (None: the shape runs eagerly)."""
        static_ids = input_ids.clone() if input_ids is not None else None
        static_received = {name: t.clone() for name, t in received.items()} if received is not None else None
        static_positions, static_mask = positions.clone(), mask.clone()

        def forward() -> Any:
            return self._forward(static_positions, static_mask, static_ids, static_received)

        store = self.store
        length = store.length
        if self.mode == "emulate":
            self.captured += 1
            return _Entry(static_ids, static_received, static_positions, static_mask, forward)
        try:
            side = torch.cuda.Stream(device=positions.device)
            side.wait_stream(torch.cuda.current_stream(positions.device))
            with torch.cuda.stream(side):
                forward()  # warm-up (lazy initialisation, autotuning) outside the capture
            store.set_length(length)
            torch.cuda.current_stream(positions.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = forward()
        except Exception as exc:  # noqa: BLE001 - any capture failure: run this shape eagerly
            store.set_length(length)
            torch.cuda.synchronize(positions.device)
            warnings.warn(f"pipespec: no CUDA graph for a forward of {tuple(positions.shape)} tokens, running it "
                          f"eagerly: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            return None
        store.set_length(length)
        self.captured += 1

        def replay() -> Any:
            graph.replay()
            return output

        return _Entry(static_ids, static_received, static_positions, static_mask, replay)
