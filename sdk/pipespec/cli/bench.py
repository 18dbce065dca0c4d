"""``pipespec bench NAME [--quick] [--device cpu|cuda] [--json]``: run the benchmark scripts in bench/.

Each benchmark prints a table; ``--json`` prints the list of ``{"id", "value", "goal", "unit", "meets",
"device", "command"}`` on stdout (tables go to stderr then). ``all`` runs every CPU-feasible benchmark
(with ``--device cuda``: every benchmark).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from pipespec.errors import UsageError

HELP = "run benchmarks (P1..P6, pipeline) and print tables / JSON"

BENCHES = {
    "p1": "bench.p1_prefill_transport",
    "p2": "bench.p2_decode_comm",
    "p3": "bench.p3_speedup",
    "p4": "bench.p4_hot_path",
    "p5": "bench.p5_loading",
    "p6": "bench.p6_zoo_time",
    "pipeline": "bench.pipeline_microbatches",
    "soak": "bench.soak",
}


def bench_root() -> Path:
    """The directory holding ``bench/`` (a source checkout; override with PIPESPEC_BENCH_DIR)."""
    env = os.environ.get("PIPESPEC_BENCH_DIR")
    root = Path(env) if env else Path(__file__).resolve().parents[3]
    if not (root / "bench" / "common.py").is_file():
        raise UsageError(f"benchmark scripts not found under {root}/bench: run from a pipespec source checkout "
                         "or set PIPESPEC_BENCH_DIR to the checkout's root")
    return root


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=[*BENCHES, "all"], help="benchmark to run")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (CPU CI scale)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", action="store_true", help="print the result list as JSON on stdout")
    parser.add_argument("--out", metavar="DIR", help="also write <name>.json (and plots) into DIR")


def _load(module_name: str):  # type: ignore[no-untyped-def]
    root = str(bench_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def run(args: argparse.Namespace) -> int:
    names = list(BENCHES) if args.name == "all" else [args.name]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
    command = "pipespec bench " + " ".join(sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else [args.name])
    all_results = []
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        os.environ["PIPESPEC_BENCH_OUT"] = str(out_dir)
    common = _load("bench.common")
    for name in names:
        module = _load(BENCHES[name])
        if module is None:
            if args.name == "all":
                continue
            raise UsageError(f"benchmark {name!r} is not available in this checkout ({BENCHES[name]} missing)")
        if args.name == "all" and args.device == "cpu" and not module.CPU_FEASIBLE:
            continue
        results = module.run(quick=args.quick, device=args.device, command=command)
        out = sys.stderr if args.json else sys.stdout
        stdout, sys.stdout = sys.stdout, out
        try:
            common.print_table(f"{name}: {module.DESCRIPTION}", results)
        finally:
            sys.stdout = stdout
        if out_dir:
            common.write_json(out_dir / f"{name}.json", results)
        all_results += results
    if args.json:
        print(json.dumps([r.to_json() for r in all_results]))
    return 0
