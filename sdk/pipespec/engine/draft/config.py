"""``Eagle3DraftConfig``: the shape of an EAGLE3 draft (its one Llama decoder layer and the sizes around it).

Pure data over transformers' ``LlamaConfig``; must not import torch modules of the draft or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import LlamaConfig


@dataclass(frozen=True)
class Eagle3DraftConfig:
    """Shape of an EAGLE3 draft.

    ``layer`` is the decoder layer's Llama config: ``hidden_size`` (H), heads, ``head_dim``,
    ``intermediate_size``, ``rms_norm_eps``, ``hidden_act``, rope settings, and ``vocab_size`` = the
    *target's* vocabulary (the rows of the token embedding the draft reads).
    """

    layer: LlamaConfig
    target_hidden_size: int
    num_aux: int
    draft_vocab_size: int
    norm_before_residual: bool = False

    @property
    def hidden_size(self) -> int:
        return int(self.layer.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.layer.vocab_size)

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.layer, "head_dim", None)
        return int(head_dim) if head_dim else self.hidden_size // int(self.layer.num_attention_heads)

    @classmethod
    def make(
        cls,
        *,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        intermediate_size: int,
        vocab_size: int,
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        num_aux: int = 3,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        hidden_act: str = "silu",
        max_position_embeddings: int = 4096,
        rope_theta: float = 10000.0,
        norm_before_residual: bool = False,
        **layer_kwargs: Any,
    ) -> Eagle3DraftConfig:
        """Build a config from plain numbers (tests, training scripts)."""
        layer = LlamaConfig(
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            head_dim=head_dim or hidden_size // num_attention_heads,
            rms_norm_eps=rms_norm_eps,
            hidden_act=hidden_act,
            max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta,
            num_hidden_layers=1,
            **layer_kwargs,
        )
        return cls(
            layer=layer,
            target_hidden_size=target_hidden_size or hidden_size,
            num_aux=num_aux,
            draft_vocab_size=draft_vocab_size or vocab_size,
            norm_before_residual=norm_before_residual,
        )
