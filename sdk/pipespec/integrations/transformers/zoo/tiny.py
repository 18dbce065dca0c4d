"""Tiny random float32 models for every causal-LM type of the installed transformers.

The zoo needs a model of each type small enough to build and run in milliseconds, yet shaped like the
real thing: several layers (so stages can split them), grouped-query attention, every *kind* of layer
the architecture mixes (sliding and full attention, linear attention, Mamba, MoE and dense MLPs). The
generic recipe sets the usual size fields of the type's config class (only those the class declares);
per-type fixes repair what the recipe cannot express. Each fix is one entry of ``fixes.FIXES`` with the
reason it exists, so the coverage table can say which types needed one.

Before any weight is allocated the model is built on the ``meta`` device and its parameters counted:
a sub-config the recipe missed (an untouched 27-layer vision tower, a 500k hash vocabulary) would
otherwise allocate gigabytes. A type that cannot be built raises ``TinyBuildError`` whose message is the
specific reason, and the zoo reports the type as declined with it.

    >>> tiny = build_tiny_model("llama")                     # doctest: +SKIP
    >>> tiny.config.num_hidden_layers, tiny.config.hidden_size
    (6, 64)

The recipe and the builder only: it imports torch, transformers (lazily) and the zoo's ``sizes`` and
``fixes``, never the zoo's checks or pipespec's adaptation (a tiny model is their input, nothing more).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipespec.errors import one_line
from pipespec.integrations.transformers.zoo.fixes import FIXES
from pipespec.integrations.transformers.zoo.sizes import (
    BUILD_FROM,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    POSITIONS,
    SUB_CONFIGS,
    VOCAB,
)

__all__ = [
    "FIXES",
    "GENERIC",
    "MAX_TINY_PARAMS",
    "TinyBuildError",
    "TinyModel",
    "build_tiny_model",
    "causal_lm_model_types",
    "quiet_transformers",
    "scale_mla_dims",
    "tiny_config",
    "tiny_special_ids",
]

#: Upper bound on a tiny model's parameters; above it the recipe missed a size field of the type.
MAX_TINY_PARAMS = 5_000_000

#: The generic recipe: config field -> tiny value, applied to every field the config class declares.
#: Several names mean the same quantity in different families (``n_embd``, ``d_model``, ...).
GENERIC: dict[str, Any] = {
    # width
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim"), HIDDEN),
    # depth
    # (encoder depth too: Bart-style configs alias num_hidden_layers to encoder_layers, and the decoder's
    # DynamicCache(config) is sized by it)
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers", "encoder_layers",
         "num_encoder_layers"),
        LAYERS,
    ),
    # attention heads
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "attention_heads", "decoder_attention_heads",
         "num_decoder_attention_heads", "encoder_attention_heads", "num_encoder_attention_heads"),
        HEADS,
    ),
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    # MLP widths
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_inner", "dff",
         "dim_ff", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size", "d_ff"),
        FFN,
    ),
    # vocabulary and positions
    "vocab_size": VOCAB,
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "context_length", "max_seq_len"),
        POSITIONS,
    ),
    # mixture of experts: a few small experts, and at least one dense layer where the family has them
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
         "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size"),
        32,
    ),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts"), 1),
    # per-layer input embeddings (Gemma 3n / 4)
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    # multi-head latent attention (DeepSeek-style)
    # (head dims are scaled from the defaults by scale_mla_dims; the ranks are independent of them)
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "rotary_dim": 8,  # partial rotary (CodeGen, GPT-J): at most the tiny head_dim
    # sparse-attention indexers
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    # linear attention (gated delta net and friends)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    # state-space layers
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 8),
    "mamba_head_dim": 16,
    "n_groups": 1,
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 16),
}

#: Token-id fields that must index the tiny vocabulary; ids outside it are replaced (pad 0, bos 1, eos 2,
#: others counted down from the top of the vocabulary).
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}

#: Depth for towers next to the text decoder (vision, audio): the zoo never runs them.
_SIDE_LAYERS = 1
_DEPTH_FIELDS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers", "encoder_layers",
    "num_encoder_layers", "num_blocks",
)
#: Sub-configs that hold the text decoder the zoo runs (every other sub-config is a side tower).
_TEXT_SUB_CONFIGS = ("text_config", "decoder", "decoder_config", "language_config", "llm_config", "global_config")


class TinyBuildError(Exception):
    """The tiny model of a type could not be built; ``str(exc)`` is the specific reason."""


@dataclass
class TinyModel:
    """A built tiny model and how it was made."""

    model_type: str
    config: Any
    model: torch.nn.Module  # the causal-LM class of the type, in eval mode
    fixes: tuple[str, ...]  # names of the per-type fixes applied (keys of FIXES)
    num_parameters: int


def causal_lm_model_types() -> list[str]:
    """Every model type of the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ----------------------------------------------------------------------------------- the recipe
def config_fields(config_cls: type) -> dict[str, Any]:
    """Declared fields of a (dataclass-style, transformers 5.x) config class with their defaults."""
    try:
        fields = dataclasses.fields(config_cls)
    except TypeError:
        return {}
    out: dict[str, Any] = {}
    for f in fields:
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


def tiny_special_ids(fields: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Token-id fields whose defaults fall outside the tiny vocabulary: the known ones set to their tiny ids,
    the others to distinct ids counted down from the vocabulary's end (into ``kwargs``)."""
    spare = VOCAB - 1
    for name, default in fields.items():
        if not (name.endswith("token_id") or name.endswith("token_index") or name.endswith("token_ids")):
            continue
        values = default if isinstance(default, list) else [default]
        if not any(isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB for v in values):
            continue
        if name in _SPECIAL_IDS:
            kwargs[name] = _SPECIAL_IDS[name]
        else:
            kwargs[name] = spare
            spare -= 1


def _truncate_layer_list(values: list[Any], n: int = LAYERS) -> list[Any]:
    """First ``n`` entries of a per-layer list, then every missing kind swapped in from the end.

    ``["sliding"] * 5 + ["full"]`` repeated over 48 layers keeps its 5:1 pattern in 6 layers; a kind
    that first appears later (one "attention" among 40 "mamba") replaces the last entries.
    """
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(map(_hashable, values)) if v not in map(_hashable, out)]
    for i, kind in enumerate(missing[:n]):
        out[n - 1 - i] = kind
    return out


_MLA_DIMS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "head_dim")


def scale_mla_dims(fields: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Latent-attention head dims, scaled together so the rope part is 8 wide.

    Their relations differ by family (``head_dim`` is the rope width in DeepSeek-V3.2, rope + nope in
    HY-V4, the value width in Bailing; ``None`` means derived): scaling every one by the same factor
    keeps whichever relation the modeling code assumes. Latent attention expands K and V to every head
    and then still repeats them by ``heads // kv_heads``, so it needs ``num_key_value_heads == heads``.
    """
    rope = fields.get("qk_rope_head_dim")
    if not isinstance(rope, int) or isinstance(rope, bool) or rope <= 0:
        return
    if "num_key_value_heads" in fields:
        kwargs["num_key_value_heads"] = HEADS
    for name in _MLA_DIMS:
        default = fields.get(name)
        if isinstance(default, int) and not isinstance(default, bool) and default > 0:
            kwargs[name] = max(2, default * 8 // rope)
        elif name in fields:
            kwargs.pop(name, None)  # derived in __post_init__ from the others


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _default_instance(config_cls: type) -> Any | None:
    """The config class built with its defaults, to read what ``__post_init__`` derives (None if it fails)."""
    try:
        with quiet_transformers():
            return config_cls()
    except Exception:  # noqa: BLE001 - some classes need arguments; the recipe then works from fields only
        return None


def _recipe(config_cls: type, depth: int) -> dict[str, Any]:
    """Keyword arguments of the tiny config; sub-configs are nested dicts under ``SUB_CONFIGS``."""
    fields = config_fields(config_cls)
    kwargs = {k: v for k, v in GENERIC.items() if k in fields}
    for k in _DEPTH_FIELDS:
        if k in kwargs:
            kwargs[k] = depth
    if "sliding_window" in fields and isinstance(fields["sliding_window"], int):
        kwargs["sliding_window"] = 4  # shorter than the test sequence, so sliding masks matter
    if "is_decoder" in fields:
        kwargs["is_decoder"] = True  # BERT-style stacks are causal only as decoders
    tiny_special_ids(fields, kwargs)
    scale_mla_dims(fields, kwargs)
    default = _default_instance(config_cls)
    default_depth = _depth_of(default)
    for name in fields:
        value = _peek(default, name) if default is not None else fields[name]
        if (
            isinstance(value, list)
            and default_depth is not None
            and len(value) == default_depth > depth
            and ("layer" in name or "block" in name)
            and all(isinstance(v, str) for v in value)
        ):
            kwargs[name] = _truncate_layer_list(value, depth)
    subs: dict[str, tuple[type, dict[str, Any]]] = {}
    for name in getattr(config_cls, "sub_configs", None) or {}:
        sub_cls = _sub_config_class(config_cls, default, name)
        if sub_cls is None:
            continue
        textual = name in _TEXT_SUB_CONFIGS
        sub_kwargs = _recipe(sub_cls, depth if textual else _SIDE_LAYERS)
        sub_fix = FIXES.get(getattr(sub_cls, "model_type", "") or "")
        if sub_fix is not None:
            sub_fix.apply(sub_kwargs)
        subs[name] = (sub_cls, sub_kwargs)
    if subs:
        kwargs[SUB_CONFIGS] = subs
    return kwargs


def _peek(config: Any, name: str) -> Any:
    """``getattr`` that tolerates configs refusing global reads of per-layer attributes (Gemma 4)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and friends
        return None


def _sub_config_class(config_cls: type, default: Any, name: str) -> type | None:
    """The class of sub-config ``name``: what the default instance holds, the declared default model
    type (``sub_configs_defaults``), or the declared class when it is concrete."""
    held = type(_peek(default, name)) if default is not None else None
    if held is not None and dataclasses.is_dataclass(held):
        return held
    spec = (getattr(config_cls, "sub_configs_defaults", None) or {}).get(name)
    model_type = getattr(spec, "model_type", None)
    if isinstance(model_type, str):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        try:
            return CONFIG_MAPPING[model_type]  # type: ignore[no-any-return]
        except KeyError:
            pass
    declared = (getattr(config_cls, "sub_configs", None) or {})[name]
    return declared if isinstance(declared, type) and dataclasses.is_dataclass(declared) else None


def _depth_of(config: Any) -> int | None:
    if config is None:
        return None
    for k in _DEPTH_FIELDS:
        value = _peek(config, k)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _instantiate(config_cls: type, kwargs: dict[str, Any]) -> Any:
    kwargs = dict(kwargs)
    for name, (sub_cls, sub_kwargs) in kwargs.pop(SUB_CONFIGS, {}).items():
        kwargs[name] = _instantiate(sub_cls, sub_kwargs)
    return config_cls(**kwargs)


def tiny_config(model_type: str) -> tuple[Any, tuple[str, ...]]:
    """The tiny config of ``model_type`` and the names of the per-type fixes it needed."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_cls = CONFIG_MAPPING[model_type]
    except (KeyError, ImportError) as exc:
        raise TinyBuildError(f"no config class for model type {model_type!r}: {exc}") from None
    kwargs = _recipe(config_cls, LAYERS)
    applied = []
    fix = FIXES.get(model_type)
    if fix is not None:
        fix.apply(kwargs)
        applied.append(model_type)
    applied += [sub_cls.model_type for sub_cls, _ in kwargs.get(SUB_CONFIGS, {}).values() if sub_cls.model_type in FIXES]
    target = kwargs.pop(BUILD_FROM, None)
    try:
        with quiet_transformers():
            config = _instantiate(config_cls, kwargs)
            if target is not None:
                config = getattr(config, target)
    except Exception as exc:  # noqa: BLE001 - any config validation failure is the reason to report
        raise TinyBuildError(f"config {config_cls.__name__} rejects the tiny recipe: {one_line(exc)}") from None
    return config, tuple(dict.fromkeys(applied))


def build_tiny_model(model_type: str, seed: int = 0) -> TinyModel:
    """Build the tiny float32 causal LM of ``model_type`` (eager attention, eval mode, seeded weights)."""
    config, fixes = tiny_config(model_type)
    lm_class = _causal_lm_class(model_type, config)
    try:
        with quiet_transformers(), torch.device("meta"):
            shell = _from_config(lm_class, config)
    except Exception as exc:  # noqa: BLE001
        raise TinyBuildError(f"{type(config).__name__} does not build a causal LM: {one_line(exc)}") from None
    count = sum(p.numel() for p in shell.parameters())
    if count > MAX_TINY_PARAMS:
        biggest = max(shell.named_parameters(), key=lambda kv: kv[1].numel())
        raise TinyBuildError(
            f"tiny recipe still gives {count:,} parameters (largest: {biggest[0]} {tuple(biggest[1].shape)}); "
            "a size field of this config is not covered"
        )
    del shell
    torch.manual_seed(seed)
    try:
        with quiet_transformers():
            model = _from_config(lm_class, config)
    except Exception as exc:  # noqa: BLE001
        raise TinyBuildError(f"{type(config).__name__} does not build a causal LM: {one_line(exc)}") from None
    model.eval()
    return TinyModel(model_type=model_type, config=config, model=model, fixes=fixes, num_parameters=count)


def _causal_lm_class(model_type: str, config: Any) -> Any:
    """``AutoModelForCausalLM`` (the only way composite configs build), or the mapped class by name when
    the config is a sub-config the auto mapping does not know (musicgen's decoder)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if type(config) is CONFIG_MAPPING[model_type]:
        return AutoModelForCausalLM
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _from_config(lm_class: Any, config: Any) -> torch.nn.Module:
    """float32 weights and eager attention: one plain attention path for the reference and the stages."""
    build = lm_class.from_config if hasattr(lm_class, "from_config") else lm_class._from_config
    return build(config, dtype=torch.float32, attn_implementation="eager")  # type: ignore[no-any-return]



@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' config warnings (token ids, rope fields) while building tiny models."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
