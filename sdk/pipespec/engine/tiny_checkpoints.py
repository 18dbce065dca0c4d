"""Tiny real checkpoints for tests, the demo and the benchmarks: targets via transformers'
``save_pretrained``, drafts in Format A/B.

Everything here writes the same files a user's checkpoint has (config.json + safetensors), so tests
exercise the real loaders. Weights are random but seeded, and large enough (``initializer_range``
0.25 by default) that greedy outputs vary from token to token — a test whose target always emits the
same token proves nothing about parity.

``write_agreeing_pair`` builds a target and a draft that provably agree (the target's next token is a
fixed permutation of the current one; the draft computes the same permutation), so a correct engine
reaches full acceptance, k + 1 tokens per step (``pipespec demo``'s constructed pair).

Imports torch, transformers and the draft package; must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from pipespec.contract.layout import eagle3_default_aux_ids
from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.conventions import AuxConvention
from pipespec.engine.draft_checkpoint.formats import DraftFormat
from pipespec.engine.draft_checkpoint.write import save_draft_checkpoint

__all__ = ["TARGET_MODEL_TYPES", "make_random_draft", "write_agreeing_pair", "write_tiny_draft", "write_tiny_target"]

TARGET_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")


def write_tiny_target(
    path: str | Path,
    model_type: str = "llama",
    *,
    num_layers: int = 4,
    hidden_size: int = 32,
    vocab_size: int = 96,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 64,
    initializer_range: float = 0.25,
    seed: int = 0,
    max_shard_size: str | None = None,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write a random ``model_type`` causal LM with ``save_pretrained``; returns the directory.

    ``max_shard_size`` (e.g. ``"20KB"``) writes a sharded checkpoint with an index. No eos/bos/pad ids
    are set, so ``generate`` never stops early and outputs have exactly ``max_new_tokens`` tokens.
    ``dtype``: the weights' dtype, at initialisation and on disk (bfloat16 halves a large benchmark
    model's memory and file).
    """
    if model_type not in TARGET_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {TARGET_MODEL_TYPES}")
    kwargs: dict[str, Any] = dict(
        num_hidden_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, initializer_range=initializer_range,
        max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if model_type == "qwen3":
        kwargs["head_dim"] = hidden_size // num_attention_heads
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _perturb_norms(model, seed)
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at exactly 1; perturb them so a test notices a norm applied twice or not at all."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def make_random_draft(
    target_config: PretrainedConfig,
    *,
    num_aux: int = 3,
    hidden_size: int | None = None,
    draft_vocab_size: int | None = None,
    with_embedding: bool = False,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    scale: float = 0.2,
    seed: int = 0,
    **layer_kwargs: Any,
) -> Eagle3Draft:
    """A random EAGLE3 draft for ``target_config``; with a smaller draft vocabulary, ``d2t`` maps onto a
    random sorted subset of the target's ids (so the offsets are non-trivial)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = hidden_size or int(target_config.hidden_size)
    vocab = int(target_config.vocab_size)
    dvocab = draft_vocab_size or vocab
    config = Eagle3DraftConfig.make(
        hidden_size=hidden, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size or 2 * hidden, vocab_size=vocab, draft_vocab_size=dvocab,
        target_hidden_size=int(target_config.hidden_size), num_aux=num_aux,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)), **layer_kwargs,
    )
    draft = Eagle3Draft(config, with_embedding=with_embedding)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
        if dvocab < vocab:
            ids = torch.randperm(vocab, generator=gen)[:dvocab].sort().values
            draft.d2t.copy_(ids - torch.arange(dvocab))
            draft.t2d.zero_()
            draft.t2d[ids] = True
    return draft


def write_tiny_draft(
    path: str | Path,
    target_config: PretrainedConfig,
    *,
    format: DraftFormat = "B",
    aux_layers: Sequence[int] | None = None,
    write_convention: AuxConvention | None = None,
    write_ids: bool = True,
    with_embedding: bool = False,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    **draft_kwargs: Any,
) -> Path:
    """Write a random draft for ``target_config`` in Format A or B.

    ``aux_layers`` are input-index ids (default: EAGLE3's ``(2, N//2, N-3)``), written in
    ``write_convention`` (default: the format's own); ``write_ids=False`` omits them from the config.
    """
    num_layers = int(target_config.num_hidden_layers)
    ids = tuple(sorted(set(aux_layers))) if aux_layers is not None else eagle3_default_aux_ids(num_layers)
    draft = make_random_draft(
        target_config, num_aux=len(ids), with_embedding=with_embedding, draft_vocab_size=draft_vocab_size,
        seed=seed, **draft_kwargs,
    )
    return save_draft_checkpoint(
        draft, path, format=format, aux_layers=ids if write_ids else None, write_convention=write_convention,
    )


def write_agreeing_pair(
    target_dir: str | Path,
    draft_dir: str | Path,
    *,
    vocab_size: int = 48,
    num_layers: int = 4,
    format: DraftFormat = "B",
    aux_layers: Sequence[int] | None = None,
    seed: int = 0,
) -> tuple[Path, Path, list[int]]:
    """A Llama target whose greedy next token is ``perm[current]`` and a draft that predicts the same.

    Construction (hidden size = vocabulary size, so states are one-hot): the target's layers add
    nothing (``o_proj`` and ``down_proj`` are zero), its embedding is the identity, and ``lm_head`` maps
    ``e_x`` to ``perm[x]``. Every aux state is therefore ``e_{x_t}``; the draft's ``fc`` picks the first
    one, its attention adds nothing, and its MLP maps ``e_x`` to ``e_{perm[x]}`` exactly (one active
    unit, so SiLU acts as a fixed scale), so at each draft step it advances the chain by one and its
    ``lm_head`` (the target's) predicts the token after that. Returns the two directories and ``perm``.
    """
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=gen)
    # A permutation with fixed points would make some outputs constant; rotate them away.
    fixed = (perm == torch.arange(vocab_size)).nonzero().flatten()
    for i in fixed.tolist():
        j = (i + 1) % vocab_size
        perm[i], perm[j] = perm[j].clone(), perm[i].clone()
    hidden = vocab_size
    heads = 4 if hidden % 4 == 0 else 1
    target_dir = write_tiny_target(
        target_dir, "llama", num_layers=num_layers, hidden_size=hidden, vocab_size=vocab_size,
        num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=hidden, seed=seed,
    )
    eye = torch.eye(hidden)
    head = torch.zeros(vocab_size, hidden)
    head[perm, torch.arange(vocab_size)] = 1.0  # logits of e_x peak at perm[x]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(eye)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(target_dir)

    ids = tuple(sorted(set(aux_layers))) if aux_layers is not None else eagle3_default_aux_ids(num_layers)
    draft = make_random_draft(
        model.config, num_aux=len(ids), num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=hidden, seed=seed,
    )
    scale = hidden**0.5  # RMSNorm of a unit one-hot vector
    gate_gain = 10.0 / scale  # silu(10) ~ 10: the active unit sits where SiLU is nearly linear, any value works
    active = torch.nn.functional.silu(torch.tensor(gate_gain * scale)).item() * scale
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden].copy_(eye)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        for norm in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm,
                     draft.midlayer.post_attention_layernorm, draft.norm):
            norm.weight.fill_(1.0)
        draft.midlayer.mlp.gate_proj.weight.copy_(gate_gain * eye)
        draft.midlayer.mlp.up_proj.weight.copy_(eye)
        step = torch.zeros(hidden, hidden)
        step[perm, torch.arange(hidden)] = 1.0
        draft.midlayer.mlp.down_proj.weight.copy_((step - eye) / active)
        draft.lm_head.weight.copy_(head)
    save_draft_checkpoint(draft, draft_dir, format=format, aux_layers=ids, include_embedding=False)
    return Path(target_dir), Path(draft_dir), perm.tolist()

