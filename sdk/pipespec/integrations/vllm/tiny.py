"""Tiny HF configs for vLLM architectures, written to a directory vLLM's ``ModelConfig`` can load.

The vLLM zoo builds every PP decoder of the installed vLLM through vLLM itself, so it needs a model
directory per architecture: a ``config.json`` only (weights are filled by the harness, there is no
tokenizer). The config comes from pipespec's HF tiny recipe (``pipespec.zoo.tiny``: 6 layers, hidden
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

__all__ = ["TinyConfigError", "architectures_of", "model_type_of", "tiny_vllm_config", "write_model_dir"]


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
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    return _CONFIG_REGISTRY  # type: ignore[no-any-return]


def model_type_of(architecture: str, file_stem: str) -> str | None:
    """The HF ``model_type`` of ``architecture`` (defined in file ``file_stem``), or None if unknown."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vllm_types = _vllm_config_classes()
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


def tiny_vllm_config(architecture: str, file_stem: str) -> tuple[Any, str]:
    """The tiny float32 HF config that makes vLLM build ``architecture``, and its model type.

    transformers' types go through ``pipespec.zoo.tiny.tiny_config`` (its per-type fixes included);
    vLLM's own config classes get the same generic recipe, restricted to the keywords they declare.
    """
    from pipespec.zoo import tiny as hf_tiny

    model_type = model_type_of(architecture, file_stem)
    if model_type is None:
        raise TinyConfigError(
            f"no model type for architecture {architecture}: not in transformers' auto mappings nor in vLLM's "
            f"config registry under {file_stem!r}"
        )
    config_cls = _config_class(model_type)
    if model_type in _vllm_config_classes() or not dataclasses.is_dataclass(config_cls):
        fields = hf_tiny.config_fields(config_cls) or _init_fields(config_cls)
        kwargs = {k: v for k, v in hf_tiny.GENERIC.items() if k in fields}
        hf_tiny._tiny_special_ids(fields, kwargs)
        hf_tiny._scale_mla_dims(fields, kwargs)
        fix = hf_tiny.FIXES.get(model_type)
        if fix is not None:
            fix.apply(kwargs)
        try:
            with hf_tiny._quiet():
                config = config_cls(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any validation failure is the reason to report
            raise TinyConfigError(f"vLLM config {config_cls.__name__} rejects the tiny recipe: {_one_line(exc)}") from None
    else:
        try:
            config, _fixes = hf_tiny.tiny_config(model_type)
        except hf_tiny.TinyBuildError as exc:
            raise TinyConfigError(str(exc)) from None
    config.architectures = [architecture]
    return config, model_type


def write_model_dir(config: Any, directory: str) -> str:
    """Write ``config.json`` (float32) into ``directory``; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    config.dtype = "float32"
    config.save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.pop("torch_dtype", None)
    data["dtype"] = "float32"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return directory


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
