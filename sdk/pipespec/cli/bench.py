"""``pipespec bench NAME [--quick] [--device cpu|cuda] [--json] [--out DIR] [--pair DIR]``: run the
benchmark scripts in bench/.

Each benchmark prints a table; ``--json`` prints the list of ``{"id", "value", "goal", "unit", "meets",
"device", "command"}`` on stdout (tables go to stderr then). ``all`` runs every CPU-feasible benchmark
(with ``--device cuda``: every benchmark). ``--pair DIR`` (p3 and pipeline only) runs on a trained pair,
``DIR/target`` (HF checkpoint + tokenizer) and ``DIR/draft`` (pipespec draft checkpoint), as
``bench/train_demo.py`` writes them.
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
# The benchmarks whose run() takes ``pair`` (a trained target + draft instead of their default models).
PAIR_BENCHES = ("p3", "pipeline")


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
    parser.add_argument("--pair", metavar="DIR",
                        help=f"run {' and '.join(PAIR_BENCHES)} on DIR/target + DIR/draft (as bench/train_demo.py "
                             "writes them) instead of their default models")


def pair_dir(name: str, pair: str) -> Path:
    """Check ``--pair DIR`` for benchmark ``name``: a benchmark that uses it, and DIR with target/ and draft/."""
    if name not in PAIR_BENCHES:
        raise UsageError(f"--pair is used by {' and '.join(PAIR_BENCHES)} only, not by {name!r}")
    root = Path(pair)
    if not root.is_dir():
        raise UsageError(f"--pair {pair}: no such directory")
    for sub, holds in (("target", "the HF target checkpoint"), ("draft", "the draft checkpoint")):
        if not (root / sub).is_dir():
            raise UsageError(f"--pair {pair}: {root / sub} is missing (it should hold {holds}, as bench/train_demo.py "
                             "writes it)")
    if not (root / "target" / "config.json").is_file():
        raise UsageError(f"--pair {pair}: {root / 'target' / 'config.json'} is missing (not an HF checkpoint)")
    return root.resolve()


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
    pair = pair_dir(args.name, args.pair) if args.pair is not None else None
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
        options = {"pair": pair} if pair is not None else {}
        results = module.run(quick=args.quick, device=args.device, command=command, **options)
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
