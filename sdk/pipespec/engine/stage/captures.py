"""Warm-up and captures: the throwaway forwards and proposals before timing, the CUDA graphs captured for
every row count up front, and whether fixed KV buffers (graphs) are used at all.

Must not import the CLI or vllm.
"""

from __future__ import annotations

import time

import torch

from pipespec.engine.cuda_graphs import GraphMode
from pipespec.engine.phases import PhaseClock
from pipespec.engine.row_batch import RowBatch
from pipespec.engine.stage.rounds import StageRounds
from pipespec.errors import UsageError

PRECAPTURE_MAX_ROWS = 32  # graphs for every row count up to this are captured at warm-up


def precapture_sizes(rows: int) -> list[int]:
    """The row counts whose graphs the warm-up captures, largest first: every count up to
    ``PRECAPTURE_MAX_ROWS``, else only the full micro-batch (the rest when they occur)."""
    return list(range(rows, 0, -1)) if rows <= PRECAPTURE_MAX_ROWS else [rows]


GRAPH_MEMORY_SHARE = 0.5  # the fixed KV buffers may take at most this share of the free device memory


def graphs_fit(setting: str, need: int, free: int) -> GraphMode | None:
    """``"cuda"`` when ``need`` bytes of fixed KV buffers fit ``GRAPH_MEMORY_SHARE`` of ``free``; else None
    for ``--cuda-graphs auto`` (decode eagerly: the growing caches only take what the sequences use) and
    a usage error for ``on``."""
    if need <= GRAPH_MEMORY_SHARE * free:
        return "cuda"
    if setting == "on":
        raise UsageError(
            f"--cuda-graphs on: the fixed KV buffers need {need / 2**30:.2f} GiB, more than half of the "
            f"{free / 2**30:.2f} GiB free; lower --max-num-seqs or --max-new-tokens, or use --cuda-graphs auto/off"
        )
    return None


def graph_mode(setting: str, device: torch.device, batched: bool) -> GraphMode | None:
    """How verify forwards run for ``--cuda-graphs setting``: ``"cuda"`` (graph replays), ``"emulate"``
    (the same fixed-buffer path without graphs, on CPU) or None (eager, growing caches)."""
    if setting == "off" or (setting == "auto" and (device.type != "cuda" or not batched)):
        return None
    if setting not in ("auto", "on"):
        raise UsageError(f"--cuda-graphs {setting!r}: use auto, on or off")
    if not batched:
        raise UsageError("--cuda-graphs on needs a model whose sequences run as rows of one batch (full attention, "
                         "sdpa or eager kernels); this one runs one forward per sequence: use --cuda-graphs auto or off")
    return "cuda" if device.type == "cuda" else "emulate"



class StageWarmup(StageRounds):
    """``warmup`` of a ``StageRunner``."""

    def warmup(self) -> float:
        """One throwaway prefill + verify forward (and draft proposals) through the whole pipeline, at
        the batch size the rounds will have.

        A fresh process pays lazy CUDA/cuBLAS initialisation and kernel loading on the first forward of
        each shape; without a warm-up that cost lands in ``tokens_per_s``. Every stage runs the same
        two forwards on a throwaway cache (the hop shapes are known), so no message is needed. With CUDA
        graphs it then captures every micro-batch's verify and plain forwards and the draft's proposals
        for the row counts of ``precapture_sizes`` (the same forwards on every stage), and the step
        channel sends one throwaway message.
        """
        started = time.perf_counter()
        rows = min(self.slots, self.scheduler.capacity) if self.batched else 1
        batch = RowBatch(self.target.new_cache(record_past=self.k > 0), list(range(-rows, 0)), self.ctx.device, self.mask_dtype)
        with torch.inference_mode():
            out = self._forward(batch, [[0, 0]] * rows, [0] * rows)
            if out is not None and self.k:
                batch.draft_cache = self.draft.new_cache(rows, capacity=2 * self.k + 4)
                self._draft(batch, out[1], [[0, 0]] * rows, True)
            batch.resolve([2] * rows)
            out = self._forward(batch, [[0] * (self.k + 1)] * rows, [2] * rows)
            if out is not None and self.k:
                self._draft(batch, out[1], [[0]] * rows, True)
            batch.resolve([3] * rows)
            if out is not None and self.draft_runners:
                self._warm_draft(batch, out[1], rows)
            # Capture the verify (k + 1 tokens) and plain (1 token) forwards of every row count now rather
            # than in the rounds: a capture costs milliseconds, and a short run meets most row counts as
            # its sequences finish (measured on 2x H200: ~25 captures in a 0.7 s run at c = 8).
            for store in self.stores:
                warm = RowBatch(store.adopt(batch.cache), list(batch.rows), self.ctx.device, self.mask_dtype)
                warm.valid = batch.valid.clone()
                for size in precapture_sizes(rows):
                    if size < warm.size:
                        warm.drop(set(warm.rows[size:]))
                    for steps in sorted({self.k + 1, 1}, reverse=True):
                        self._forward(warm, [[0] * steps] * size, [3] * size)
                        warm.resolve([3] * size)  # nothing kept: the slots are cropped again
            if self.sender is not None:
                self.sender.flush()
            self.channel.warm()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.clock = PhaseClock(self.ctx.device)  # the rounds' phases and forwards only
        self.forwards = 0
        return time.perf_counter() - started

    def _warm_draft(self, batch: RowBatch, aux: list[torch.Tensor], rows: int) -> None:
        """Capture every runner's proposals (1 to k + 1 verified positions per row) for the row counts of
        ``precapture_sizes`` on throwaway draft caches; other row counts are captured when they occur."""
        for runner in self.draft_runners:
            for size in precapture_sizes(rows):
                cache = runner.adopt(self.draft.new_cache(size, capacity=runner.capacity))
                for steps in range(1, self.k + 2):
                    features = [a[:size, :1].expand(size, steps, a.shape[-1]).contiguous() for a in aux]
                    ids = torch.zeros(size, steps, dtype=torch.long, device=self.ctx.device)
                    runner.propose(features, ids, cache, num_tokens=self.k)
                    cache.crop(0)

