"""The per-type fixes of the tiny recipe: one entry per model type the generic recipe cannot express.

Each ``Fix`` carries the reason it exists (the coverage report lists them) and an edit of the recipe's
keyword arguments. Imports only ``sizes``; the recipe (``tiny``) reads this table, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipespec.integrations.transformers.zoo.sizes import (
    BUILD_FROM,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    SUB_CONFIGS,
    VOCAB,
)

__all__ = ["FIXES", "Fix"]


@dataclass(frozen=True)
class Fix:
    """A per-type repair of the generic recipe: ``apply(kwargs)`` edits the config keyword arguments."""

    reason: str
    apply: Callable[[dict[str, Any]], None]


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    def apply(kwargs: dict[str, Any]) -> None:
        kwargs.update(values)

    return apply


def _text(**values: Any) -> Callable[[dict[str, Any]], None]:
    """Edit the recipe of the ``text_config`` sub-config."""

    def apply(kwargs: dict[str, Any]) -> None:
        kwargs[SUB_CONFIGS]["text_config"][1].update(values)

    return apply


def _build_from(sub: str, **values: Any) -> Callable[[dict[str, Any]], None]:
    """Build the composite config, then hand its ``sub`` config to the causal-LM class."""

    def apply(kwargs: dict[str, Any]) -> None:
        kwargs[BUILD_FROM] = sub
        kwargs[SUB_CONFIGS][sub][1].update(values)

    return apply


def _both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(kwargs: dict[str, Any]) -> None:
        for edit in edits:
            edit(kwargs)

    return apply


_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

#: Per-type repairs, each with the reason the generic recipe is not enough.
FIXES: dict[str, Fix] = {
    "blt": Fix("hash-byte embedding vocabulary (500k rows) is a separate field", _set(encoder_hash_byte_group_vocab=VOCAB)),
    "cohere_compass_text": Fix(
        "rope parameters are per layer type and empty by default",
        _set(rope_parameters={"full_attention": dict(_ROPE), "sliding_attention": dict(_ROPE)},
             layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    ),
    "dbrx": Fix(
        "attention and FFN sizes live in sub-configs; the attention config lacks the rope_theta the model reads, "
        "and its default clip_qkv=None reaches torch.clamp(min=None, max=None)",
        lambda kw: kw[SUB_CONFIGS].update({
            "attn_config": (kw[SUB_CONFIGS]["attn_config"][0], {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0}),
            "ffn_config": (kw[SUB_CONFIGS]["ffn_config"][0], {"ffn_hidden_size": FFN, "moe_num_experts": 4, "moe_top_k": 2}),
        }),
    ),
    "deepseek_v4": Fix("grouped output projection has its own rank and group count", _set(o_lora_rank=16, o_groups=2)),
    "dots3_note_text": Fix(
        "MLA attention requires num_key_value_heads == num_attention_heads; sliding layers take swa_* sizes",
        _set(num_key_value_heads=HEADS, swa_num_attention_heads=HEADS, swa_num_key_value_heads=HEADS, swa_q_lora_rank=32,
             swa_kv_lora_rank=16, swa_head_dim=HEAD_DIM, swa_qk_nope_head_dim=8, swa_v_head_dim=16),
    ),
    "dots3_note": Fix(
        "the vision and audio adapters must map the tower widths onto the text width",
        lambda kw: (kw[SUB_CONFIGS]["vision_config"][1].update(adapter_in_dim=HIDDEN, adapter_out_dim=HIDDEN),
                    kw[SUB_CONFIGS]["audio_config"][1].update(adapter_input_size=HIDDEN, adapter_out_dim=HIDDEN)),
    ),
    "gemma4_unified": Fix(
        "the vision embedder's patch size and projection width are separate fields",
        lambda kw: kw[SUB_CONFIGS]["vision_config"][1].update(patch_size=2, pooling_kernel_size=2, model_patch_size=4, mm_embed_dim=HIDDEN),
    ),
    "gemma3n_text": Fix(
        "KV-sharing layers must have a producer of each attention kind before them",
        _set(layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2, laurel_rank=8),
    ),
    "gemma4_assistant": Fix(
        "the assistant has no per-layer inputs and reads a backbone of its own width",
        _both(_text(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
              _set(backbone_hidden_size=HIDDEN, num_centroids=16, centroid_intermediate_top_k=4)),
    ),
    "gemma4_unified_assistant": Fix(
        "the assistant reads a backbone of its own width and a centroid table",
        _set(backbone_hidden_size=HIDDEN, num_centroids=16, centroid_intermediate_top_k=4),
    ),
    "gpt_neo": Fix(
        "heads are `num_heads` and the local/global attention pattern is a list sized for 24 layers",
        _set(num_heads=HEADS, attention_types=[[["global", "local"], LAYERS // 2]]),
    ),
    "inkling_text": Fix(
        "sliding-window attention has its own head counts and window",
        _set(swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM, sliding_window_size=4),
    ),
    "inkling2_text": Fix(
        "sliding-window attention has its own head counts and window; the unpadded vocabulary is a field",
        _set(swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM, sliding_window_size=4,
             unpadded_vocab_size=VOCAB, n_layers_per_attn_res_block=2),
    ),
    "inkling2_loop_text": Fix(
        "sliding-window attention has its own head counts and window; the loop range is in layer indices",
        _set(swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM, sliding_window_size=4,
             unpadded_vocab_size=VOCAB, n_layers_per_attn_res_block=2),
    ),
    "lfm2": Fix(
        "full_attn_idxs defaults to every layer; real checkpoints mix short-convolution and attention layers",
        _set(full_attn_idxs=[2, 5], layer_types=None),
    ),
    "lfm2_moe": Fix(
        "layer_types has no default (the modeling code indexes it)",
        _set(layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv"], num_dense_layers=1),
    ),
    "longcat_flash": Fix("zero experts (256 by default) are added to the routed experts", _set(zero_expert_num=2)),
    "mamba2": Fix("heads x head_dim must equal expand x hidden", _set(num_heads=8, head_dim=16)),
    "musicgen": Fix(
        "the causal LM is the decoder alone: built from the `decoder` sub-config, input is one row per codebook",
        _build_from("decoder", num_codebooks=2),
    ),
    "musicgen_melody": Fix(
        "the causal LM is the decoder alone: built from the `decoder` sub-config, input is one row per codebook",
        _build_from("decoder", num_codebooks=2),
    ),
    "phi4_multimodal": Fix("the audio encoder's convolution width is a separate field",
                           lambda kw: kw[SUB_CONFIGS]["audio_config"][1].update(ext_pw_out_channel=HIDDEN, num_blocks=1)),
    "reformer": Fix(
        "the causal LM requires is_decoder; axial position shape must factor the tiny sequence length",
        _set(is_decoder=True, axial_pos_shape=[8, 16], axial_pos_embds_dim=[32, 32], attn_layers=["local", "lsh"] * 3,
             attention_head_size=HEAD_DIM, feed_forward_size=FFN, local_attn_chunk_length=4, lsh_attn_chunk_length=4),
    ),
    "roc_bert": Fix(
        "pronunciation and shape embeddings have their own vocabularies and widths",
        _set(pronunciation_embed_dim=32, pronunciation_vocab_size=64, shape_embed_dim=32, shape_vocab_size=64),
    ),
    "zamba": Fix(
        "the shared transformer block is tied across hybrid layers, so at least two are needed",
        _set(layers_block_type=["linear_attention", "linear_attention", "hybrid", "linear_attention", "hybrid", "linear_attention"]),
    ),
    "qwen4_exp_text": Fix(
        "indexed-attention layers build an indexer whose sizes have no defaults",
        _set(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=4, indexer_compress_ratio=2),
    ),
    "bamba": Fix("attention layer indices default to none at this depth", _set(attn_layer_indices=[2, 5])),
    "granitemoehybrid": Fix(
        "layer_types defaults to Mamba only", _set(layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)
    ),
    "mllama": Fix("cross-attention layer indices are absolute and beyond 6 layers", _text(cross_attention_layers=[3])),
    "nemotron_h": Fix(
        "the layer pattern is a list that also fixes the depth",
        _set(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]),
    ),
    "zaya": Fix("only one expert per token is supported", _set(num_experts_per_tok=1)),
}
