"""``pipespec zoo --engine vllm``: every PP decoder of the installed vLLM, adapted and checked inside vLLM.

Checks ``--files`` against the installed vllm package's files (read, not imported, so a bad value is one
line before vLLM's import-time warnings), requires vLLM >= 0.32's contract, runs
``pipespec.integrations.vllm.zoo.run_vllm_zoo`` with tqdm bars, and hands the results to
``pipespec.cli.zoo.finish``. vLLM is imported only inside these functions, never when the CLI loads.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from pipespec.cli.zoo import finish, load_average, run_facts
from pipespec.errors import UsageError

NEEDS_VLLM = "pipespec zoo --engine vllm needs vLLM >= 0.32 installed; run it in .venv-vllm (make venv-vllm)"


def run_vllm(args: argparse.Namespace) -> int:
    """The vLLM zoo: the files checked, every PP decoder run, the table or JSON printed."""
    files = _vllm_files(args.files)
    version = _require_vllm()
    import torch
    import transformers

    from pipespec.integrations.vllm.zoo import (
        VllmZooStatus,
        coverage_markdown,
        inherited_flag_verdicts,
        run_vllm_zoo,
    )

    load = load_average()
    progress = _VllmProgress(len(files))
    wall = time.perf_counter()
    try:
        results = run_vllm_zoo(files, progress=progress)
    finally:
        progress.close()
    wall = time.perf_counter() - wall
    verdicts = inherited_flag_verdicts()

    def markdown() -> str:
        command = "pipespec zoo --engine vllm --write-coverage " + args.write_coverage
        if args.files:
            command += f" --files {args.files}"
        meta = {
            "command": command, "vllm": version, "torch": torch.__version__, "transformers": transformers.__version__,
            "wall_s": wall, **run_facts(load),
        }
        return coverage_markdown(results, verdicts, meta)

    return finish(args, results, f"{_vllm_table(results)}\n{wall:.1f} s wall", markdown, failed=VllmZooStatus.FAILED)


def _require_vllm() -> str:
    """vLLM's version, or a UsageError with the one line that says where to run this (or why this vLLM is
    refused: the plugin's gate, ``compat.load``, with the zoo harness's symbols in the contract)."""
    try:
        import vllm
    except ImportError:
        raise UsageError(NEEDS_VLLM) from None
    from pipespec.integrations.vllm import compat

    compat.load(compat.Scope.ZOO)
    return str(vllm.__version__)


def _vllm_files(text: str | None) -> list[str]:
    """The model files to check; reads the installed vllm package's files without importing vLLM (so a
    bad --files value is one line, before vLLM's import-time warnings)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(NEEDS_VLLM)
    from pipespec.integrations.vllm.zoo import decoder_files

    every = decoder_files()
    if text is None:
        return every
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if not wanted:
        raise UsageError("--files is empty: give comma-separated vLLM model files such as llama.py,qwen2.py")
    known = set(every) | {os.path.basename(f) for f in every}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise UsageError(
            f"--files {unknown[0]!r}: not a model file of the installed vLLM with intermediate_tensors "
            "(give a path under the vllm package such as model_executor/models/llama.py, or a base name such as llama.py)"
        )
    return decoder_files(wanted)


class _VllmProgress:
    """tqdm bars on stderr: the codemod over the files, then the checks per decoder."""

    def __init__(self, files: int) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = tqdm(total=files, desc="adapting", unit="file", file=sys.stderr, leave=False)
        self.counts: collections.Counter[str] = collections.Counter()

    def adapting(self, rel: str) -> None:
        self.bar.set_postfix_str(rel.rsplit("/", 1)[-1], refresh=False)
        self.bar.update(1)

    def start(self, decoders: int) -> None:
        self.bar.close()
        self.bar = self._tqdm(total=decoders, desc="checking", unit="decoder", file=sys.stderr)

    def done(self, row: Any) -> None:
        self.counts[row.status] += 1
        self.bar.set_postfix_str(" ".join(f"{k} {v}" for k, v in sorted(self.counts.items())), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _vllm_table(results: Sequence[Any]) -> str:
    """The vLLM zoo's table: one row per decoder (the PP sizes it passed, reasons cut at 110 characters),
    then the counts."""
    from pipespec.integrations.vllm.zoo import STATUSES

    rows = [("file", "decoder", "status", "passes", "reason")]
    for r in results:
        reason = r.reason if len(r.reason) <= 110 else r.reason[:107] + "..."
        errors = (r.max_abs_err_pp1, r.max_abs_err_pp2, r.max_abs_err_pp3)
        passes = ",".join(f"PP={p}" for p, e in zip((1, 2, 3), errors) if e is not None) or "-"
        rows.append((r.file, r.class_name, r.status, passes, reason))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    counts = collections.Counter(r.status for r in results)
    lines.append(f"{len(results)} decoders: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES))
    return "\n".join(line.rstrip() for line in lines)
