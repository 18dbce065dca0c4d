"""``pipespec zoo`` with the transformers engine (the default): every causal-LM type of the installed transformers.

Checks the flags that only this engine takes (``--model-types``, ``--pp``, ``--decode-steps``), runs
``pipespec.integrations.transformers.zoo.runner.run_zoo`` with a progress bar, and hands the results to
``pipespec.cli.zoo.finish``. Imports torch and transformers only when it runs; never vLLM.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from pipespec.cli.zoo import finish, load_average, run_facts
from pipespec.errors import UsageError


def run_transformers(args: argparse.Namespace) -> int:
    """The transformers zoo: its flags checked, every requested type run, the table or JSON printed."""
    if args.files is not None:
        raise UsageError("--files is for --engine vllm; with the transformers engine use --model-types")
    types = _model_types(args.model_types)
    pp = _pp_sizes(args.pp)
    if args.decode_steps < 0:
        raise UsageError(f"--decode-steps {args.decode_steps} is invalid: give 0 (one forward) or a positive count")
    import torch
    import transformers

    from pipespec.integrations.transformers.zoo.check import ZooStatus
    from pipespec.integrations.transformers.zoo.compare import REL_TOL
    from pipespec.integrations.transformers.zoo.report import coverage_markdown, format_table
    from pipespec.integrations.transformers.zoo.runner import run_zoo

    progress = _Progress(sys.stderr)
    load = load_average()
    wall, cpu = time.perf_counter(), _cpu_seconds()
    try:
        results = run_zoo(types, pp, progress=progress, jobs=args.jobs, decode_steps=args.decode_steps)
    finally:
        progress.close()
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu

    def markdown() -> str:
        meta = {
            "transformers": transformers.__version__, "torch": torch.__version__, "pp": pp, "rel_tol": REL_TOL,
            "wall_s": wall, "cpu_s": cpu, "jobs": args.jobs, "decode_steps": args.decode_steps, **run_facts(load),
        }
        return coverage_markdown(results, meta)

    return finish(args, results, f"{format_table(results)}\n{wall:.1f} s wall, {cpu:.1f} s CPU", markdown,
                  failed=ZooStatus.FAILED)


def _model_types(text: str | None) -> list[str] | None:
    from pipespec.integrations.transformers.zoo.tiny import causal_lm_model_types

    if text is None:
        return None
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if not wanted:
        raise UsageError("--model-types is empty: give comma-separated model types such as llama,qwen2")
    known = set(causal_lm_model_types())
    unknown = [t for t in wanted if t not in known]
    if unknown:
        raise UsageError(
            f"unknown model type {unknown[0]!r}: not in the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES "
            f"({len(known)} types; e.g. {', '.join(sorted(known)[:5])}, ...)"
        )
    return list(dict.fromkeys(wanted))


def _pp_sizes(values: Sequence[int]) -> list[int]:
    sizes = list(dict.fromkeys(values))
    if not sizes:
        raise UsageError("--pp is empty: give pipeline sizes such as 1,2,3")
    bad = [p for p in sizes if p < 1]
    if bad:
        raise UsageError(f"--pp {bad[0]} is invalid: a pipeline has at least 1 stage")
    return sizes


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the ``--jobs`` workers)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class _Progress:
    """A one-line progress bar on stderr, drawn only on a terminal (logs and pipes stay clean)."""

    def __init__(self, stream: TextIO) -> None:
        from pipespec.integrations.transformers.zoo.check import STATUSES, ZooStatus

        self.stream = stream
        self.enabled = stream.isatty()
        self.statuses = STATUSES
        self.counts: collections.Counter[ZooStatus] = collections.Counter()

    def __call__(self, done: int, total: int, result: Any) -> None:
        self.counts[result.status] += 1
        if not self.enabled:
            return
        width = 30
        filled = width * done // total
        bar = "#" * filled + "-" * (width - filled)
        tally = " ".join(f"{k} {self.counts[k]}" for k in self.statuses)
        self.stream.write(f"\r[{bar}] {done}/{total} {tally}  {result.model_type[:24]:<24}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
