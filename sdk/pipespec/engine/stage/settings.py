"""Settings a stage process reads from its environment: intra-op threads, cuDNN attention, the draft backlog,
and the EOS ids ``generate`` would stop on.

Imports torch and ``pipespec.env``; must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pipespec.env import env_flag, env_positive_int

THREADS_ENV = "PIPESPEC_THREADS"
DRAFT_BACKLOG = 256  # positions a row may hold back from the draft while not speculating
DRAFT_BACKLOG_ENV = "PIPESPEC_DRAFT_BACKLOG"  # overrides it (memory vs. fewer draft passes while plain)


def draft_backlog() -> int:
    """``$PIPESPEC_DRAFT_BACKLOG`` or ``DRAFT_BACKLOG``: how many verified positions a sequence may hold
    back from the draft while the policy decodes plainly (their aux states wait on the last stage)."""
    backlog = env_positive_int(DRAFT_BACKLOG_ENV)
    return DRAFT_BACKLOG if backlog is None else backlog


def stage_threads(world_size: int) -> int:
    """Intra-op threads per CPU stage: ``$PIPESPEC_THREADS``, else ``$OMP_NUM_THREADS``, else the cores
    split evenly over the stages.

    On a machine whose cores are busy with other work, fewer threads are much faster (idle-spinning
    intra-op threads compete for the same cores): 1 is the setting for that case (``make`` sets
    ``OMP_NUM_THREADS=1``).
    """
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        threads = env_positive_int(name)
        if threads is not None:
            return threads
    return max(1, (os.cpu_count() or 1) // world_size)


CUDNN_SDP_ENV = "PIPESPEC_CUDNN_SDP"


def configure_cuda_attention() -> None:
    """Leave cuDNN out of ``scaled_dot_product_attention`` on CUDA (``$PIPESPEC_CUDNN_SDP=1`` keeps it;
    a value that is not a switch is a usage error).

    Decoding changes the key length every step. Recent torch releases prefer the cuDNN attention
    backend on Hopper GPUs, and cuDNN builds an execution plan for every new shape: tens of
    milliseconds per attention call, every step, for target and draft alike. The flash and
    memory-efficient kernels handle any length without a plan.
    """
    if not env_flag(CUDNN_SDP_ENV):
        torch.backends.cuda.enable_cudnn_sdp(False)


def eos_token_ids(target_dir: str, config: Any) -> frozenset[int]:
    """The EOS ids ``generate`` would stop on: generation_config.json, else the model config."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(target_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - no generation_config.json: fall back to the model config
        gen = GenerationConfig.from_model_config(config)
    eos = gen.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else [int(i) for i in eos])

