"""Pipeline micro-batches: tokens/s with P micro-batches in flight ÷ tokens/s with one, PP = 2.

Measured end to end through the real CLI (``pipespec generate --pp 2``, stage processes, gloo on CPU /
NCCL on two GPUs), called in this process so every run reuses the warm stage forkserver. A small
random Llama target and a random EAGLE3 draft (written with ``pipespec.engine.testing``; acceptance is
therefore near 1, which does not matter here: the ratio compares two schedules of the same forwards),
``--ignore-eos`` so every prompt decodes exactly M new tokens, prompts of 8–24 random tokens. With
``--pair DIR`` (a pair ``bench/train_demo.py`` wrote) that pair instead, on held-out stdlib prompts of 48
tokens from its tokenizer (random ids in its vocabulary if it has none). Each run's raw ``generate`` JSON
is appended to ``OUT/pipeline_runs.jsonl`` as it completes (with ``--out``).
c = the number of prompts in one ``--prompts-file`` run (all running at once). Each repeat runs the two
settings back to back (interleaved), the figure is the ratio of the medians of the engine's own
``tokens_per_s`` (decoding only, after its warm-up). Outputs must be identical between the two
settings (the detail column says so).

The detail column also gives the bound the one-micro-batch run leaves for the other: its decode time
÷ the busy time of its busiest stage (decode time minus the time the stage waited for hops and step
messages). Micro-batches can only remove waiting; they cannot make the busiest stage faster. The
engine runs a micro-batch's sequences one after another through the pipeline, so with one batch in
flight stage 0 already works on sequence i + 1 while the last stage works on sequence i, and what
is left to gain is the drain and refill at each step's end (about (P - 1) sequences' worth of a
stage per step) plus the wait for the step message; on top of that, the last stage carries the
draft, which makes it the busiest stage.

Goal (issue 7): ≥ 1.7× on GPU (ideal 2×).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    Result,
    append_jsonl,
    cli_json,
    describe_pair,
    device_name,
    heldout_prompts,
    pair_dirs,
)

NAME = "pipeline"
DESCRIPTION = "tokens/s with P micro-batches in flight / with one, PP=2, c=8 and 32"
CPU_FEASIBLE = True
GOAL_GPU = 1.7
PP = 2
NUM_SPEC_TOKENS = 3


def _model(work: Path, device: str, pair: Path | None = None) -> tuple[Path, Path, str]:
    """``pair`` when given, else a random target + draft: tiny on CPU, somewhat wider on GPU (run in bf16 there)."""
    if pair is not None:
        target, draft = pair_dirs(pair)
        return target, draft, describe_pair(pair)
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from pipespec.engine.testing import write_tiny_draft, write_tiny_target

    if device == "cuda":
        shape = dict(num_layers=8, hidden_size=512, vocab_size=8192, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=1408)
    else:
        shape = dict(num_layers=8, hidden_size=256, vocab_size=512, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=512)
    hf_logging.set_verbosity_error()
    target = write_tiny_target(work / "target", "llama", seed=3, **shape)  # type: ignore[arg-type]
    draft = write_tiny_draft(work / "draft", AutoConfig.from_pretrained(target), format="B", seed=4)
    what = f"random Llama {shape['num_layers']} layers, hidden {shape['hidden_size']}, vocab {shape['vocab_size']}; random EAGLE3 draft"
    return target, draft, what


def _prompts(path: Path, count: int, vocab: int, target: Path | None = None) -> Path:
    """Held-out stdlib prompts from ``target``'s tokenizer when given (and it has one), else random ids."""
    ids = heldout_prompts(target, count, 48) if target is not None else None
    if ids is None:
        rng = random.Random(count)
        ids = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 25))] for _ in range(count)]
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ids))
    return path


def _generate(target: Path, draft: Path, prompts: Path, micro_batches: int, new_tokens: int, k: int, device: str) -> dict[str, Any]:
    args = ["generate", "--target", str(target), "--draft", str(draft), "--pp", str(PP), "--prompts-file", str(prompts),
            "--max-new-tokens", str(new_tokens), "--num-spec-tokens", str(k), "--micro-batches", str(micro_batches),
            "--ignore-eos", "--device", device, "--json", "--spec-policy", "always"]
    return cli_json(args, f"pipespec generate --micro-batches {micro_batches}")


def busy_bound(result: dict[str, Any]) -> float:
    """Decode time ÷ the busiest stage's busy time: the most any schedule of these forwards could gain."""
    busy = [s["decode_s"] - s["hop_recv_wait_s"] - s["hop_send_wait_s"] - s["step_message_wait_s"] for s in result["stages"]]
    decode = max(s["decode_s"] for s in result["stages"])
    return decode / max(max(busy), 1e-9)


def run(quick: bool, device: str, command: str, pair: Path | None = None) -> list[Result]:
    new_tokens = 16 if quick else (64 if device == "cuda" else 32)
    repeats = 2 if quick else 3
    # k = 0 (plain decoding, no draft on the last stage: the most balanced stages) only in a full CPU run.
    cases = [(8, NUM_SPEC_TOKENS), (32, NUM_SPEC_TOKENS)] + ([] if quick or device == "cuda" else [(8, 0)])
    dev = device_name(device)
    out_dir = os.environ.get("PIPESPEC_BENCH_OUT")
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target, draft, what = _model(work, device, pair)
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        for c, k in cases:
            prompts = _prompts(work / f"prompts_{c}.jsonl", c, vocab, target if pair is not None else None)
            runs: dict[int, list[dict[str, Any]]] = {1: [], PP: []}
            if (c, k) == cases[0]:
                _generate(target, draft, prompts, PP, 4, k, device)  # warm the forkserver and the page cache
            for _ in range(repeats):
                for m in (1, PP):
                    runs[m].append(_generate(target, draft, prompts, m, new_tokens, k, device))
                    if out_dir:
                        append_jsonl(Path(out_dir) / "pipeline_runs.jsonl", {
                            "c": c, "k": k, "micro_batches": m, "new_tokens": new_tokens, "device": device, "model": what,
                            "generate": runs[m][-1]})
            rate = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in runs.items()}
            ratio = rate[PP] / rate[1]
            same = all(
                [o["output_ids"] for o in a["outputs"]] == [o["output_ids"] for o in b["outputs"]]
                for a, b in zip(runs[1], runs[PP])
            )
            bound = statistics.median(busy_bound(r) for r in runs[1])
            last_wait = statistics.median(
                r["stages"][-1]["hop_recv_wait_s"] / max(r["stages"][-1]["decode_s"], 1e-9) for r in runs[1]
            )
            suffix = "" if k == NUM_SPEC_TOKENS else f".k{k}"
            goal = f">= {GOAL_GPU:g}" if device == "cuda" else f">= {GOAL_GPU:g} on GPU"
            results.append(Result(
                f"pipeline.ratio.c{c}{suffix}", ratio, goal, "x", ratio >= GOAL_GPU if device == "cuda" else None, dev,
                command,
                detail=(f"{rate[PP]:.1f} vs {rate[1]:.1f} tokens/s (medians of {repeats} interleaved runs), "
                        f"{PP} micro-batches vs 1, k={k}, {new_tokens} new tokens x {c} prompts; outputs "
                        f"{'identical' if same else 'DIFFER'}; bound from the 1-micro-batch run {bound:.2f}x "
                        f"(last stage idle {last_wait:.0%} waiting for hops); {what}"),
            ))
            for m in (1, PP):
                results.append(Result(f"pipeline.tokens_per_s.c{c}{suffix}.mb{m}", rate[m], "-", "tokens/s", None, dev, command,
                                      detail=f"median of {repeats}: {[r['tokens_per_s'] for r in runs[m]]}"))
    return results
