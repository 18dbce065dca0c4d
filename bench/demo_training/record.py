"""``metrics.json`` (and ``eval.json``): where and how a figure was made, and writing it with the summary lines.

Imports torch (device name, versions) only; nothing of pipespec.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from bench.demo_training.presets import Preset


def run_record(argv: Sequence[str] | None, device: str, preset_name: str, p: Preset, seed: int) -> dict[str, Any]:
    """Where and how a figure was made: command, date, machine, versions, settings."""
    return {
        "command": " ".join(["python", "bench/train_demo.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu x{torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "preset": preset_name,
        "settings": asdict(p),
        "seed": seed,
    }


def finish(metrics: dict[str, Any], path: Path, print_json: bool, log: Callable[[str], None]) -> int:
    """Write ``metrics`` to ``path``, print the acceptance per k (and the JSON with ``print_json``); exit status
    0 when every speculative output equalled plain greedy, else 1."""
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"checkpoints: {metrics['sizes']['total_bytes'] / 1e6:.2f} MB; metrics in {path}")
    for k, row in metrics["evaluation"]["k"].items():
        print(f"  k={k}: mean acceptance length {row['mean_acceptance_length']:.3f}  lossless={row['lossless']}")
    if print_json:
        print(json.dumps(metrics))
    return 0 if all(row["lossless"] for row in metrics["evaluation"]["k"].values()) else 1
