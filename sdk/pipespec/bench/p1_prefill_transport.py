"""P1 — prefill transport overhead: pipeline step time with 3 aux states ÷ without, relay vs overlap.

A Llama-shaped random-weight target built with ``pipespec.adapt(LlamaModel)`` runs as P real stage
processes (gloo on CPU, NCCL with one GPU per stage on CUDA). One prefill step = stage 0 embeds T
tokens and runs its layers, each stage hands its tensors to the next, the last stage runs its layers.
Four variants run interleaved (so drift hits all alike), each timed on the last stage from a common
barrier to the end of its forward, medians over repeats:

* ``relay``   — the default packed transport (``HopSender``/``HopReceiver``), no aux ids vs EAGLE3's 3;
* ``overlap`` — ``pipespec.pp.overlap.OverlapTransport``, no aux ids vs the same 3.

Overhead = median(step with aux) / median(step without), per transport. Goals (issue 5): ≤ 1.005 on
GPU (2×H200, PP=2, a stage ≥ 50 ms at 8k tokens), ≤ 1.02 on CPU (PP=3, a small model). The stage
time of stage 0 at each T is reported too, so a reader can check the setup is not transport-bound.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipespec.bench.common import Result, device_name, save_plot

NAME = "p1"
DESCRIPTION = "prefill transport overhead: step time with 3 aux states / without (relay vs overlap)"
CPU_FEASIBLE = True
VARIANTS = ("relay-none", "relay-aux", "overlap-none", "overlap-aux")


@dataclass(frozen=True)
class P1Config:
    """The model and the sweep; frozen so it pickles to the stage processes unchanged."""

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    pp: int
    tokens: tuple[int, ...]
    repeats: int
    warmup: int
    goal: float
    dtype: str


def config_for(quick: bool, device: str) -> P1Config:
    if device == "cuda":
        # Llama-3-8B-wide layers, 10 per stage: ~60 ms per stage at 8k tokens on an H200 (bf16, SDPA flash).
        tokens = (1024, 8192) if quick else (1024, 8192, 32768)
        return P1Config(20, 4096, 14336, 32, 8, 32000, 2, tokens, 4 if quick else 10, 2, 1.005, "bfloat16")
    # A shared 2-core host: many cheap repeats beat a few long ones for stable medians.
    tokens = (256, 1024) if quick else (512, 2048)
    return P1Config(12, 128, 344, 4, 2, 512, 3, tokens, 7 if quick else 25, 1, 1.02, "float32")


def _build_model(cfg: P1Config, rank: int, device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaModel

    from pipespec.integrations.transformers.adapt import adapt

    config = LlamaConfig(
        hidden_size=cfg.hidden, intermediate_size=cfg.intermediate, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab,
        max_position_embeddings=max(cfg.tokens),
    )
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = adapt(LlamaModel)(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    model.set_pipeline_stage(rank, cfg.pp)
    # Free the layers this stage never runs (the forward only indexes its own range).
    for idx in range(cfg.num_layers):
        if not model.start_layer <= idx < model.end_layer:
            model.layers[idx] = torch.nn.Identity()
    if rank > 0:
        model.embed_tokens = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _stage(ctx: Any, cfg: P1Config) -> dict[str, Any]:
    """One stage process: run every variant at every T, interleaved; the last stage returns timings."""
    from pipespec.contract.layout import eagle3_default_aux_ids
    from pipespec.contract.mixin import hop_keys
    from pipespec.pp.overlap import OverlapTransport
    from pipespec.pp.transport import HopReceiver, HopSender

    if ctx.device.type == "cpu":
        torch.set_num_threads(1)
    device, dtype = ctx.device, getattr(torch, cfg.dtype)
    model = _build_model(cfg, ctx.rank, device)
    ids = eagle3_default_aux_ids(cfg.num_layers)
    plans = {}
    for name, aux in (("none", ()), ("aux", ids)):
        model.set_aux_hidden_state_layers(aux)
        plans[name] = model.pipespec_layout
    biggest = (1, max(cfg.tokens))
    relay: dict[str, tuple[Any, Any]] = {}
    overlap: dict[str, Any] = {}
    for name, plan in plans.items():
        send = HopSender(ctx, hop_keys(plan.stage(ctx.rank), False), cfg.hidden, dtype, ctx.rank + 1, biggest) \
            if not ctx.is_last else None
        recv = HopReceiver(ctx, hop_keys(plan.stage(ctx.rank - 1), False), cfg.hidden, dtype, ctx.rank - 1, biggest) \
            if not ctx.is_first else None
        relay[name] = (send, recv)
        overlap[name] = OverlapTransport(ctx, plan, cfg.hidden, dtype, max_leading_shape=biggest)
    # Barriers go over their own gloo group (on CUDA too): a host-side rendezvous, no NCCL kernel near
    # the timed region, and the same code path on both devices.
    control = dist.new_group(backend="gloo")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(variant: str, tokens: int, input_ids: torch.Tensor | None, positions: torch.Tensor) -> tuple[float, float]:
        mode, name = variant.split("-")
        model.set_aux_hidden_state_layers(plans[name].aux_layers)
        sync()
        dist.barrier(group=control)
        started, cpu_started = time.perf_counter(), time.process_time()
        if mode == "relay":
            send, recv = relay[name]
            received = recv.recv((1, tokens)) if recv is not None else None
            out = model(input_ids=input_ids, intermediate_tensors=received, position_ids=positions, use_cache=False)
            if send is not None:
                send.send(out)
        else:
            hop = overlap[name]
            hop.attach(model)
            received = hop.recv((1, tokens)) if not ctx.is_first else None
            out = model(input_ids=input_ids, intermediate_tensors=received, position_ids=positions, use_cache=False)
            if not ctx.is_last:
                hop.send(out)
            hop.detach(model)
        sync()
        return time.perf_counter() - started, time.process_time() - cpu_started

    def stage_forward_only(tokens: int, input_ids: torch.Tensor | None, positions: torch.Tensor) -> float:
        """This stage's own compute at T tokens (no transport): the denominator the goal is about."""
        model.set_aux_hidden_state_layers(())
        x = None if ctx.is_first else torch.randn(1, tokens, cfg.hidden, device=device, dtype=dtype)
        from pipespec.contract.intermediate import IntermediateTensors

        received = None if x is None else IntermediateTensors({"hidden_states": x})
        sync()
        started = time.perf_counter()
        model(input_ids=input_ids, intermediate_tensors=received, position_ids=positions, use_cache=False)
        sync()
        return time.perf_counter() - started

    timings: dict[int, dict[str, list[float]]] = {}
    cpu_times: dict[int, dict[str, list[float]]] = {}
    stage_ms: dict[int, float] = {}
    peak_gb: dict[int, float] = {}
    with torch.inference_mode():
        for tokens in cfg.tokens:
            gen = torch.Generator().manual_seed(tokens)
            input_ids = torch.randint(0, cfg.vocab, (1, tokens), generator=gen).to(device) if ctx.is_first else None
            positions = torch.arange(tokens, device=device).unsqueeze(0)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            stage_forward_only(tokens, input_ids, positions)
            stage_ms[tokens] = 1e3 * statistics.median(stage_forward_only(tokens, input_ids, positions) for _ in range(3))
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(cfg.warmup + cfg.repeats):
                # Rotate the start so no variant always runs right after the same one.
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
                for variant in order:
                    wall, used = step(variant, tokens, input_ids, positions)
                    if r >= cfg.warmup:
                        times[variant].append(wall)
                        cpu[variant].append(used)
            timings[tokens] = times
            cpu_times[tokens] = cpu
            if device.type == "cuda":
                peak_gb[tokens] = torch.cuda.max_memory_allocated(device) / 2**30
    return {"rank": ctx.rank, "timings": timings, "cpu": cpu_times, "stage_ms": stage_ms, "peak_gb": peak_gb,
            "partition": list(plans["aux"].partition), "aux_layers": list(plans["aux"].aux_layers)}


def run(quick: bool, device: str, command: str) -> list[Result]:
    from pipespec.pp.launch import run_stages

    cfg = config_for(quick, device)
    stages = run_stages(_stage, cfg, cfg.pp, device_type=device, timeout_s=600)
    last = stages[-1]
    dev = device_name(device)
    unit_goal = f"<= {cfg.goal:g}"
    shape = (f"Llama-shaped N={cfg.num_layers} H={cfg.hidden} I={cfg.intermediate}, PP={cfg.pp} "
             f"partition {last['partition']}, aux ids {last['aux_layers']}, {cfg.dtype}")
    results: list[Result] = []
    series: dict[str, tuple[list[float], list[float]]] = {"relay": ([], []), "overlap": ([], [])}
    for tokens in cfg.tokens:
        med = {v: statistics.median(ts) for v, ts in last["timings"][tokens].items()}
        for mode in ("relay", "overlap"):
            ratio = med[f"{mode}-aux"] / med[f"{mode}-none"]
            series[mode][0].append(tokens)
            series[mode][1].append(ratio)
            results.append(Result(
                f"P1.overhead.{mode}.T{tokens}", ratio, unit_goal, "ratio", ratio <= cfg.goal, dev, command,
                detail=(f"step {med[f'{mode}-aux'] * 1e3:.2f} ms with aux / {med[f'{mode}-none'] * 1e3:.2f} ms without, "
                        f"median of {cfg.repeats} interleaved; {shape}"),
            ))
        if device == "cpu":
            # CPU seconds of all stages together per step: the transport's added work, unlike wall time
            # not inflated when other jobs on a shared host take the cores away mid-step.
            total = {v: statistics.median(sum(vals) for vals in zip(*(s["cpu"][tokens][v] for s in stages)))
                     for v in VARIANTS}
            for mode in ("relay", "overlap"):
                ratio = total[f"{mode}-aux"] / total[f"{mode}-none"]
                results.append(Result(
                    f"P1.cpu_overhead.{mode}.T{tokens}", ratio, unit_goal, "ratio", ratio <= cfg.goal, dev, command,
                    detail=(f"CPU time of all stages {total[f'{mode}-aux'] * 1e3:.2f} ms with aux / "
                            f"{total[f'{mode}-none'] * 1e3:.2f} ms without, median of {cfg.repeats}"),
                ))
        stage0 = stages[0]["stage_ms"][tokens]
        goal_stage = device == "cuda" and tokens == 8192
        peaks = ", ".join(f"stage {s['rank']} {s['peak_gb'][tokens]:.1f} GiB" for s in stages if s["peak_gb"])
        results.append(Result(
            f"P1.stage_ms.T{tokens}", stage0, ">= 50" if goal_stage else "-", "ms", (stage0 >= 50) if goal_stage else None,
            dev, command, detail=f"stage 0 forward alone (no transport){'; peak memory ' + peaks if peaks else ''}",
        ))
    out_dir = os.environ.get("PIPESPEC_BENCH_OUT")
    if out_dir:
        save_plot(Path(out_dir) / f"p1_overhead_{device}.png", f"P1 prefill aux overhead ({device}, PP={cfg.pp})",
                  "tokens T", "step time with 3 aux / without", series, hline=cfg.goal, logx=True)
    return results
