"""Where a stage's decoding time goes: host seconds per phase of its rounds, and an optional torch
profile.

On a GPU a small model's decode step is bound by the host (Python, kernel launches, the messages),
not by the device, so the question "why is this round slow" is answered by the host's clock. Every
stage accumulates ``time.perf_counter()`` spans per named phase (``inputs``, ``recv``, ``forward``,
``send``, ``sample``, ``draft``, ...) and reports them as ``phase_s`` in its stats; the cost is two
clock reads per phase.

Device work is asynchronous: without synchronising, its time shows up in whichever phase first waits
for it (``sample`` reads the logits on the last stage). ``$PIPESPEC_PHASE_SYNC=1`` synchronises the
device at the end of every phase so each phase also carries the kernels it launched (slower: use it
to attribute, not to measure throughput).

``$PIPESPEC_PROFILE=DIR`` runs the decode loop under ``torch.profiler`` and writes
``DIR/stage<rank>_ops.txt``: the operators by host time and, on CUDA, by device time.
``$PIPESPEC_PROFILE_PY=DIR`` runs it under ``cProfile`` instead and writes ``DIR/stage<rank>_py.txt``: the
Python functions by their own time and by cumulative time (the whole profile in ``stage<rank>_py.prof``) —
where a host-bound round's milliseconds go between the phases' spans (one of the two at a time: each
profiler's overhead would land in the other's figures).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from pipespec.env import env_flag
from pipespec.errors import UsageError

PHASE_SYNC_ENV = "PIPESPEC_PHASE_SYNC"
PROFILE_ENV = "PIPESPEC_PROFILE"
PY_PROFILE_ENV = "PIPESPEC_PROFILE_PY"


FIRST_SPANS = 16  # spans kept one by one per phase: a stall in the first rounds shows which phase and when


class PhaseClock:
    """Seconds per phase (``with clock("forward"): ...``); phases may nest, each counts its own span. The
    first ``FIRST_SPANS`` spans of every phase are also kept one by one (``first_ms``): on one H200 the
    first 5-7 rounds of some drafting runs cost 9-29 ms against 3-4.5, and the sums cannot say where."""

    def __init__(self, device: torch.device) -> None:
        self.sync = env_flag(PHASE_SYNC_ENV) and device.type == "cuda"
        self.device = device
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.longest: dict[str, float] = {}
        self.first: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize(self.device)
            span = time.perf_counter() - started
            self.seconds[name] = self.seconds.get(name, 0.0) + span
            self.counts[name] = self.counts.get(name, 0) + 1
            self.longest[name] = max(self.longest.get(name, 0.0), span)
            first = self.first.setdefault(name, [])
            if len(first) < FIRST_SPANS:
                first.append(span)

    def first_ms(self) -> dict[str, list[float]]:
        """``{phase: [milliseconds of its first FIRST_SPANS spans, in order]}`` (``phase_first_ms`` in stats)."""
        return {name: [round(1e3 * span, 3) for span in spans] for name, spans in self.first.items()}

    def to_json(self) -> dict[str, dict[str, float]]:
        """``{phase: {"s": seconds, "n": spans, "ms_per": milliseconds per span, "max_ms": the longest span}}``,
        largest first (``max_ms`` shows a single stall that ``ms_per`` averages away)."""
        order = sorted(self.seconds, key=self.seconds.__getitem__, reverse=True)
        return {
            name: {"s": round(self.seconds[name], 4), "n": self.counts[name],
                   "ms_per": round(1e3 * self.seconds[name] / self.counts[name], 4),
                   "max_ms": round(1e3 * self.longest[name], 4)}
            for name in order
        }


def profile_dir(env: str = PROFILE_ENV) -> Path | None:
    """``$PIPESPEC_PROFILE`` (or ``env``) as a directory to write profiles to (created), or None when unset."""
    value = os.environ.get(env, "").strip()
    if not value:
        return None
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{env}={value!r} is a file, not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def maybe_profile(rank: int, device: torch.device) -> Iterator[None]:
    """Profile the enclosed code with ``torch.profiler`` when ``$PIPESPEC_PROFILE`` is set, with ``cProfile``
    when ``$PIPESPEC_PROFILE_PY`` is (see the module doc); otherwise do nothing."""
    out = profile_dir()
    py_out = profile_dir(PY_PROFILE_ENV)
    if out is not None and py_out is not None:
        raise UsageError(f"set {PROFILE_ENV} or {PY_PROFILE_ENV}, not both: each profiler's overhead lands in the other's figures")
    if py_out is not None:
        with _python_profile(rank, device, py_out):
            yield
        return
    if out is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    averages = prof.key_averages()
    parts = [f"# stage {rank} on {device}: operators by host time (self)\n",
             averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if device.type == "cuda":
        parts += ["\n# operators by device time (self)\n", averages.table(sort_by="self_device_time_total", row_limit=40)]
    (out / f"stage{rank}_ops.txt").write_text("".join(parts))


@contextlib.contextmanager
def _python_profile(rank: int, device: torch.device, out: Path) -> Iterator[None]:
    """The enclosed code under ``cProfile``; ``out/stage<rank>_py.txt`` gets the top functions by own and
    by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
    parts = [f"# stage {rank} on {device}: Python functions by own time\n"]
    for key, limit in (("tottime", 40), ("cumulative", 30)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(limit)
        parts += [f"\n# sorted by {key}\n", text.getvalue()]
    (out / f"stage{rank}_py.txt").write_text("".join(parts))
    profiler.dump_stats(out / f"stage{rank}_py.prof")  # the whole profile, for pstats or a viewer
