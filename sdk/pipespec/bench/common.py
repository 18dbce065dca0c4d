"""Shared pieces of the benchmark scripts: result rows, medians, tables, JSON, plots.

Every benchmark module defines ``NAME``, ``DESCRIPTION``, ``CPU_FEASIBLE`` and
``run(quick: bool, device: str, command: str) -> list[Result]``; the ones that can run on a trained pair
(``pipespec bench p3|pipeline --pair DIR``) also take ``pair: Path | None``. Ratios are always measured side
by side in one run (interleaved repeats, medians), never as timed unit tests.
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


# ------------------------------------------------------------------------------- trained pairs
def pair_dirs(pair: Path) -> tuple[Path, Path]:
    """``(DIR/target, DIR/draft)`` of a pair as ``bench/train_demo.py`` writes it (the CLI checks they exist)."""
    return pair / "target", pair / "draft"


def describe_pair(pair: Path) -> str:
    """What a pair is, for a result's detail: its path, the target's shape, and how it was trained when
    ``DIR/metrics.json`` (train_demo's record) is there."""
    target, _ = pair_dirs(pair)
    config = json.loads((target / "config.json").read_text())
    text = (f"pair {pair}: {config.get('model_type', '?')} target, {config.get('num_hidden_layers')} layers, "
            f"hidden {config.get('hidden_size')}, vocab {config.get('vocab_size')}")
    metrics_path = pair / "metrics.json"
    if not metrics_path.is_file():
        return text
    try:
        metrics = json.loads(metrics_path.read_text())
        tgt, dft = metrics["target"], metrics["draft"]
        k3 = metrics["evaluation"]["k"]["3"]["mean_acceptance_length"]
        capped = " (time-capped)" if tgt.get("time_capped") or dft.get("time_capped") else ""
        steps = (f", {tgt['steps_run']}/{tgt['planned_steps']} target and {dft['steps_run']}/{dft['planned_steps']} "
                 f"draft steps{capped}" if "steps_run" in tgt and "steps_run" in dft else "")
        return (f"{text}; train_demo preset {metrics.get('preset')}, {tgt['parameters'] / 1e6:.1f}M target "
                f"parameters{steps}, offline acceptance length {k3:.2f} at k=3")
    except (KeyError, TypeError, ValueError):
        return f"{text}; {metrics_path} unreadable as train_demo metrics"


def heldout_prompts(target: Path, count: int, length: int) -> list[list[int]] | None:
    """``count`` prompts of ``length`` tokens from held-out stdlib files (train_demo's split), encoded with
    the tokenizer in ``target``; None when ``target`` has no tokenizer or the split yields too few."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except Exception:  # noqa: BLE001 - no (loadable) tokenizer in the directory
        return None
    from pipespec.bench.corpus import eval_prompts, load_corpus

    _, held, _ = load_corpus(max_chars=0)
    ids = eval_prompts(tokenizer, held, count, length, seed=0)
    return ids if len(ids) == count else None


def cli_json(args: Sequence[str], what: str) -> Any:
    """Run ``pipespec ARGS`` (which must print JSON) through the CLI's entry point in this process — it
    reuses this process's warm stage forkserver — and parse its stdout; ``what`` names a failure."""
    import contextlib
    import io

    from pipespec.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(list(args))
    if code != 0:
        raise RuntimeError(f"{what} exited with {code}")
    return json.loads(buffer.getvalue())


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (raw per-run records that survive a benchmark killed half-way)."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
