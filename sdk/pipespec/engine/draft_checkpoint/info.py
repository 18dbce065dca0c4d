"""What is known about a draft: the target it is checked against, the checkpoint's header-level facts, and
a loaded draft. Dataclasses only; must not read files or import the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.conventions import AuxConvention
from pipespec.engine.draft_checkpoint.formats import FORMAT_NAMES, DraftFormat
from pipespec.errors import CheckpointError


@dataclass(frozen=True)
class TargetInfo:
    """What the draft is checked against: the target's N, hidden size and vocabulary size."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> TargetInfo:
        """From a transformers config (or its dict); multimodal configs contribute their text config."""
        if isinstance(config, Mapping):
            config = dict(config.get("text_config") or config)
            get = config.get
        else:
            if hasattr(config, "get_text_config"):
                config = config.get_text_config()
            def get(key: str) -> Any:
                return getattr(config, key, None)
        values = {"num_layers": get("num_hidden_layers"), "hidden_size": get("hidden_size"), "vocab_size": get("vocab_size")}
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise CheckpointError(f"the target config lacks {missing}: cannot check a draft against it")
        return cls(**{k: int(v) for k, v in values.items()})


@dataclass(frozen=True)
class DraftCheckpointInfo:
    """Everything about a draft checkpoint that is known without reading its weights."""

    path: Path
    format: DraftFormat
    config: Eagle3DraftConfig
    aux_convention: AuxConvention
    aux_convention_source: str
    config_aux_layers: tuple[int, ...] | None
    aux_layers: tuple[int, ...]
    has_embedding: bool
    shapes: Mapping[str, tuple[int, ...]]
    warnings: tuple[str, ...] = ()

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.format]

    def to_json_dict(self) -> dict[str, Any]:
        """The fields an engine prints in every run (``aux_convention`` and ``aux_layers`` included)."""
        return {
            "draft_format": self.format,
            "aux_convention": self.aux_convention,
            "aux_convention_source": self.aux_convention_source,
            "draft_config_aux_layers": list(self.config_aux_layers) if self.config_aux_layers is not None else None,
            "aux_layers": list(self.aux_layers),
            "draft_vocab_size": self.config.draft_vocab_size,
            "draft_has_embedding": self.has_embedding,
            "warnings": list(self.warnings),
        }


@dataclass
class LoadedDraft:
    """A materialised draft plus how it was read. ``embedding`` is ``"own"`` or ``"shared"``."""

    model: Eagle3Draft
    info: DraftCheckpointInfo
    embedding: str
    bytes_read: int = 0
    warnings: list[str] = field(default_factory=list)

