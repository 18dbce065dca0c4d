"""The demo target's weights written as checkpoints of families vLLM 0.32 does not support for EAGLE3.

Each family's math equals Llama's under the config written here, so the demo EAGLE3 draft (trained on
the Llama target) drafts for it exactly as for the original, and pipespec's own engine (HF transformers)
runs the same weights as vLLM does:

* ``mixtral``   — one expert, top-1 routing (the router's softmax over one expert is exactly 1);
* ``granitemoe`` — one expert, every Granite multiplier 1 except ``attention_multiplier`` = head_dim**-0.5;
* ``qwen2_moe`` — every layer in ``mlp_only_layers`` (dense Qwen2 MLP), zero q/k/v biases;
* ``qwen2``     — zero q/k/v biases (vLLM supports Qwen2; the tests put an out-of-tree subclass over it).

``write_family`` writes the names vLLM's loaders read (the families' published checkpoint layout);
``write_transformers_layout`` re-saves one with the state-dict names of the installed transformers
(what pipespec's own engine loads: it reads tensors by module name and applies no conversion mapping).
Reads the target from disk every time (another helper may retrain the demo pair): nothing is hard-coded.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FAMILIES = ("mixtral", "granitemoe", "qwen2_moe")
TOY_ARCHITECTURE = "ToyLMForCausalLM"  # toy_lm.py, the out-of-tree model

_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _base_config(llama: dict) -> dict:
    keep = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
        "hidden_act", "rope_parameters",
    )
    config = {k: llama[k] for k in keep if k in llama}
    config["tie_word_embeddings"] = False
    config["dtype"] = "float32"
    config["rope_theta"] = float(llama.get("rope_parameters", {}).get("rope_theta", 10000.0))
    return config


def _layers(tensors: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))


def _common(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Embedding, final norm, untied lm_head, norms and attention projections (Llama names)."""
    out = {
        "model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "model.norm.weight": tensors["model.norm.weight"],
        "lm_head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).clone(),
    }
    for i in range(n):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{name}.weight"] = tensors[f"{p}{name}.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{proj}.weight"] = tensors[f"{p}self_attn.{proj}.weight"]
    return out


def _mixtral(tensors: dict[str, torch.Tensor], config: dict, n: int) -> dict[str, torch.Tensor]:
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=1,
                  num_experts_per_tok=1, sliding_window=None, router_jitter_noise=0.0)
    out = _common(tensors, n)
    for i in range(n):
        p = f"model.layers.{i}."
        mlp = f"{p}mlp."
        out[f"{p}block_sparse_moe.gate.weight"] = torch.zeros(1, config["hidden_size"])
        out[f"{p}block_sparse_moe.experts.0.w1.weight"] = tensors[f"{mlp}gate_proj.weight"]
        out[f"{p}block_sparse_moe.experts.0.w3.weight"] = tensors[f"{mlp}up_proj.weight"]
        out[f"{p}block_sparse_moe.experts.0.w2.weight"] = tensors[f"{mlp}down_proj.weight"]
    return out


def _granitemoe(tensors: dict[str, torch.Tensor], config: dict, n: int) -> dict[str, torch.Tensor]:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config.update(architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", num_local_experts=1,
                  num_experts_per_tok=1, embedding_multiplier=1.0, residual_multiplier=1.0,
                  logits_scaling=1.0, attention_multiplier=head_dim**-0.5, attention_bias=False)
    out = _common(tensors, n)
    for i in range(n):
        p = f"model.layers.{i}."
        mlp = f"{p}mlp."
        gate_up = torch.cat([tensors[f"{mlp}gate_proj.weight"], tensors[f"{mlp}up_proj.weight"]], dim=0)
        out[f"{p}block_sparse_moe.input_linear.weight"] = gate_up.unsqueeze(0).contiguous()
        out[f"{p}block_sparse_moe.output_linear.weight"] = tensors[f"{mlp}down_proj.weight"].unsqueeze(0).contiguous()
        out[f"{p}block_sparse_moe.router.layer.weight"] = torch.zeros(1, config["hidden_size"])
    return out


def _qwen2_moe(tensors: dict[str, torch.Tensor], config: dict, n: int) -> dict[str, torch.Tensor]:
    config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=1,
                  num_experts_per_tok=1, decoder_sparse_step=1, mlp_only_layers=list(range(n)),
                  moe_intermediate_size=config["intermediate_size"], shared_expert_intermediate_size=0,
                  use_sliding_window=False, sliding_window=None, max_window_layers=n, qkv_bias=True)
    out = _common(tensors, n)
    for i in range(n):
        p = f"model.layers.{i}."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{proj}.weight"] = tensors[f"{p}mlp.{proj}.weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            rows = tensors[f"{p}self_attn.{proj}.weight"].shape[0]
            out[f"{p}self_attn.{proj}.bias"] = torch.zeros(rows)
    return out


def _qwen2(tensors: dict[str, torch.Tensor], config: dict, n: int) -> dict[str, torch.Tensor]:
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                  sliding_window=None, max_window_layers=n)
    out = _common(tensors, n)
    for i in range(n):
        p = f"model.layers.{i}."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{proj}.weight"] = tensors[f"{p}mlp.{proj}.weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"{p}self_attn.{proj}.bias"] = torch.zeros(tensors[f"{p}self_attn.{proj}.weight"].shape[0])
    return out


_WRITERS: dict[str, Callable[[dict[str, torch.Tensor], dict, int], dict[str, torch.Tensor]]] = {
    "mixtral": _mixtral, "granitemoe": _granitemoe, "qwen2_moe": _qwen2_moe, "qwen2": _qwen2,
}


def write_family(family: str, target: Path, out: Path, architecture: str | None = None) -> Path:
    """Write the Llama checkpoint at ``target`` as a ``family`` checkpoint (float32) in ``out``.

    ``architecture`` renames ``architectures`` (an out-of-tree class over the family's weights).
    """
    if family not in _WRITERS:
        raise ValueError(f"unknown family {family!r}: use one of {', '.join(_WRITERS)}")
    llama = json.loads((target / "config.json").read_text())
    tensors = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    n = _layers(tensors)
    config = _base_config(llama)
    weights = _WRITERS[family](tensors, config, n)
    if architecture is not None:
        config["architectures"] = [architecture]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out


def write_transformers_layout(checkpoint: Path, out: Path) -> Path:
    """Re-save ``checkpoint`` with the installed transformers' own tensor names (same values, same config)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    for name in ("config.json", *_COPIED):
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, out / name)
    return out


def write_toy(target: Path, out: Path) -> Path:
    """The target as a ``ToyLMForCausalLM`` checkpoint: same tensors and config, another architecture name.

    ``model_type`` stays ``llama``, so transformers (and pipespec's engine) load it as Llama, while vLLM
    knows the name only through ``model_class_overrides``.
    """
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = [TOY_ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("model.safetensors", *_COPIED):
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out
