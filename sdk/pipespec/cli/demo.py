"""``pipespec demo`` (``make demo``): EAGLE3 over a 2-stage CPU pipeline, checked against P=1 and plain decoding.

The pair it runs, in order of preference:

1. the trained demo pair shipped in ``pipespec/demo/`` (``target/`` with its tokenizer, ``draft/`` in
   Format B; ``bench/train_demo.py`` reproduces it) — prompts are Python source text;
2. else a constructed pair built once into a cache directory (``$PIPESPEC_CACHE`` or
   ``~/.cache/pipespec/demo``): a tiny Llama target whose greedy next token is a fixed permutation of
   the current one and an EAGLE3 draft that computes the same permutation, so every draft is accepted
   (k + 1 tokens per step) — it shows the mechanics, not a trained draft's quality.

Runs of the same prompts: one stage with k drafts, then ``--repeats`` times (default 3), interleaved, P
stages with k drafts and P stages with plain decoding (k = 0). The demo prints the outputs, the mean
acceptance length, tokens/s (the median of each mode's runs) and one parity line: every run must agree
token for token (speculative decoding is lossless, and the split changes nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from pipespec.cli.args import positive_int
from pipespec.errors import PipespecError

HELP = "run EAGLE3 speculative decoding over a 2-stage CPU pipeline on a small demo pair"

SHIPPED_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):\n")
CONSTRUCTED_PROMPTS = ((5, 17, 3), (40,), (2, 9, 11, 30, 1))
CONSTRUCTED_VERSION = "1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=positive_int, default=2, metavar="P", help="pipeline stages (default 2)")
    parser.add_argument("--num-spec-tokens", type=positive_int, default=3, metavar="K", help="drafts per step (default 3)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="M", help="new tokens per prompt (default 64)")
    parser.add_argument("--pair", choices=("auto", "shipped", "constructed"), default="auto",
                        help="which demo pair (default: the shipped trained pair when present)")
    parser.add_argument("--cache-dir", metavar="DIR", help="where the constructed pair is built (default ~/.cache/pipespec/demo)")
    parser.add_argument("--repeats", type=positive_int, default=3, metavar="R",
                        help="timed runs of each of drafting and plain decoding, interleaved; tokens/s is the median "
                             "of each (default 3: one decode of the demo is ~0.2 s, and one stall of a shared "
                             "machine moved a single run's ratio from 1.9x to 1.35x)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def shipped_pair() -> tuple[Path, Path] | None:
    """``(target, draft)`` of the trained demo pair in the installed package, if it ships one."""
    root = Path(str(resources.files("pipespec.demo")))
    target, draft = root / "target", root / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return target, draft
    return None


def cache_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    if os.environ.get("PIPESPEC_CACHE"):
        return Path(os.environ["PIPESPEC_CACHE"]) / "demo"
    return Path.home() / ".cache" / "pipespec" / "demo"


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block, back as they were after it."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def constructed_pair(directory: Path) -> tuple[Path, Path]:
    """Build (once) or reuse the constructed agreeing pair under ``directory``."""
    from pipespec.engine.tiny_checkpoints import write_agreeing_pair

    target, draft, stamp = directory / "target", directory / "draft", directory / "VERSION"
    if stamp.exists() and stamp.read_text().strip() == CONSTRUCTED_VERSION:
        return target, draft
    directory.mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():  # transformers' save/load bars for a 48-token model say nothing
        write_agreeing_pair(target, draft, vocab_size=48, num_layers=4, format="B")
    stamp.write_text(CONSTRUCTED_VERSION + "\n")
    return target, draft


def _job(target: Path, draft: Path, requests: Any, pp: int, k: int) -> Any:
    from pipespec.engine.job import GenerateJob

    return GenerateJob(target=str(target), draft=str(draft) if k else None, pp=pp, partition=None,
                       requests=requests, num_spec_tokens=k)


def _launch(job: Any) -> dict[str, Any]:
    from pipespec.cli.generate import compose_output
    from pipespec.engine.stage.loading import check_job
    from pipespec.engine.worker import stage_main
    from pipespec.pp.launch import run_stages

    check_job(job)
    return compose_output(job, run_stages(stage_main, job, job.pp, timeout_s=job.timeout_s,
                                                     load_timeout_s=job.load_timeout_s), batch=True)


def run(args: argparse.Namespace) -> int:
    from pipespec.engine.job import Request, build_requests

    shipped = shipped_pair() if args.pair in ("auto", "shipped") else None
    if args.pair == "shipped" and shipped is None:
        raise PipespecError("--pair shipped: this installation ships no trained demo pair in pipespec/demo/")
    if shipped is not None:
        target, draft = shipped
        kind = "trained demo pair shipped in pipespec/demo (the source repository's bench/train_demo.py trains it)"
        requests = tuple(
            build_requests(str(target), prompt=p, max_new_tokens=args.max_new_tokens)[0] for p in SHIPPED_PROMPTS
        )
    else:
        target, draft = constructed_pair(cache_dir(args.cache_dir))
        kind = f"constructed agreeing pair ({target.parent}): the draft computes the target's next-token rule"
        requests = tuple(Request(p, args.max_new_tokens) for p in CONSTRUCTED_PROMPTS)

    k = args.num_spec_tokens
    single = _launch(_job(target, draft, requests, 1, k))
    specs, plains = [], []
    for _ in range(args.repeats):  # interleaved, so a slow spell of a shared machine hits both
        specs.append(_launch(_job(target, draft, requests, args.pp, k)))
        plains.append(_launch(_job(target, draft, requests, args.pp, 0)))
    spec = specs[0]
    ids = [o["output_ids"] for o in spec["outputs"]]
    same_p1 = ids == [o["output_ids"] for o in single["outputs"]]
    same_plain = all(ids == [o["output_ids"] for o in run["outputs"]] for run in specs + plains)
    spec_tps = statistics.median(run["tokens_per_s"] for run in specs)
    plain_tps = statistics.median(run["tokens_per_s"] for run in plains)
    summary = {
        "pair": "shipped" if shipped else "constructed",
        "target": str(target), "draft": str(draft), "pp": args.pp, "num_spec_tokens": k,
        "outputs": spec["outputs"], "mean_acceptance_length": spec["mean_acceptance_length"],
        "tokens_per_s": spec_tps, "plain_tokens_per_s": plain_tps,
        "speedup": round(spec_tps / plain_tps, 3) if plain_tps else 0.0,
        "repeats": args.repeats, "tokens_per_s_repeats": [run["tokens_per_s"] for run in specs],
        "plain_tokens_per_s_repeats": [run["tokens_per_s"] for run in plains],
        "spec_policy": spec.get("spec_policy"), "micro_batches": spec.get("micro_batches"),
        **({"policy": {key: spec["policy_trace"][key] for key in ("spec_rounds", "plain_rounds", "switches", "trace")}}
           if "policy_trace" in spec else {}),
        "aux_layers": spec["aux_layers"], "aux_convention": spec["aux_convention"],
        "parity_with_p1": same_p1, "parity_with_plain_decoding": same_plain, "stages": spec["stages"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        _report(summary, kind, spec)
    return 0 if same_p1 and same_plain else 1


def _report(summary: dict[str, Any], kind: str, spec: dict[str, Any]) -> None:
    pp, k = summary["pp"], summary["num_spec_tokens"]
    print(f"pipespec demo: {kind}")
    print(f"EAGLE3 over {pp} pipeline stages (CPU, gloo), k = {k}, partition {spec['partition']}, "
          f"aux layers {spec['aux_layers']} ({spec['aux_convention']} convention)")
    for i, out in enumerate(summary["outputs"]):
        shown = repr(out["text"]) if "text" in out else str(out["output_ids"])
        print(f"  [{i}] {shown}")
        plain = out.get("plain_steps", 0)
        how = f" ({plain} of them plain: --spec-policy adaptive measured drafting as slower then)" if plain else ""
        print(f"      {len(out['output_ids'])} tokens in {out['num_steps']} steps{how}, acceptance of the "
              f"drafting steps {out['acceptance_lengths']}")
    for s in summary["stages"]:
        share = s["bytes_read"] / s["checkpoint_bytes"] if s["checkpoint_bytes"] else 0.0
        print(f"  stage {s['rank']}: layers [{s['start_layer']}, {s['end_layer']}), read {share:.0%} of the target checkpoint")
    of = f", medians of {summary['repeats']} interleaved runs" if summary["repeats"] > 1 else ""
    print(f"mean acceptance length {summary['mean_acceptance_length']:.2f} tokens/step (at most {k + 1}); "
          f"{summary['tokens_per_s']:.1f} tokens/s (plain pipeline decoding: {summary['plain_tokens_per_s']:.1f} tokens/s, "
          f"{summary['speedup']:.2f}x{of})")
    verdict = "identical" if summary["parity_with_p1"] and summary["parity_with_plain_decoding"] else "DIFFERENT"
    print(f"parity: P={pp} with drafts vs P=1 with drafts vs P={pp} plain decoding: {verdict} token for token")
