"""The two on-disk draft formats: detection, tensor names, and the config fields each one reads and writes.

Format A (EAGLE reference, SpecForge, ModelOpt: ``midlayer.*``, ids under ``eagle_config``) and Format B
(speculators: ``layers.0.*``, the layer under ``transformer_layer_config``); docs/draft-formats.md has the
field tables. Plain data and dicts; must not import torch, the draft model or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pipespec.errors import CheckpointError

if TYPE_CHECKING:
    from pipespec.engine.draft.config import Eagle3DraftConfig

DraftFormat = Literal["A", "B"]

ARCHITECTURES_A = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ARCHITECTURES_B = ("Eagle3Speculator",)
FORMAT_NAMES = {"A": "Format A (EAGLE/SpecForge/ModelOpt, midlayer.*)", "B": "Format B (speculators, layers.0.*)"}

LAYER_PREFIX = {"A": "midlayer.", "B": "layers.0."}


def detect_draft_format(config: Mapping[str, Any], where: str = "config.json") -> DraftFormat:
    """Format A or B from ``architectures`` (speculators' ``speculators_model_type`` also counts)."""
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if any(a in ARCHITECTURES_A for a in archs):
        return "A"
    if any(a in ARCHITECTURES_B for a in archs) or config.get("speculators_model_type") == "eagle3":
        return "B"
    raise CheckpointError(
        f"{where}: unknown draft checkpoint format (architectures {list(archs)}): pipespec reads EAGLE3 drafts in "
        f"{FORMAT_NAMES['A']} with architectures {list(ARCHITECTURES_A)} and its ids in eagle_config, or "
        f"{FORMAT_NAMES['B']} with architectures {list(ARCHITECTURES_B)} and its layer under "
        "transformer_layer_config: convert the draft to one of them"
    )


def canonical_name(name: str, fmt: DraftFormat) -> str:
    """The canonical (``midlayer.*``) name of a ``fmt`` checkpoint's tensor ``name``."""
    prefix = LAYER_PREFIX[fmt]
    return "midlayer." + name[len(prefix):] if name.startswith(prefix) else name


def disk_name(name: str, fmt: DraftFormat) -> str:
    """The name a canonical (``midlayer.*``) tensor has in a ``fmt`` checkpoint, for error messages."""
    return LAYER_PREFIX[fmt] + name[len("midlayer."):] if name.startswith("midlayer.") else name


def format_fields(
    raw: Mapping[str, Any], fmt: DraftFormat, where: str, warnings: list[str]
) -> tuple[Mapping[str, Any], Any, str]:
    """Where ``fmt`` keeps the decoder layer's config and the aux ids: (layer config, raw ids, ids field name)."""
    if fmt == "A":
        layer_raw: Mapping[str, Any] = raw
        eagle_config = raw.get("eagle_config") or {}
        ids_raw = eagle_config.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        ids_field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        layer_raw = raw.get("transformer_layer_config") or {}
        if not layer_raw:
            raise CheckpointError(f"{where}: Format B (speculators) config has no transformer_layer_config")
        ids_raw = raw.get("eagle_aux_hidden_state_layer_ids")
        ids_field = "eagle_aux_hidden_state_layer_ids"
        if "speculators_config" not in raw:
            warnings.append(f"{where}: Format B config has no speculators_config (read anyway)")
    return layer_raw, ids_raw, ids_field


def format_config(
    fmt: DraftFormat, layer: dict[str, Any], config: Eagle3DraftConfig, ids: list[int] | None, verifier: str | None,
    num_speculative_tokens: int,
) -> dict[str, Any]:
    """The config.json of a ``fmt`` draft: ``layer`` (the decoder layer's Llama fields) and the format's own fields;
    ``ids`` the aux ids as written (None: omitted)."""
    if fmt == "A":
        cfg: dict[str, Any] = {"architectures": [ARCHITECTURES_A[0]], **layer}
        cfg["draft_vocab_size"] = config.draft_vocab_size
        cfg["target_hidden_size"] = config.target_hidden_size
        cfg["eagle_config"] = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                               "use_last_layernorm": True}
        if ids is not None:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        cfg = {
            "architectures": [ARCHITECTURES_B[0]],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": config.draft_vocab_size,
            "norm_before_residual": config.norm_before_residual,
            "target_hidden_size": config.target_hidden_size,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
                "verifier": {"name_or_path": verifier, "architectures": []},
            },
        }
        if ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
    if config.norm_before_residual and fmt == "A":
        cfg["norm_before_residual"] = True
    return cfg
