"""P2 — decode-step communication: one hop with 3 aux states ÷ without, and packed vs separate sends.

Pure transport timing with the engine's own ``HopSender``/``HopReceiver`` between two real stage
processes (gloo on CPU, NCCL on two GPUs). At decode sizes (T ≤ 64 tokens: k + 1 verify tokens per
sequence) a hop is latency-bound, so what matters is the number of messages, not the bytes: relay packs
``hidden_states`` and every aux state into ONE message. Measured as a ping-pong (stage 0 sends, stage 1
sends the same message back; one hop = half a round trip), variants and sizes interleaved, medians of repeats:

* ``none``     — ``hidden_states`` only (plain pipeline decoding);
* ``packed``   — ``hidden_states`` + 3 aux states in one message (what relay sends);
* ``separate`` — the same 4 tensors as 4 messages, one after the other (a transport without packing).

Goal (issue 5): packed ÷ none ≤ 1.2 for every T ≤ 64.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipespec.bench.common import Result, device_name

NAME = "p2"
DESCRIPTION = "decode-step hop with 3 aux states / without (packed), and 4 separate sends vs 1 packed"
CPU_FEASIBLE = True
GOAL = 1.2
AUX_KEYS = ("aux_hidden_states_0", "aux_hidden_states_1", "aux_hidden_states_2")


@dataclass(frozen=True)
class P2Config:
    hidden: int
    tokens: tuple[int, ...]
    inner: int  # round trips per timed sample
    repeats: int
    dtype: str


def config_for(quick: bool, device: str) -> P2Config:
    if device == "cuda":
        # Llama-3-70B width, bf16: the anchor's decode-size figures were measured at this size.
        # Single NCCL hops jitter by +-50 us (host wake-ups): many samples, every size interleaved.
        return P2Config(8192, (1, 4, 16, 64), 50, 5 if quick else 41, "bfloat16")
    return P2Config(1024, (1, 4, 16, 64), 10 if quick else 30, 5 if quick else 15, "float32")


def _stage(ctx: Any, cfg: P2Config) -> dict[str, Any]:
    from pipespec.pp.transport import HopReceiver, HopSender

    if ctx.device.type == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, cfg.dtype)
    peer = 1 - ctx.rank
    biggest = (1, max(cfg.tokens))
    keys = {"none": ("hidden_states",), "packed": ("hidden_states", *AUX_KEYS)}
    pairs = {name: (HopSender(ctx, k, cfg.hidden, dtype, peer, biggest), HopReceiver(ctx, k, cfg.hidden, dtype, peer, biggest))
             for name, k in keys.items()}
    singles = [(HopSender(ctx, (k,), cfg.hidden, dtype, peer, biggest), HopReceiver(ctx, (k,), cfg.hidden, dtype, peer, biggest))
               for k in keys["packed"]]

    def hop(variant: str, tensors: dict[str, torch.Tensor], tokens: int) -> None:
        """Stage 0: send then receive; stage 1: receive then send (one round trip = two hops)."""
        steps = [pairs[variant]] if variant != "separate" else singles
        if ctx.rank == 0:
            for send, _ in steps:
                send.send(tensors)
            for _, recv in steps:
                recv.recv((1, tokens))
        else:
            for _, recv in steps:
                recv.recv((1, tokens))
            for send, _ in steps:
                send.send(tensors)

    def sync() -> None:
        # NCCL waits are stream-ordered (the host runs ahead): time what the GPU did, not what was queued.
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    # Every (T, variant) pair is interleaved inside each repeat: a drift of the machine (clocks, other
    # jobs) hits every size alike instead of whichever size happened to run first.
    inputs = {t: {k: torch.randn(1, t, cfg.hidden).to(ctx.device, dtype) for k in keys["packed"]} for t in cfg.tokens}
    samples: dict[int, dict[str, list[float]]] = {t: {v: [] for v in ("none", "packed", "separate")} for t in cfg.tokens}
    for r in range(cfg.repeats + 1):
        for tokens in cfg.tokens:
            for variant, kept in samples[tokens].items():
                sync()
                started = time.perf_counter()
                for _ in range(cfg.inner):
                    hop(variant, inputs[tokens], tokens)
                sync()
                elapsed = time.perf_counter() - started
                if r > 0:  # the first round warms up buffers and (on NCCL) the communicator
                    kept.append(elapsed / (2 * cfg.inner))
    results = {t: {v: statistics.median(s) for v, s in by_variant.items()} for t, by_variant in samples.items()}
    return {"rank": ctx.rank, "hop_s": results}


def run(quick: bool, device: str, command: str) -> list[Result]:
    from pipespec.pp.launch import run_stages

    cfg = config_for(quick, device)
    stage0 = run_stages(_stage, cfg, 2, device_type=device, timeout_s=300)[0]
    dev = device_name(device)
    results = []
    for tokens, med in stage0["hop_s"].items():
        us = {k: v * 1e6 for k, v in med.items()}
        ratio = med["packed"] / med["none"]
        size = f"[1, {tokens}, {cfg.hidden}] {cfg.dtype}"
        results.append(Result(
            f"P2.aux_over_plain.T{tokens}", ratio, f"<= {GOAL:g}", "ratio", ratio <= GOAL, dev, command,
            detail=f"one hop {us['packed']:.1f} us with 3 aux (1 packed message) / {us['none']:.1f} us hidden only; {size}",
        ))
        results.append(Result(
            f"P2.separate_over_packed.T{tokens}", med["separate"] / med["packed"], "-", "ratio", None, dev, command,
            detail=f"4 separate sends {us['separate']:.1f} us / 1 packed send {us['packed']:.1f} us; {size}",
        ))
    return results
