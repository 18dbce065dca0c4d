"""``save_draft_checkpoint``: write a draft as a Format A or B checkpoint (config.json + model.safetensors).

Must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.conventions import DEFAULT_CONVENTION, AuxConvention
from pipespec.engine.draft_checkpoint.formats import LAYER_PREFIX, DraftFormat, format_config
from pipespec.errors import UsageError


def _layer_config_dict(config: Eagle3DraftConfig) -> dict[str, Any]:
    layer = config.layer
    rope = dict(layer.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": int(layer.intermediate_size),
        "num_attention_heads": int(layer.num_attention_heads),
        "num_key_value_heads": int(layer.num_key_value_heads),
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(layer.rms_norm_eps),
        "hidden_act": layer.hidden_act,
        "max_position_embeddings": int(layer.max_position_embeddings),
        "rope_theta": float(rope.pop("rope_theta", 10000.0)),
        "attention_bias": bool(getattr(layer, "attention_bias", False)),
        "mlp_bias": bool(getattr(layer, "mlp_bias", False)),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def save_draft_checkpoint(
    draft: Eagle3Draft,
    path: str | Path,
    *,
    format: DraftFormat = "B",
    aux_layers: Sequence[int] | None,
    write_convention: AuxConvention | None = None,
    include_embedding: bool = True,
    dtype: torch.dtype | None = None,
    verifier: str | None = None,
    num_speculative_tokens: int = 3,
) -> Path:
    """Write ``draft`` as a Format A or B checkpoint (config.json + model.safetensors).

    ``aux_layers`` are input-index ids; they are written in ``write_convention`` (default: the format's
    documented convention, A → output, B → input) or omitted when ``None``.
    """
    if format not in ("A", "B"):
        raise UsageError(f"draft format {format!r} is unknown: use 'A' or 'B'")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = draft.config
    convention = write_convention or DEFAULT_CONVENTION[format]
    ids = None
    if aux_layers is not None:
        ids = [int(i) - (1 if convention == "output" else 0) for i in sorted(set(aux_layers))]
        if any(i < 0 for i in ids):
            raise UsageError(f"aux ids {list(aux_layers)} cannot be written in the output convention: id 0 has no layer")
    layer = _layer_config_dict(config)
    cfg = format_config(format, layer, config, ids, verifier, num_speculative_tokens)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    prefix = LAYER_PREFIX[format]
    tensors: dict[str, torch.Tensor] = {}
    state = draft.state_dict()
    # A full-vocabulary draft has the identity map: write none (vLLM's Eagle3 models have no
    # draft_id_to_target_id parameter then and refuse the tensor; readers imply zeros, as for any
    # checkpoint without d2t).
    full_vocab = config.draft_vocab_size == config.vocab_size and not bool(state["d2t"].any())
    for key, value in state.items():
        if key.startswith("embed_tokens.") and not include_embedding:
            continue
        if key in ("d2t", "t2d"):
            if not full_vocab:
                tensors[key] = value.detach().cpu().contiguous()
            continue
        name = prefix + key[len("midlayer."):] if key.startswith("midlayer.") else key
        t = value.detach().cpu()
        tensors[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
