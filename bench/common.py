"""Shared pieces of the benchmark scripts: result rows, medians, tables, JSON, plots.

Every benchmark module defines ``NAME``, ``DESCRIPTION``, ``CPU_FEASIBLE`` and
``run(quick: bool, device: str, command: str) -> list[Result]``. Ratios are always measured side by side
in one run (interleaved repeats, medians), never as timed unit tests.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Result:
    id: str
    value: float
    goal: str
    unit: str
    meets: bool | None
    device: str
    command: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["detail"]:
            d.pop("detail")
        return d


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"cpu ({platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores)"


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 2, sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs after ``warmup``."""
    return interleaved_medians({"fn": fn}, repeats, warmup, sync)["fn"]


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2,
                        sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Median seconds of each variant, runs interleaved so drift hits all variants alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            if sync:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def print_table(title: str, results: Sequence[Result]) -> None:
    rows = [("id", "value", "unit", "goal", "meets", "detail")]
    for r in results:
        meets = "-" if r.meets is None else ("yes" if r.meets else "NO")
        rows.append((r.id, f"{r.value:.4g}", r.unit, r.goal, meets, r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"== {title}")
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def write_json(path: str | Path, results: Sequence[Result]) -> None:
    Path(path).write_text(json.dumps([r.to_json() for r in results], indent=1))


def save_plot(path: str | Path, title: str, xlabel: str, ylabel: str,
              series: dict[str, tuple[Sequence[float], Sequence[float]]], hline: float | None = None,
              logx: bool = False) -> bool:
    """Write a PNG line plot; returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", label=f"goal {hline}")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
