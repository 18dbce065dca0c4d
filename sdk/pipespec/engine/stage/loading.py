"""Loading a stage: the request's checks (JSON and tensor headers only, also the launcher's pre-check), this
stage's target layers and, on the last stage, the draft; then the one barrier every stage meets after it.

Stages load independently (no collective while loading). Must not import the CLI or vllm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from pipespec.contract.embed import spec_decode_needs_target_embed
from pipespec.engine.job import GenerateJob
from pipespec.engine.stage.settings import configure_cuda_attention, eos_token_ids, stage_threads
from pipespec.engine.target import TargetStage, build_target_stage, resolve_target
from pipespec.errors import UsageError
from pipespec.pp.launch import StageContext
from pipespec.pp.loading import dtype_from_name
from pipespec.pp.transport import StepBroadcaster


@dataclass
class Prepared:
    """What every stage (and the launcher's pre-check) knows before reading any weight."""

    resolved: Any
    target_info: Any
    draft_info: Any
    aux_layers: tuple[int, ...]


def prepare(job: GenerateJob) -> Prepared:
    """Config, draft config and request checks: JSON and tensor headers only, no weights."""
    from pipespec.engine.draft_checkpoint.info import TargetInfo
    from pipespec.engine.draft_checkpoint.read import inspect_draft_checkpoint

    resolved = resolve_target(job.target)
    target_info = TargetInfo.from_config(resolved.config)
    vocab = target_info.vocab_size
    for r in job.requests:
        bad = [i for i in r.prompt_ids if i >= vocab]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is outside the target vocabulary (size {vocab})")
    info = None
    aux_layers: tuple[int, ...] = ()
    if job.num_spec_tokens > 0:
        if not job.draft:
            raise UsageError("--num-spec-tokens > 0 needs --draft DIR (or use --num-spec-tokens 0 for plain decoding)")
        info = inspect_draft_checkpoint(job.draft, target_info, job.aux_convention)  # type: ignore[arg-type]
        aux_layers = info.aux_layers
    return Prepared(resolved, target_info, info, aux_layers)


def check_job(job: GenerateJob) -> Any:
    """The launcher's pre-check: refuse an unsupported model, bad draft or impossible layout before
    starting any stage process (each stage repeats these checks itself). Returns the layout plan."""
    from pipespec.engine.target import plan_target
    from pipespec.integrations.transformers.adapt import adapt

    prepared = prepare(job)
    adapted = adapt(prepared.resolved.decoder_cls, prepared.resolved.spec)
    return plan_target(prepared.resolved, adapted, job.pp, job.partition, prepared.aux_layers, job.method)



@dataclass
class LoadedStage:
    """A loaded stage: its target layers, the draft (last stage, k > 0) and what the result reports of them."""

    target: TargetStage
    draft: Any
    draft_stats: dict[str, Any]
    draft_info: Any
    aux_layers: tuple[int, ...]
    dtype: torch.dtype
    eos: frozenset[int]


def load_stage(ctx: StageContext, job: GenerateJob) -> LoadedStage:
    """Threads or CUDA attention, the checks of ``prepare``, this stage's target weights, the draft, the EOS ids."""
    from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint

    if job.pp != ctx.world_size:
        raise UsageError(f"--pp {job.pp} does not match the {ctx.world_size} processes started")
    if ctx.device.type == "cpu":
        torch.set_num_threads(stage_threads(ctx.world_size))
    else:
        configure_cuda_attention()
    dtype = dtype_from_name(job.dtype) if job.dtype else (torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
    k = job.num_spec_tokens
    prepared = prepare(job)
    resolved, target_info, info, aux_layers = prepared.resolved, prepared.target_info, prepared.draft_info, prepared.aux_layers
    if info is not None and ctx.is_last:
        for warning in info.warnings:
            ctx.log(f"warning: {warning}", always=True)
    embed_on_last = bool(info and not info.has_embedding and spec_decode_needs_target_embed(job.method, ctx.world_size, ctx.is_last))
    target = build_target_stage(
        job.target, ctx.rank, ctx.world_size, partition=job.partition, aux_layers=aux_layers, device=ctx.device,
        dtype=dtype, embed_on_last=embed_on_last, method=job.method, resolved=resolved,
    )
    stage = target.stage
    load = target.load
    share = load.bytes_read / load.checkpoint_bytes if load.checkpoint_bytes else 0.0
    ctx.log(
        f"layers [{stage.start_layer}, {stage.end_layer}): read {load.tensors_read} tensors, "
        f"{load.bytes_read / 1e6:.2f} MB of {load.checkpoint_bytes / 1e6:.2f} MB ({share:.0%}) in {load.seconds:.2f} s",
        always=job.verbose,
    )
    draft = None
    draft_stats: dict[str, Any] = {}
    if ctx.is_last and k > 0:
        assert job.draft is not None
        loaded = load_draft_checkpoint(
            job.draft, target_info, aux_convention=job.aux_convention,  # type: ignore[arg-type]
            dtype=dtype, device=ctx.device, target_embed=target.embed,
        )
        draft = loaded.model
        draft_stats = {"draft_format": loaded.info.format, "draft_embedding": loaded.embedding, "draft_bytes_read": loaded.bytes_read}

    eos = frozenset() if job.ignore_eos else eos_token_ids(job.target, resolved.config)
    return LoadedStage(target, draft, draft_stats, info, aux_layers, dtype, eos)


def wait_for_all_stages_loaded(ctx: StageContext) -> None:
    """The first collective after loading, with the (long) load timeout.

    Stages load independently and at different speeds (no collective while loading); without this
    barrier the first hop of decoding would wait for a slow loader under the short per-step timeout.
    """
    started = time.perf_counter()
    ready = StepBroadcaster(ctx, 1, ctx.world_size - 1)
    ready.broadcast(torch.ones(1, dtype=torch.int64) if ctx.is_last else None, timeout=ctx.load_timeout)
    ctx.log(f"all stages loaded (waited {time.perf_counter() - started:.2f} s)")

