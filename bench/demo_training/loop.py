"""What the target's and the draft's training loops share: the LR schedule, the optimizer, autocast, the
wall-time cap (``--max-train-s``), random windows of the token stream, and the step loop itself.

Imports torch only (nothing of pipespec or transformers): the models and losses are passed in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: One entry per step run: (loss, top-1 agreement per TTT step; empty for the target).
History = list[tuple[float, list[float]]]
RECENT = 50  # steps averaged in logs and records


def batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """``[batch, seq_len + 1]`` windows of the token stream at seeded random starts."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    return rows.long().to(device)


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def autocast(device: str, enabled: bool = True) -> Any:
    """bf16 autocast on CUDA; a no-op context on CPU (or when not ``enabled``)."""
    if device == "cuda" and enabled:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, device: str) -> torch.optim.AdamW:
    # The fused kernel on CUDA: one launch per step instead of several per parameter tensor.
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=device == "cuda")


def time_capped(t0: float, max_s: float | None) -> bool:
    """Whether a training loop started at ``t0`` has used up its wall-time cap (never without a cap)."""
    return max_s is not None and time.perf_counter() - t0 > max_s


def steps_record(planned: int, run: int, capped: bool, max_s: float | None) -> dict[str, Any]:
    return {"planned_steps": planned, "steps_run": run, "time_capped": capped, "max_train_s": max_s}


def recent_means(history: History) -> tuple[float, list[float]]:
    """Mean loss and mean agreement per TTT step over the last ``RECENT`` steps."""
    recent = history[-RECENT:]
    steps = len(recent[0][1]) if recent else 0
    return (sum(h[0] for h in recent) / len(recent),
            [sum(h[1][i] for h in recent) / len(recent) for i in range(steps)])


@dataclass(frozen=True)
class StepsRun:
    """What ``run_steps`` did: the history, whether the cap stopped it, and its wall time."""

    history: History
    capped: bool
    seconds: float


@dataclass(frozen=True)
class Schedule:
    """How many steps, at what peak LR, logged how often, stopped after how many seconds; ``name`` starts
    the cap's log line."""

    name: str
    steps: int
    peak_lr: float
    log_every: int
    max_s: float | None = None


def run_steps(
    schedule: Schedule, opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
    step_loss: Callable[[int], tuple[torch.Tensor, list[float]]], report: Callable[[int, History, float], None],
    log: Callable[[str], None], on_cap: Callable[[int], None] | None = None,
) -> StepsRun:
    """The step loop: set the LR, ``step_loss(step)``, backward, clip to norm 1, step; ``report(step, history,
    elapsed)`` every ``log_every`` steps and at the last. Once ``max_s`` has passed (never before the first
    step) it says so, calls ``on_cap`` with the last step run, and stops."""
    t0 = time.perf_counter()
    history: History = []
    capped = False
    for step in range(schedule.steps):
        if step and time_capped(t0, schedule.max_s):
            capped = True
            log(f"{schedule.name}: stopping after {step} of {schedule.steps} steps: "
                f"--max-train-s {schedule.max_s:g} reached")
            if on_cap is not None:
                on_cap(step - 1)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule.steps, schedule.peak_lr)
        loss, agreement = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append((loss.item(), agreement))
        if step % schedule.log_every == 0 or step == schedule.steps - 1:
            report(step, history, time.perf_counter() - t0)
    return StepsRun(history, capped, time.perf_counter() - t0)
