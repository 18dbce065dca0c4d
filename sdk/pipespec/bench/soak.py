"""Soak — 1000 EAGLE3 decode steps at P = 3: does any stage's resident memory keep growing?

A leak in the decode loop (a cache that is never cropped, a buffer reallocated per step, tensors kept in
a trace, a growing receive buffer) shows as resident memory that climbs with the step count. The run:
a tiny random Llama target (6 layers, 2 per stage) and a random Format B draft from
``pipespec.engine.tiny_checkpoints`` with aux ids 1, 3, 5 (one produced on each stage, so stage 1 relays one),
two prompts (one finishes early, so a finished sequence's caches are freed mid-run), greedy decoding
with k = 3 for at least 1000 verify steps, ``--ignore-eos``, gloo on CPU — the same stage processes
``pipespec generate`` starts.

Measurement, least invasive: each stage process reads its own ``VmRSS`` from ``/proc/self/status``
every 10 steps; the stage function is ``pipespec.engine.worker.stage_main`` unchanged, run with a
``StageRunner`` subclass that only adds the sampling (rebound in the stage process, nothing else
changes). Growth = (largest sample after warm-up − sample at the end of warm-up) / that sample, per
stage; warm-up = the first 10 % of the steps (allocator pools, lazily touched pages, rotary and cache
growth to steady state). The slope of a least-squares line through the post-warm-up samples is
reported too: a leak small enough to pass 1 % in 1000 steps still shows there. Goal: growth ≤ 1 % on
every stage. The KV cache legitimately grows by one position per token (2 layers × 2 × 2 kv heads ×
8 dims × 4 bytes = 256 bytes per token per stage here: ~0.3 MB over the run).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from pipespec.bench.common import Result, device_name, save_plot
from pipespec.pp.launch import StageContext

NAME = "soak"
DESCRIPTION = "resident memory growth per stage over 1000 decode steps at P = 3 (after warm-up)"
CPU_FEASIBLE = True
GOAL_PCT = 1.0
PP = 3
STEPS = 1000
QUICK_STEPS = 200
SAMPLE_EVERY = 10
WARMUP_FRACTION = 0.1
NUM_SPEC_TOKENS = 3
AUX_LAYERS = (1, 3, 5)


def rss_kb() -> int:
    """This process's resident set size (VmRSS) in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmRSS line (not Linux?)")


def soak_stage(ctx: StageContext, job: Any) -> dict[str, Any]:
    """``stage_main`` with RSS sampled every ``SAMPLE_EVERY`` steps; the samples ride along in the result."""
    from pipespec.engine import worker

    samples: list[tuple[int, int]] = []
    base = worker.StageRunner

    class SamplingRunner(base):  # type: ignore[misc, valid-type]
        def run_step(self) -> None:
            super().run_step()
            if self.step % SAMPLE_EVERY == 0:
                samples.append((self.step, rss_kb()))

    worker.StageRunner = SamplingRunner  # this stage process only; it exits after the run
    try:
        result = worker.stage_main(ctx, job)
    finally:
        worker.StageRunner = base
    result["rss_kb"] = samples
    return result


def _write_pair(root: Path) -> tuple[Path, Path]:
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would land in the table output
    target = write_tiny_target(root / "target", "llama", num_layers=6, seed=11, max_position_embeddings=4096)
    draft = write_tiny_draft(root / "draft", AutoConfig.from_pretrained(target), format="B", aux_layers=AUX_LAYERS, seed=12)
    return target, draft


def growth(samples: list[tuple[int, int]], warmup_steps: int) -> tuple[float, int, int, float]:
    """(growth %, baseline kB, max kB after warm-up, slope kB per 100 steps) from ``(step, kB)`` samples."""
    after = [(s, kb) for s, kb in samples if s >= warmup_steps]
    if len(after) < 2:
        raise RuntimeError(f"only {len(after)} RSS samples after {warmup_steps} warm-up steps: run more steps")
    baseline = after[0][1]
    peak = max(kb for _, kb in after)
    xs = [float(s) for s, _ in after]
    ys = [float(kb) for _, kb in after]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 100.0 * (peak - baseline) / baseline, baseline, peak, 100.0 * slope


def run(quick: bool, device: str, command: str) -> list[Result]:
    from pipespec.engine.job import GenerateJob, Request
    from pipespec.pp.launch import run_stages

    steps = QUICK_STEPS if quick else STEPS
    warmup = int(steps * WARMUP_FRACTION)
    with tempfile.TemporaryDirectory(prefix="pipespec-soak-") as tmp:
        target, draft = _write_pair(Path(tmp))
        # A random draft is rarely accepted, so steps ~ new tokens; the +10 % margin makes sure the longer
        # sequence needs at least ``steps`` verify steps even when a few drafts are accepted.
        requests = (Request((1, 2, 3, 4), max_new_tokens=int(steps * 1.1) + 1), Request((5, 6), max_new_tokens=steps // 4))
        job = GenerateJob(target=str(target), draft=str(draft), pp=PP, partition=None, requests=requests,
                          num_spec_tokens=NUM_SPEC_TOKENS, device=device, timeout_s=120.0, ignore_eos=True)
        results = run_stages(soak_stage, job, PP, device_type=device, timeout_s=120.0)
    generation = results[-1]["generation"]
    num_steps = int(generation["num_steps"])
    dev = device_name(device)
    rows = [Result(f"soak.decode_steps_p{PP}", float(num_steps), f">= {steps}", "steps", num_steps >= steps, dev, command,
                   detail=f"k={NUM_SPEC_TOKENS}, aux ids {list(AUX_LAYERS)}, 2 prompts, "
                          f"{generation['num_new_tokens']} tokens at {generation['tokens_per_s']:.0f} tokens/s")]
    series = {}
    for rank, stage in enumerate(results):
        samples = [(int(s), int(kb)) for s, kb in stage["rss_kb"]]
        pct, baseline, peak, slope = growth(samples, warmup)
        rows.append(Result(
            f"soak.rss_growth_stage{rank}_pct", pct, f"<= {GOAL_PCT:g}", "%", pct <= GOAL_PCT, dev, command,
            detail=f"VmRSS {baseline / 1024:.1f} MB at step {warmup} -> max {peak / 1024:.1f} MB by step {samples[-1][0]}; "
                   f"slope {slope:+.1f} kB/100 steps",
        ))
        series[f"stage {rank}"] = ([s for s, _ in samples], [kb / 1024 for _, kb in samples])
    out = os.environ.get("PIPESPEC_BENCH_OUT")
    if out:
        save_plot(Path(out) / "soak_rss.png", f"VmRSS per stage, P={PP}, k={NUM_SPEC_TOKENS}", "decode step", "MB", series)
    return rows
