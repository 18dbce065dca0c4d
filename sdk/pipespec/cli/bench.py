"""``pipespec bench NAME [--quick] [--device cpu|cuda] [--json] [--out DIR] [--pair DIR]``: run the
benchmarks of ``pipespec.bench`` (shipped in the wheel; nothing outside the package is needed).

Each benchmark prints a table; ``--json`` prints the list of ``{"id", "value", "goal", "unit", "meets",
"device", "command"}`` on stdout (tables go to stderr then). ``all`` runs every CPU-feasible benchmark
(with ``--device cuda``: every benchmark). ``--pair DIR`` (p3 and pipeline only) runs on a trained pair,
``DIR/target`` (HF checkpoint + tokenizer) and ``DIR/draft`` (pipespec draft checkpoint), as the source
repository's ``bench/train_demo.py`` writes them.
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
    "p1": "pipespec.bench.p1_prefill_transport",
    "p2": "pipespec.bench.p2_decode_comm",
    "p3": "pipespec.bench.p3_speedup",
    "p4": "pipespec.bench.p4_hot_path",
    "p5": "pipespec.bench.p5_loading",
    "p6": "pipespec.bench.p6_zoo_time",
    "pipeline": "pipespec.bench.pipeline_microbatches",
    "soak": "pipespec.bench.soak",
}
# The benchmarks whose run() takes ``pair`` (a trained target + draft instead of their default models).
PAIR_BENCHES = ("p3", "pipeline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=[*BENCHES, "all"], help="benchmark to run")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (CPU CI scale)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the models run (default: cpu); with cuda, `all` runs every benchmark")
    parser.add_argument("--json", action="store_true", help="print the result list as JSON on stdout")
    parser.add_argument("--out", metavar="DIR", help="also write <name>.json (and plots) into DIR")
    parser.add_argument("--pair", metavar="DIR",
                        help=f"run {' and '.join(PAIR_BENCHES)} on a trained pair instead of their default "
                             "models: DIR/target (HF checkpoint + tokenizer), DIR/draft (pipespec draft "
                             "checkpoint)")


def pair_dir(name: str, pair: str) -> Path:
    """Check ``--pair DIR`` for benchmark ``name``: a benchmark that uses it, and DIR with target/ and draft/."""
    if name not in PAIR_BENCHES:
        raise UsageError(f"--pair is used by {' and '.join(PAIR_BENCHES)} only, not by {name!r}")
    root = Path(pair)
    if not root.is_dir():
        raise UsageError(f"--pair {pair}: no such directory")
    for sub, holds in (("target", "the HF target checkpoint"), ("draft", "the draft checkpoint")):
        if not (root / sub).is_dir():
            raise UsageError(f"--pair {pair}: {root / sub} is missing (it should hold {holds})")
    if not (root / "target" / "config.json").is_file():
        raise UsageError(f"--pair {pair}: {root / 'target' / 'config.json'} is missing (not an HF checkpoint)")
    return root.resolve()


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
    from pipespec.bench import common

    for name in names:
        module = importlib.import_module(BENCHES[name])
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
