"""P5 — stage-scoped loading: bytes each stage reads ÷ checkpoint bytes, and peak RSS per stage.

Every stage process loads its slice with the engine's own ``pipespec.engine.target.build_target_stage``
(the loader ``pipespec generate`` uses: a meta-device model, then only this stage's tensors read from
the safetensors files); the loader counts the bytes it read (``TargetStage.load``, the figure
``pipespec generate --verbose`` logs per stage). Peak RSS is the stage process's high-water mark
(``VmHWM``, reset first through ``/proc/self/clear_refs`` where the kernel allows) minus its RSS before
loading, next to the same figure for one process loading the whole model.

Goal (issue 5): a stage reads at most 1/P of the checkpoint plus the embedding/lm_head share (the first
stage holds the input embedding, the last the lm_head — and the embedding too when they are tied).
Checkpoints: the shipped demo target (tied embedding) and a synthetic untied Llama written with
``save_pretrained``; layer counts divisible by P, so 1/P of the layers is a whole number.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipespec.bench.common import Result, device_name

NAME = "p5"
DESCRIPTION = "stage-scoped loading: bytes read per stage / checkpoint bytes, peak RSS per stage"
CPU_FEASIBLE = True


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _stage(ctx: Any, target_dir: str) -> dict[str, Any]:
    from pipespec.engine.target import build_target_stage

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    try:  # "5" resets the peak-RSS counter to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    before = _status_kb("VmRSS")
    stage = build_target_stage(target_dir, ctx.rank, ctx.world_size, device=ctx.device, dtype=dtype)
    peak = _status_kb("VmHWM")
    gpu = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    return {
        "rank": ctx.rank, "layers": [stage.stage.start_layer, stage.stage.end_layer],
        "bytes_read": stage.load.bytes_read, "checkpoint_bytes": stage.load.checkpoint_bytes,
        "tensors_read": stage.load.tensors_read, "load_s": stage.load.seconds,
        "rss_added_mb": (peak - before) / 1024 if peak is not None and before is not None else None,
        "hwm_reset": reset, "gpu_mb": gpu / 2**20,
    }


def edge_share(target_dir: Path) -> float:
    """Fraction of the checkpoint's bytes in the input embedding and the lm_head."""
    from pipespec.pp.loading import open_checkpoint

    ckpt = open_checkpoint(target_dir)
    edge = sum(t.nbytes for name, t in ckpt.tensors.items() if "embed_tokens" in name or name.startswith("lm_head"))
    return edge / ckpt.total_bytes


def _checkpoints(quick: bool, work: Path) -> list[tuple[str, Path, list[int]]]:
    from pipespec.demo import demo_available, demo_target_dir
    from pipespec.engine.tiny_checkpoints import write_tiny_target

    hidden = 256 if quick else 512
    synthetic = write_tiny_target(
        work / "synthetic", "llama", num_layers=12, hidden_size=hidden, vocab_size=8192, num_attention_heads=8,
        num_key_value_heads=8, intermediate_size=hidden * 11 // 4, initializer_range=0.02,
    )
    out = [("synthetic-untied", synthetic, [3] if quick else [2, 3, 4])]
    if demo_available():
        out.insert(0, ("demo-tied", demo_target_dir(), [2] if quick else [2, 4]))
    return out


def run(quick: bool, device: str, command: str) -> list[Result]:
    from pipespec.pp.launch import run_stages

    dev = device_name(device)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("PIPESPEC_BENCH_OUT")) as tmp:
        for name, target_dir, sizes in _checkpoints(quick, Path(tmp)):
            share = edge_share(target_dir)
            whole = run_stages(_stage, str(target_dir), 1, device_type=device, timeout_s=300)[0]
            for pp in sizes:
                if device == "cuda" and torch.cuda.device_count() < pp:
                    continue
                stages = run_stages(_stage, str(target_dir), pp, device_type=device, timeout_s=300)
                limit = 1 / pp + share
                for s in stages:
                    ratio = s["bytes_read"] / s["checkpoint_bytes"]
                    results.append(Result(
                        f"P5.read_share.{name}.P{pp}.stage{s['rank']}", ratio, f"<= {limit:.3f}", "fraction", ratio <= limit + 1e-9,
                        dev, command,
                        detail=(f"layers [{s['layers'][0]}, {s['layers'][1]}): {s['bytes_read'] / 1e6:.2f} of "
                                f"{s['checkpoint_bytes'] / 1e6:.2f} MB, {s['tensors_read']} tensors, {s['load_s']:.2f} s; "
                                f"goal 1/{pp} + embedding/lm_head share {share:.3f}"),
                    ))
                    if s["rss_added_mb"] is not None:
                        gpu = f", {s['gpu_mb']:.0f} MB on the GPU" if device == "cuda" else ""
                        results.append(Result(
                            f"P5.peak_rss_mb.{name}.P{pp}.stage{s['rank']}", s["rss_added_mb"], "-", "MB", None, dev, command,
                            detail=(f"peak RSS added by loading (whole model in one process: {whole['rss_added_mb']:.1f} MB)"
                                    f"{gpu}{'' if s['hwm_reset'] else '; VmHWM not resettable here'}"),
                        ))
    return results
