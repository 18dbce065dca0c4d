"""``inspect_draft_checkpoint``: a draft's config and tensor headers, resolved and validated against the target.

Reads no tensor data (safetensors headers only), so every pipeline stage can call it before loading target
weights. Must not import the engine's loop, ``pipespec.pp`` or vllm.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.conventions import AuxConvention, resolve_aux_ids
from pipespec.engine.draft_checkpoint.files import read_config, tensor_shapes, weight_files
from pipespec.engine.draft_checkpoint.formats import (
    FORMAT_NAMES,
    DraftFormat,
    canonical_name,
    detect_draft_format,
    disk_name,
    format_fields,
)
from pipespec.engine.draft_checkpoint.info import DraftCheckpointInfo, TargetInfo
from pipespec.errors import CheckpointError

# Keys of a Llama config that shape the draft's decoder layer; everything else in a draft config is
# metadata (architectures, eagle_config, speculators_config, dtype ...).
_LAYER_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "mlp_bias", "vocab_size",
)


def _layer_config(raw: Mapping[str, Any], where: str) -> LlamaConfig:
    values = {k: raw[k] for k in _LAYER_KEYS if k in raw and raw[k] is not None}
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in values]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}: cannot size the draft's decoder layer")
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    return LlamaConfig(num_hidden_layers=1, **values)


def inspect_draft_checkpoint(
    path: str | Path, target: TargetInfo, aux_convention: AuxConvention | None = None
) -> DraftCheckpointInfo:
    """Read a draft's config and tensor headers, resolve its aux ids, and validate it against ``target``.

    Reads no tensor data (safetensors headers only), so every pipeline stage can call it before loading
    target weights. Raises ``CheckpointError`` naming the field and the fix for anything inconsistent.
    """
    path = Path(path)
    raw = read_config(path)
    where = str(path / "config.json")
    fmt = detect_draft_format(raw, where)
    warnings: list[str] = []

    layer_raw, ids_raw, ids_field = format_fields(raw, fmt, where, warnings)
    layer = _layer_config(layer_raw, where if fmt == "A" else f"{where} transformer_layer_config")
    hidden = int(layer.hidden_size)
    draft_vocab = int(raw.get("draft_vocab_size") or layer_raw.get("draft_vocab_size") or layer.vocab_size)
    norm_before_residual = bool(raw.get("norm_before_residual", False))
    convention, source, config_ids, aux_layers = resolve_aux_ids(
        ids_raw, ids_field, fmt, aux_convention, target.num_layers, where, warnings
    )
    shapes = {canonical_name(k, fmt): v for k, v in tensor_shapes(weight_files(path)).items()}
    num_aux = _num_aux(path, where, shapes, hidden, raw.get("target_hidden_size") or layer_raw.get("target_hidden_size"),
                       target, aux_layers, ids_field)
    if int(layer.vocab_size) != target.vocab_size:
        raise CheckpointError(
            f"{where}: vocab_size {layer.vocab_size} does not match the target's vocabulary ({target.vocab_size}): "
            "the draft must embed and map to the target's token ids"
        )

    config = Eagle3DraftConfig(
        layer=layer, target_hidden_size=target.hidden_size, num_aux=num_aux, draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual,
    )
    has_embedding = _check_tensors(path, fmt, shapes, config, target, warnings)
    return DraftCheckpointInfo(
        path=path, format=fmt, config=config, aux_convention=convention, aux_convention_source=source,
        config_aux_layers=config_ids, aux_layers=aux_layers, has_embedding=has_embedding, shapes=shapes,
        warnings=tuple(warnings),
    )


def _num_aux(
    path: Path, where: str, shapes: Mapping[str, tuple[int, ...]], hidden: int, target_hidden: Any,
    target: TargetInfo, aux_layers: tuple[int, ...], ids_field: str,
) -> int:
    """The number of aux states ``fc.weight`` takes, checked against the target and the resolved aux ids."""
    fc = shapes.get("fc.weight")
    if fc is None:
        raise CheckpointError(f"{path}: missing tensor fc.weight (the k*H_t -> H projection of aux states)")
    if len(fc) != 2 or fc[0] != hidden:
        raise CheckpointError(f"{path}: fc.weight has shape {list(fc)}, expected [{hidden}, k*H_t] for hidden_size {hidden}")
    if target_hidden is not None and int(target_hidden) != target.hidden_size:
        raise CheckpointError(
            f"{where}: target_hidden_size {target_hidden} does not match the target's hidden_size {target.hidden_size}: "
            "this draft was trained for another target"
        )
    if fc[1] % target.hidden_size:
        raise CheckpointError(
            f"{path}: fc.weight takes {fc[1]} inputs, not a multiple of the target's hidden_size {target.hidden_size}: "
            "this draft was trained for another target"
        )
    num_aux = fc[1] // target.hidden_size
    if num_aux != len(aux_layers):
        raise CheckpointError(
            f"{path}: fc.weight takes {num_aux} aux states ({fc[1]} = {num_aux} x {target.hidden_size}) but the aux ids "
            f"resolve to {len(aux_layers)}: {list(aux_layers)} (input-index, deduplicated); fix {ids_field}"
        )
    return num_aux


def _check_tensors(
    path: Path, fmt: DraftFormat, shapes: Mapping[str, tuple[int, ...]], config: Eagle3DraftConfig,
    target: TargetInfo, warnings: list[str],
) -> bool:
    """Every tensor's header against the shapes ``config`` implies; whether the draft ships an embedding."""
    hidden, draft_vocab = config.hidden_size, config.draft_vocab_size
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Eagle3Draft(config, with_embedding=True).state_dict().items()}

    head = shapes.get("lm_head.weight")
    if head is not None and head[0] != draft_vocab:
        raise CheckpointError(
            f"{path}: lm_head.weight has {head[0]} rows but draft_vocab_size is {draft_vocab}: the draft vocabulary "
            "and its head disagree"
        )
    has_embedding = "embed_tokens.weight" in shapes
    if has_embedding and shapes["embed_tokens.weight"] != expected["embed_tokens.weight"]:
        raise CheckpointError(
            f"{path}: embed_tokens.weight has shape {list(shapes['embed_tokens.weight'])}, expected "
            f"{list(expected['embed_tokens.weight'])} (target vocab x draft hidden)"
        )
    if not has_embedding and hidden != target.hidden_size:
        raise CheckpointError(
            f"{path}: the draft ships no embed_tokens and its hidden_size {hidden} differs from the target's "
            f"{target.hidden_size}: it cannot share the target's input embedding"
        )
    if "d2t" not in shapes and draft_vocab != target.vocab_size:
        raise CheckpointError(
            f"{path}: missing tensor d2t: the draft vocabulary ({draft_vocab}) is smaller than the target's "
            f"({target.vocab_size}), so d2t offsets are needed to map draft ids to target ids"
        )
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing = [k for k in expected if k not in optional and k not in shapes]
    if missing:
        shown = [disk_name(k, fmt) for k in missing]
        raise CheckpointError(f"{path}: missing tensors {shown} for a {FORMAT_NAMES[fmt]} draft")
    for key, shape in shapes.items():
        if key in expected and shape != expected[key]:
            raise CheckpointError(
                f"{path}: tensor {disk_name(key, fmt)} has shape {list(shape)}, expected {list(expected[key])} "
                "from the config (hidden_size, heads, head_dim, intermediate_size, vocab sizes)"
            )
    unexpected = sorted(k for k in shapes if k not in expected)
    if unexpected:
        warnings.append(f"{path}: ignoring tensors not part of an EAGLE3 draft: {unexpected}")
    return has_embedding
