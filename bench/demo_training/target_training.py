"""The demo target: a small ``LlamaForCausalLM`` (tied embedding) and its next-token training.

Imports transformers lazily; nothing of pipespec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from bench.demo_training.loop import (
    History,
    Schedule,
    autocast,
    batches,
    optimizer,
    recent_means,
    run_steps,
    steps_record,
)
from bench.demo_training.presets import Preset


def make_target(p: Preset, vocab: int, eos_id: int) -> Any:
    """An untrained Llama of ``p``'s sizes over ``vocab`` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads, intermediate_size=p.intermediate_size, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02, rope_theta=10000.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def train_target(model: Any, stream: torch.Tensor, p: Preset, device: str, seed: int, log: Callable[[str], None],
                 max_s: float | None = None) -> dict[str, Any]:
    """Next-token training for ``p.target_steps`` steps, or until ``max_s`` seconds have passed."""
    gen = torch.Generator().manual_seed(seed + 1)
    model.to(device).train()
    params = list(model.parameters())
    opt = optimizer(params, p.target_lr, 0.1, device)

    def step_loss(_step: int) -> tuple[torch.Tensor, list[float]]:
        rows = batches(stream, p.batch_size, p.seq_len, gen, device)
        with autocast(device):
            logits = model(input_ids=rows[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)), []

    def report(step: int, history: History, elapsed: float) -> None:
        log(f"target step {step:5d}/{p.target_steps}  loss {recent_means(history)[0]:.3f}  {elapsed:6.1f}s")

    schedule = Schedule("target", p.target_steps, p.target_lr, max(1, p.target_steps // 10), max_s)
    run = run_steps(schedule, opt, params, step_loss, report, log)
    model.eval()
    return {"final_loss": recent_means(run.history)[0], "seconds": run.seconds,
            **steps_record(p.target_steps, len(run.history), run.capped, max_s)}
