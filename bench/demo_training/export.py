"""The checkpoints a run writes and reads back: the target as an HF checkpoint (fp16) with its tokenizer, the
draft in Format B (fp16, no ``embed_tokens``: it shares the target's), their sizes on disk.

Everything after export is measured on these files reloaded from disk (the shipped, fp16-rounded weights).
Imports pipespec's draft checkpoint writer and transformers (lazily); nothing of vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.write import save_draft_checkpoint

VERIFIER = "pipespec-demo-target"


def export_target(target: Any, tokenizer: Any, target_dir: Path) -> None:
    """The target (moved to the CPU, cast to fp16) and its tokenizer as one HF checkpoint directory."""
    target.to("cpu").to(torch.float16).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)


def export_draft(draft: Eagle3Draft, draft_dir: Path, aux_ids: Sequence[int]) -> None:
    """The draft in Format B, fp16, without the target's embedding (moves the draft to the CPU)."""
    draft.embed_tokens = None  # the target's module (shared): moving the draft must not move it
    draft.to("cpu")
    save_draft_checkpoint(draft, draft_dir, format="B", aux_layers=aux_ids, include_embedding=False,
                          dtype=torch.float16, verifier=VERIFIER, num_speculative_tokens=3)


def configure_device(device: str) -> None:
    """On CUDA, no cuDNN attention: decoding grows the key length every step, and cuDNN plans per shape."""
    if device == "cuda":
        from pipespec.engine.stage.settings import configure_cuda_attention

        configure_cuda_attention()


def load_target(target_dir: Path, device: str) -> Any:
    """The written target in float32 on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_sizes(target_dir: Path, draft_dir: Path) -> dict[str, int]:
    sizes = {"target_bytes": dir_bytes(target_dir), "draft_bytes": dir_bytes(draft_dir)}
    sizes["total_bytes"] = sizes["target_bytes"] + sizes["draft_bytes"]
    return sizes
