"""Tiny HF configs for vLLM architectures, written to a directory vLLM's ``ModelConfig`` can load.

The vLLM zoo builds every PP decoder of the installed vLLM through vLLM itself, so it needs a model
directory per architecture: a ``config.json`` only (weights are filled by the harness, there is no
tokenizer). The config comes from pipespec's HF tiny recipe (``pipespec.integrations.transformers.zoo.tiny``: 6 layers, hidden
64, GQA heads, float32) for model types transformers knows, and from the same recipe applied to vLLM's
own config classes (``vllm/transformers_utils/configs/``) for the types only vLLM knows.

Which model type an architecture has is not stored anywhere in vLLM: it is read from transformers'
auto mappings (class name -> model type), then from vLLM's config registry by the model file's name.

This module imports vLLM (it lives in ``pipespec.integrations.vllm``); nothing outside that package
may import it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from functools import cache
from typing import Any

from pipespec.errors import one_line

__all__ = ["ARCH_FIXES", "CONSTRUCTOR_FIXES", "GENERIC_REMOTE", "REMOTE_MODEL_TYPES", "SIZE_LIMITS", "TOWERS_BUILT",
           "TinyConfigError", "architectures_of", "check_tiny", "model_type_of", "tiny_vllm_config", "write_model_dir"]

#: Fields of the generic config used for architectures whose config class neither transformers nor vLLM
#: ships (``trust_remote_code`` models): vLLM's modeling code reads these names from the HF config.
GENERIC_REMOTE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "hidden_act": "silu", "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
}

#: Per-architecture config fields on top of the recipe, each with why the recipe is not enough.
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 32, "norm_topk_prob": True}
ARCH_FIXES: dict[str, tuple[dict[str, Any], str]] = {
    "BailingMoeForCausalLM": ({**_MOE, "embedding_dropout": 0.0, "first_k_dense_replace": 1, "use_bias": False,
                               "use_qkv_bias": False}, "remote-code config: MoE sizes, first dense layer, biases"),
    "BailingMoeV2_5ForCausalLM": ({**_MOE, "layer_group_size": 1, "first_k_dense_replace": 1, "use_bias": False,
                                   "use_qkv_bias": False},
                                  "remote-code config: MoE sizes; every layer full attention (layer_group_size 1): its "
                                  "linear attention runs Triton kernels, which this CPU build lacks"),
    "BailingMoeV3ForCausalLM": ({**_MOE, "layer_group_size": 1, "first_k_dense_replace": 1, "use_bias": False,
                                 "n_group": 1, "topk_group": 1, "short_conv_kernel_size": 4, "no_kda_lora": True},
                                "remote-code config: MoE sizes and groups; every layer full attention "
                                "(layer_group_size 1): its KDA linear attention runs Triton kernels, which this CPU "
                                "build lacks"),
    "ExaoneForCausalLM": ({"activation_function": "silu"}, "remote-code config: names its activation activation_function"),
    "MiniCPMForCausalLM": ({"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 12.0, "num_experts": 0},
                           "remote-code config: muP scales (dense model: num_experts 0)"),
    "Param2MoEForCausalLM": ({**_MOE, "rope_scaling": None, "score_function": "softmax"},
                             "remote-code config: MoE sizes and router score function"),
    "Rnj1ForCausalLM": ({"attention_bias": False, "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
                         "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "query_pre_attn_scalar": 16,
                         "sliding_window": 4}, "remote-code config: Gemma-3-style attention fields"),
    "SarvamMLAForCausalLM": ({**_MOE, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                              "num_key_value_heads": 4, "first_k_dense_replace": 1},
                             "remote-code config: latent-attention ranks and MoE sizes"),
    "SolarForCausalLM": ({"bskcn_1": [1], "bskcn_2": [4], "bskcn_3": [2], "bskcn_4": [5], "bskcn_tv": [0.9, 0.8]},
                         "remote-code config: skip connections, each pair inside one stage at PP=2 and at the zoo's "
                         "PP=3 partition (a pair across stages reads a clone the previous stage never sends); no pair "
                         "mixes in at an aux id the zoo checks"),
    "K2HorizonForCausalLM": ({**_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [0], "mova_num_experts": 0,
                              "rope_head_dim": 8, "query_key_norm": True,
                              "layernorm_num_groups": 2, "router_score_func": "softmax", "router_scaling_factor": 1.0,
                              "moe_gate_bias": False, "attention_gate_func": "silu", "attention_bias": False},
                             "remote-code config: MoE sizes, partial rope, grouped norms, router and attention gate "
                             "functions; no mixture-of-value attention (mova_num_experts 0): it runs a Triton fused-MoE "
                             "kernel, which this CPU build lacks"),
    "MolmoForCausalLM": ({"embedding_size": None, "layer_norm_type": "rms", "norm_after": True, "qkv_bias": True,
                          "weight_tying": False, "attention_layer_norm": False},
                         "remote-code config: vocabulary padding, norm kind and placement, biases (its vision "
                         "backbone is sized in code: not built, language_model_only); norm_after True builds "
                         "MolmoDecoderNormAfterLayer, the layer class that rebinds its residual (Molmo2's tiny "
                         "config builds the other kind, so the zoo checks both branches of the per-class capture)"),
    "DeciLMForCausalLM": ({"block_configs": [
        {"attention": {"no_op": i == 2, "replace_with_linear": False, "n_heads_in_group": 2},
         "ffn": {"no_op": i == 4, "replace_with_linear": False, "intermediate_size": 128}} for i in range(6)]},
        "remote-code config: one block config per layer (layer 2 without attention, layer 4 without FFN: "
        "Nemotron-NAS's no-op blocks)"),
    "NemotronHForCausalLM": ({"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp",
                                                   "linear_attention", "mlp"]},
                             "no MoE layers (Mamba, MLP and attention only, the dense Nemotron-H shape): its MoE "
                             "layers always build non-gated experts (activation_without_mul), which vLLM's fused "
                             "MoE implements only for CUDA, XPU and ROCm; its MLP layers are the same relu2 MLP "
                             "unfused"),
    "LagunaForCausalLM": ({"mlp_layer_types": ["dense"] * 6},
                          "every layer a dense MLP: its MoE routes with sigmoid scores without expert groups, which "
                          "the CPU build's router does not implement (it asserts softmax), so its MoE is not built"),
    "Ernie4_5_VLMoeForConditionalGeneration": (
        {"moe_num_experts": [4, 4], "moe_layer_start_index": [1, 1], "moe_layer_end_index": [5, 5],
         "moe_intermediate_size": [32, 32], "moe_k": 2, "moe_num_shared_experts": 1, "freq_allocation": 4,
         "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 32, "in_channels": 3, "mlp_ratio": 2,
                           "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2},
         "pixel_hidden_size": 32, "spatial_conv_size": 2, "temporal_conv_size": 2, "use_temporal_conv": True,
         "im_patch_id": 250},
        "remote-code config: text and vision expert lists, MoE layer span, 3-D rope split, a tiny vision "
        "sub-config (the tower itself is not built: language_model_only)"),
    "MossAudioModel": (
        {"audio_config": {"d_model": 32, "output_dim": 32, "num_mel_bins": 16, "encoder_layers": 2,
                          "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "downsample_rate": 8,
                          "downsample_hidden_size": 8, "encoder_attention_window_size": 4,
                          "max_source_positions": 64, "n_window": 4, "conv_chunksize": 4,
                          "deepstack_encoder_layer_indexes": [0, 1]},
         "language_config": {k: v for k, v in GENERIC_REMOTE.items() if k != "rope_parameters"},
         "adapter_hidden_size": 64, "deepstack_num_inject_layers": 2},
        "remote-code config: a tiny audio encoder (vLLM's text-only mode cannot skip it: its constructor "
        "calls .item() on the meta device), a Qwen3 language config, the adapter width"),
    "DeepseekV4ForCausalLM": ({**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "hc_mult": 2, "hc_eps": 1e-6,
                               "hc_sinkhorn_iters": 2, "num_hash_layers": 0, "swiglu_limit": None,
                               "scoring_func": "softmax", "topk_method": None, "routed_scaling_factor": 1.0,
                               "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2, "qk_rope_head_dim": 8,
                               "head_dim": 16, "sliding_window": 4, "compress_ratios": [0] * 6,
                               "compress_rope_theta": 10000.0, "index_topk": 4, "index_n_heads": 2,
                               "index_head_dim": 16, "max_position_embeddings": 128},
                              "the checkpoint's own fields (vLLM's DeepseekV4Config takes them as **kwargs): "
                              "hyper-connections (hc_mult streams, Sinkhorn iterations, eps), MoE without hash "
                              "layers, low-rank q/o projections in o_groups, sliding window, no compression"),
    "DeepseekV32ForCausalLM": ({"index_topk": 4, "index_n_heads": 2, "index_head_dim": 16},
                               "vLLM's DeepseekV32 config check asserts a V3.2 config (index_topk: its sparse "
                               "indexer's top-k), and the indexer is sized by index_n_heads / index_head_dim"),
    "Ernie4_5_MoeForCausalLM": ({"tie_word_embeddings": False},
                                "untied head: with tied embeddings vLLM 0.32's Ernie4_5_MoeForCausalLM calls "
                                "tie_weights on the PPMissingLayer a non-last PP rank has for its lm_head (a vLLM "
                                "bug at PP > 1, not patched here); untied, its PP path is what every other model runs"),
    "Gemma4ForCausalLM": ({"top_k_experts": 2, "hidden_size_per_layer_input": 0},
                          "the recipe's experts (num_experts 4) turn Gemma4's MoE block on, which routes to "
                          "top_k_experts (no default); no per-layer input embeddings (PLE, the small Gemma 4s): on "
                          "a non-first PP rank vLLM 0.32's Gemma4Model reads per_layer_inputs from the intermediate "
                          "tensors only when the caller passes per_layer_inputs, which its text-only model runner "
                          "does not (that code is vLLM's, unchanged by the rewrite); measured with PLE on: PP=2 "
                          "aux id 6 off the PP=1 stream by 6.5, ids 0-4 equal"),
    "Glm4MoeForCausalLM": ({"head_dim": 16}, "vLLM reads config.head_dim, which transformers' Glm4MoeConfig derives"),
    "GptOssForCausalLM": ({"intermediate_size": 96},
                          "an expert width divisible by 3: vLLM 0.32's GptOss MoE block asserts intermediate_size % "
                          "torch.distributed's world size == 0 (every PP rank counted, not its TP group), so the "
                          "recipe's 128 fails on every rank at PP=3"),
    "AfmoeForCausalLM": ({"score_func": "softmax", "route_norm": True, "n_group": 1, "topk_group": 1},
                         "vLLM reads the router's remote-code fields (score_func, route_norm, groups)"),
    "Glm4MoeLiteForCausalLM": ({"first_k_dense_replace": 1}, "vLLM reads config.first_k_dense_replace"),
    "HYV3ForCausalLM": ({"first_k_dense_replace": 1, "expert_hidden_dim": 32, "route_norm": True},
                        "vLLM requires config.first_k_dense_replace and reads the expert width"),
    "Lfm2ForCausalLM": ({"conv_dim": 64, "conv_L_cache": 3, "block_dim": 64},
                        "vLLM reads the short-conv and block widths"),
    "LongcatFlashForCausalLM": ({"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"},
                                "vLLM reads the MLA LoRA scale switches and asserts a zero-expert type"),
    "MiMoV2FlashForCausalLM": ({"hybrid_layer_pattern": [0, 1, 0, 1, 0, 1], "swa_head_dim": 16,
                                "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "sliding_window_size": 4,
                                "layernorm_epsilon": 1e-6, "moe_layer_freq": [0, 1, 1, 1, 1, 1]},
                               "vLLM reads the sliding/full layer pattern and the sliding-attention shape"),
    "KimiLinearForCausalLM": ({"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                               "q_lora_rank": None, "mla_use_nope": True, "linear_attn_config": None,
                               "attn_res_block_size": None, "num_experts": None},
                              "latent-attention dims the config leaves unset; every layer full MLA attention and "
                              "dense (its KDA linear-attention layers and routers run Triton / CUDA kernels only); "
                              "no attention-residual blocks (their op is a Triton kernel): the plain branch"),
    "MiniMaxM2ForCausalLM": ({"rotary_dim": 8, "scoring_func": "softmax", "max_model_len": 128},
                             "vLLM reads config.rotary_dim (partial rotary) and the router's scoring_func"),
    "Step3TextForCausalLM": ({"moe_layers_enum": "1,2,3,4,5", "tie_word_embeddings": False, "moe_num_experts": 4,
                              "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32, "share_q_dim": 32},
                             "vLLM parses the MoE layer list from a comma-separated string; its MoE and shared-expert "
                             "sizes use step3's own names"),
    "Step3p5ForCausalLM": ({"max_position_embeddings": 128, "tie_word_embeddings": False, "num_attention_groups": 2,
                            "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32},
                           "vLLM asserts max_position_embeddings is set; its KV groups (default 8) must divide the "
                           "tiny 4 heads; MoE sizes use step3's own names"),
}


_TINY_TEXT = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 256, "num_hidden_layers": 6, "intermediate_size": 128, "hidden_act": "silu",
              "max_position_embeddings": 128, "rope_theta": 10000.0, "layer_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
#: Keyword arguments for the constructor of a vLLM config class whose sizes are not top-level fields (a
#: nested dict it parses itself), each with why.
CONSTRUCTOR_FIXES: dict[str, tuple[dict[str, Any], str]] = {
    "Moondream3ForCausalLM": ({"config": {
        "text": {"dim": 128, "ff_dim": 256, "n_layers": 6, "vocab_size": 256, "max_context": 128, "n_heads": 2,
                 "n_kv_heads": 2, "prefix_attn": 4, "rope_theta": 10000.0,
                 "moe": {"start_layer": 2, "n_experts": 4, "n_experts_per_tok": 2, "expert_inner_dim": 32}},
        "vision": {"enc_dim": 32, "enc_patch_size": 14, "enc_n_layers": 1, "enc_ff_dim": 64, "enc_n_heads": 2,
                   "proj_inner_dim": 64, "crop_size": 28, "max_crops": 1}}},
        "Moondream3Config parses its text and vision sizes from one nested `config` dict; its rope rotates "
        "32 dims of each head, so heads are 64 wide (hidden 128, 2 heads)"),
}
#: Keys a config class derives in its constructor and a checkpoint's config.json does not carry (written
#: back, they would replace the derived sub-configs with plain dicts when vLLM loads the directory).
_DERIVED_KEYS = {"Moondream3ForCausalLM": ("text_config", "vision_config")}
ARCH_FIXES["Molmo2ForConditionalGeneration"] = (
    {"text_config": {**_TINY_TEXT, "additional_vocab_size": 128, "qkv_bias": True, "use_qk_norm": False,
                     "qk_norm_type": "olmo", "norm_after": False, "rope_scaling_layers": None},
     "vit_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "gelu_pytorch_tanh",
                    "layer_norm_eps": 1e-6, "image_default_input_size": [28, 28], "image_patch_size": 14,
                    "image_num_pos": 5},
     "adapter_config": {"vit_layers": [-1, -2], "pooling_attention_mask": False, "hidden_size": 32,
                        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
                        "intermediate_size": 64, "text_hidden_size": 64},
     "image_patch_id": 250, "image_col_id": 251, "image_start_token_id": 252, "image_end_token_id": 253,
     "low_res_image_start_token_id": 254, "frame_start_token_id": 248, "frame_end_token_id": 249,
     "image_low_res_id": 247, "tie_word_embeddings": False},
    "remote-code config: text, ViT and adapter sub-configs (the model reads them by attribute) and the image "
    "token ids")


class TinyConfigError(Exception):
    """The architecture has no tiny config; the message is the specific reason."""


@cache
def _registry() -> dict[tuple[str, str], tuple[str, ...]]:
    """(module, class) -> the architecture names vLLM's registry maps to that class, in registry order."""
    from vllm.model_executor.models.registry import ModelRegistry

    out: dict[tuple[str, str], list[str]] = {}
    for arch, entry in ModelRegistry.models.items():
        module = getattr(entry, "module_name", None)
        cls = getattr(entry, "class_name", None)
        if isinstance(module, str) and isinstance(cls, str):
            out.setdefault((module, cls), []).append(arch)
    return {k: tuple(v) for k, v in out.items()}


def architectures_of(module: str, class_name: str) -> tuple[str, ...]:
    """The architecture names that make vLLM build ``module.class_name`` (empty: none does)."""
    return _registry().get((module, class_name), ())


@cache
def _hf_class_to_type() -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    out: dict[str, str] = {}
    for name in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                 "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
                 "MODEL_MAPPING_NAMES"):
        for model_type, classes in getattr(modeling_auto, name, {}).items():
            for cls in (classes,) if isinstance(classes, str) else classes:
                out.setdefault(cls, model_type)
    return out


def _vllm_config_classes() -> dict[str, Any]:
    from pipespec.integrations.vllm.compat import current

    return current().config_registry()


def model_type_of(architecture: str, file_stem: str) -> str | None:
    """The HF ``model_type`` of ``architecture`` (defined in file ``file_stem``), or None if unknown."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vllm_types = _vllm_config_classes()
    if architecture in REMOTE_MODEL_TYPES:
        return None  # vLLM's code reads the remote-code config's fields, not transformers' class
    if architecture in _hf_class_to_type():
        return _hf_class_to_type()[architecture]
    candidates = [file_stem, file_stem.lower(), architecture.removesuffix("ForCausalLM").lower()]
    for candidate in candidates:
        if candidate in vllm_types or candidate in CONFIG_MAPPING:
            return candidate
    return None


def _config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vllm_types = _vllm_config_classes()
    if model_type in vllm_types:
        return vllm_types[model_type]  # type: ignore[no-any-return]
    return CONFIG_MAPPING[model_type]  # type: ignore[no-any-return]


def _init_fields(config_cls: type) -> dict[str, Any]:
    """Keyword arguments a non-dataclass config's ``__init__`` declares, with their defaults."""
    out: dict[str, Any] = {}
    for name, param in inspect.signature(config_cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        out[name] = None if param.default is param.empty else param.default
    return out


def _takes_any_keyword(config_cls: type) -> bool:
    try:
        params = inspect.signature(config_cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in params)


def tiny_vllm_config(architecture: str, file_stem: str) -> tuple[Any, str]:
    """The tiny float32 HF config that makes vLLM build ``architecture``, and its model type.

    transformers' types go through ``pipespec.integrations.transformers.zoo.tiny.tiny_config`` (its per-type fixes included);
    vLLM's own config classes get the same generic recipe, restricted to the keywords they declare.
    """
    from pipespec.integrations.transformers.zoo import tiny as hf_tiny

    model_type = model_type_of(architecture, file_stem)
    fix, _why = ARCH_FIXES.get(architecture, ({}, ""))
    if model_type is None:
        config = _remote_config(architecture, file_stem, fix)
        return config, str(config.model_type)
    config_cls = _config_class(model_type)
    if model_type in _vllm_config_classes() or not dataclasses.is_dataclass(config_cls):
        fields = hf_tiny.config_fields(config_cls) or _init_fields(config_cls)
        kwargs = {k: v for k, v in hf_tiny.GENERIC.items() if k in fields}
        if _takes_any_keyword(config_cls):
            # a config whose __init__ forwards **kwargs to PretrainedConfig keeps them as attributes
            kwargs = {**{k: v for k, v in GENERIC_REMOTE.items() if k not in fields}, **kwargs}
        hf_tiny.tiny_special_ids(fields, kwargs)
        hf_tiny.scale_mla_dims(fields, kwargs)
        hf_fix = hf_tiny.FIXES.get(model_type)
        if hf_fix is not None:
            hf_fix.apply(kwargs)
        kwargs.update(CONSTRUCTOR_FIXES.get(architecture, ({}, ""))[0])
        try:
            with hf_tiny.quiet_transformers():
                config = config_cls(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any validation failure is the reason to report
            raise TinyConfigError(f"vLLM config {config_cls.__name__} rejects the tiny recipe: {one_line(exc)}") from None
    else:
        try:
            config, _fixes = hf_tiny.tiny_config(model_type)
        except hf_tiny.TinyBuildError as exc:
            raise TinyConfigError(str(exc)) from None
    for key, value in fix.items():
        setattr(config, key, value)
    config.architectures = [architecture]
    check_tiny(config)
    return config, model_type


def _remote_config(architecture: str, file_stem: str, fix: dict[str, Any]) -> Any:
    """A ``PretrainedConfig`` of a model type registered here for ``architecture`` (its HF config class
    lives in the model's repository, not in any installed package), with the generic fields + fixes.

    The type is registered with ``AutoConfig`` in this process, so ``ModelConfig`` loads the written
    ``config.json`` the way it loads a remote-code config.
    """
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = REMOTE_MODEL_TYPES.get(architecture, f"pipespec_tiny_{file_stem.lower()}")
    if model_type not in CONFIG_MAPPING:

        def __init__(self: Any, **kwargs: Any) -> None:  # noqa: N807 - the config class's constructor
            for name in _ATTRIBUTE_FIELDS:
                if isinstance(kwargs.get(name), (list, dict)):
                    kwargs[name] = _attrs(kwargs[name])
            for name in _SUB_CONFIGS:
                if isinstance(kwargs.get(name), dict):
                    kwargs[name] = PretrainedConfig(**kwargs[name])
            PretrainedConfig.__init__(self, **kwargs)

        config_cls = type(f"Tiny{architecture}Config", (PretrainedConfig,),
                          {"model_type": model_type, "__init__": __init__})
        AutoConfig.register(model_type, config_cls)
    config = CONFIG_MAPPING[model_type](**{**GENERIC_REMOTE, **fix})
    config.architectures = [architecture]
    check_tiny(config)
    return config


#: The model type a remote-code config declares where vLLM keys behaviour on it (its per-type
#: ``ModelArchConfigConvertor``: Nemotron-NAS's KV heads come from its block configs).
REMOTE_MODEL_TYPES = {"DeciLMForCausalLM": "nemotron-nas",
                      # transformers' Ernie4_5_VLMoeConfig has other fields (one int per expert kind) than the
                      # remote-code config vLLM's ernie45_vl reads (lists over text and vision experts)
                      "Ernie4_5_VLMoeForConditionalGeneration": "ernie4_5_moe_vl"}
#: Architectures built with their towers (vLLM's ``language_model_only`` breaks them), and why.
TOWERS_BUILT = {"MossAudioModel": "vLLM's text-only mode builds its audio encoder on the meta device, where "
                "the encoder's constructor calls .item()"}
#: Remote-code config fields whose items the model code reads by attribute (``block_config.ffn.no_op``):
#: the remote config class parses them into objects; here they become ``_Attrs`` (still JSON dicts).
_ATTRIBUTE_FIELDS = ("block_configs", "vit_config", "adapter_config", "vision_config")
#: Remote-code config fields that are configs of their own (vLLM's ``get_text_config`` returns them).
_SUB_CONFIGS = ("text_config",)


class _Attrs(dict):  # type: ignore[type-arg]
    """A JSON dict whose keys read as attributes (a missing one raises AttributeError, so hasattr works)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _attrs(value: Any) -> Any:
    if isinstance(value, list):
        return [_attrs(v) for v in value]
    return _Attrs({k: _attrs(v) for k, v in value.items()}) if isinstance(value, dict) else value


#: Size fields no tiny (sub-)config may exceed; above them the recipe missed a sub-config (an audio or
#: vision tower at full size would allocate gigabytes on a machine other processes share).
SIZE_LIMITS = {"hidden_size": 256, "d_model": 256, "intermediate_size": 1024, "num_hidden_layers": 8,
               "num_layers": 8, "encoder_layers": 8, "depth": 8, "vocab_size": 4096}


def check_tiny(config: Any) -> None:
    """Raise ``TinyConfigError`` naming the first (sub-)config field above ``SIZE_LIMITS``."""

    def walk(node: Any, path: str, seen: set[int]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else vars(node).items() if hasattr(node, "to_dict") else ()
        for key, value in items:
            if key in SIZE_LIMITS and isinstance(value, int) and not isinstance(value, bool) and value > SIZE_LIMITS[key]:
                raise TinyConfigError(
                    f"the tiny config is not tiny: {path}{key} = {value} (limit {SIZE_LIMITS[key]}); the recipe does "
                    "not shrink this sub-config"
                )
            if isinstance(value, dict) or hasattr(value, "to_dict"):
                walk(value, f"{path}{key}.", seen)

    walk(config, "", set())


def write_model_dir(config: Any, directory: str) -> str:
    """Write ``config.json`` (float32) into ``directory``; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    config.dtype = "float32"
    config.save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.pop("torch_dtype", None)
    for key in _DERIVED_KEYS.get((getattr(config, "architectures", None) or [""])[0], ()):
        data.pop(key, None)
    data["dtype"] = "float32"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return directory

