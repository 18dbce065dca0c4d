"""``pipespec zoo``: verify the adaptation over every model of the installed transformers (or vLLM).

For each type: build a tiny random float32 model, adapt its decoder with ``pipespec.adapt``, run it as
P in-process stages (default P = 1, 2, 3; uneven partitions), compare with the unadapted model (see
``pipespec.integrations.transformers.zoo.check``). Prints a table (``--json``: the list DESIGN.md specifies) and, with
``--write-coverage FILE``, writes the markdown coverage report (``make zoo`` writes docs/coverage.md).
Exit status 1 when any type ``failed``: an adaptation that ran but disagreed is a bug.

``--engine vllm`` checks vLLM-native adaptation instead: every PP decoder of the installed vLLM, adapted
by ``adapt_vllm_module`` and checked inside vLLM at PP=1, 2 and 3 (``pipespec.integrations.vllm.zoo``).
``--engine vllm --source TREE_OR_VERSION`` runs the codemod and the support verdicts over any vLLM tree's
source without importing vLLM (``pipespec.codegen.vllm_source_zoo``, ``zoo_vllm_source``).

This module is the arguments and what both engines share (printing, writing the report, the exit
status); ``zoo_transformers`` and ``zoo_vllm`` run each engine. It imports neither torch nor vLLM:
``pipespec --help`` stays fast and works without vLLM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pipespec.cli.args import int_list, positive_int
from pipespec.str_enum import StrEnum

HELP = "verify adaptation over every causal-LM type of the installed transformers (or vLLM: --engine vllm)"
ENGINES = ("transformers", "vllm", "sglang")
#: The numeric vLLM zoo's section of docs/coverage-vllm.md (the source zoo writes ``vllm-source <release>``).
VLLM_SECTION = "vllm-zoo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=ENGINES, default="transformers",
        help="transformers (default): HF modeling code; vllm: every PP decoder of the installed vLLM, checked inside vLLM; "
             "sglang: the sglang dialect over an SGLang tree (needs --source)",
    )
    parser.add_argument(
        "--source", metavar="TREE_OR_VERSION",
        help="--engine vllm / sglang: the codemod (and vLLM's support verdicts) over an engine's tree (a directory, or a "
             "release such as 0.34.0 / 0.5.23, fetched once) without importing it; --write-coverage replaces that "
             "release's section",
    )
    parser.add_argument(
        "--files", metavar="A.py,B.py",
        help="with --source: these model files (paths under the engine's package or base names; default: all)",
    )
    parser.add_argument("--model-types", metavar="A,B", help="only these model types (default: every causal-LM type installed)")
    parser.add_argument("--pp", type=int_list, default=[1, 2, 3], metavar="1,2,3", help="pipeline sizes to check (default 1,2,3)")
    parser.add_argument("--json", action="store_true", help='print [{"model_type", "status", "reason", "max_abs_err"}, ...]')
    parser.add_argument(
        "--decode-steps", type=int, default=0, metavar="K",
        help="also decode K tokens after the prefill, each stage with its own stage cache (default 0: one forward)",
    )
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument("--write-coverage", metavar="FILE", help="write the markdown coverage report to FILE (atomically)")


def run(args: argparse.Namespace) -> int:
    if args.engine == "sglang":
        from pipespec.cli.zoo_sglang_source import run_sglang_source

        return run_sglang_source(args)
    if args.source is not None:
        from pipespec.cli.zoo_vllm_source import run_vllm_source

        return run_vllm_source(args)
    if args.engine == "vllm":
        from pipespec.cli.zoo_vllm import run_vllm

        return run_vllm(args)
    from pipespec.cli.zoo_transformers import run_transformers

    return run_transformers(args)


def load_average() -> float:
    """The 1-minute load average at the start (NaN where the platform has none): reports say how busy the cores were."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def run_facts(load: float) -> dict[str, Any]:
    """What both engines' coverage reports state about the run: today's date, the load, the CPU count."""
    return {"date": datetime.date.today().isoformat(), "load": load, "cpus": os.cpu_count()}


def finish(args: argparse.Namespace, results: Sequence[Any], table: str, markdown: Callable[[], str], *,
           failed: StrEnum) -> int:
    """Print ``--json`` or the table, write ``--write-coverage`` (atomically), and exit 1 when any result's
    status is ``failed`` (the engine's zoo status member: ``ZooStatus.FAILED``, ``VllmZooStatus.FAILED``).

    The vLLM zoo's report is one section (``VLLM_SECTION``) of a file it shares with the source zoo's
    per-release tables (``pipespec.cli.report_sections``), replaced alone; the transformers zoo's is the
    whole file."""
    section = VLLM_SECTION if args.engine == "vllm" else None
    if args.json:
        print(json.dumps([r.to_json() for r in results]))
    else:
        print(table)
    if args.write_coverage:
        if section is not None:
            from pipespec.cli.report_sections import write_section

            write_section(args.write_coverage, section, markdown())
        else:
            from pipespec.atomic_write import write_atomic

            write_atomic(args.write_coverage, markdown())
        print(f"wrote {args.write_coverage}", file=sys.stderr)
    return 1 if any(r.status is failed for r in results) else 0
