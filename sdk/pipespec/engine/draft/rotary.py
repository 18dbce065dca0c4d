"""Rotary embeddings of the draft: the sign-folded factors, and the model's rotary tables (a mixin).

``DraftRotary`` gives ``Eagle3Draft`` transformers' ``LlamaRotaryEmbedding`` bit for bit, with the fixed
frequencies used directly and a per-position table of both factors for the fused path. Imports torch and
transformers' Llama rotary only; must not import the draft's other modules or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

if TYPE_CHECKING:
    from pipespec.engine.draft.config import Eagle3DraftConfig


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, d]`` cos/sin → cos and the sign-folded sin ``apply_rotary`` takes, ``[B, T, 1, d]`` each.

    Llama's ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = cat(-x₂, x₁)`` equals
    ``x·cos + roll(x, d/2)·cat(-sin₁, sin₂)`` exactly (a sign moves between the factors of a product):
    one roll per tensor instead of two slices, a negation and a concatenation, and the sign work is
    done once for q and k together.
    """
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2), signed.unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, heads, d]`` by the factors of ``rotary_factors``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin



class DraftRotary:
    """The rotary tables of an ``Eagle3Draft`` (kept out of its registered buffers; see ``reset_rotary``)."""

    config: Eagle3DraftConfig

    def reset_rotary(self) -> None:
        """(Re)build the rotary tables on the CPU in float32 (after construction on the meta device)."""
        with torch.device("cpu"):
            rotary = LlamaRotaryEmbedding(self.config.layer)
        self.__dict__["_rotary"] = rotary
        # Dynamic/longrope variants update their frequencies from the positions (a host read for "dynamic"):
        # those keep going through the module; every other type uses the fixed frequencies directly.
        rope_type = str(rotary.rope_type)
        self.__dict__["_rope_fixed"] = "dynamic" not in rope_type and rope_type != "longrope"
        self.__dict__["_rope_tab"] = None

    def _rotary_module(self, device: torch.device) -> LlamaRotaryEmbedding:
        rotary: LlamaRotaryEmbedding = self.__dict__["_rotary"]
        if rotary.inv_freq.device != device:
            rotary.to(device)
        return rotary

    def _fixed_cos_sin(
        self, rotary: LlamaRotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed-frequency cos/sin ``[..., d]`` of integer ``positions [...]``, as transformers computes them."""
        freqs = positions.unsqueeze(-1).float() * rotary.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        scaling = rotary.attention_scaling
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, d]`` for integer ``positions [B, T]``: transformers' Llama rotary, bit for bit.

        The frequencies move to ``like``'s device once (on first use there); for fixed-frequency rope types
        the cos/sin come straight from them, without the module call's no-op casts.
        """
        rotary = self._rotary_module(like.device)
        if not self.__dict__["_rope_fixed"]:
            return rotary(like, positions)
        return self._fixed_cos_sin(rotary, positions, like.dtype)

    def _rope_factors(
        self, like: torch.Tensor, positions: torch.Tensor, size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[N, 1, d]`` (as ``rotary_factors`` gives) for the rows of ``positions``.

        Fixed-frequency rope types with a host bound ``size`` on the positions gather both factors with one
        op from a table of positions ``0 .. size-1`` (computed once per device and dtype, as ``rotary`` does,
        grown by doubling); other types, or positions without a bound, compute them per call.
        """
        table = self._rope_table(like, size) if size is not None and self.__dict__["_rope_fixed"] else None
        if table is None:
            grid = positions if positions.dim() == 2 else positions.unsqueeze(1)
            cos, signed = rotary_factors(*self.rotary(like, grid))
            head_dim = cos.shape[-1]
            return cos.reshape(-1, 1, head_dim), signed.reshape(-1, 1, head_dim)
        flat = positions if positions.dim() == 1 else positions.reshape(-1)
        cos, signed = table.index_select(0, flat).unbind(1)
        return cos, signed

    def _rope_table(self, like: torch.Tensor, size: int) -> torch.Tensor:
        """``[P, 2, 1, d]``: (cos, sign-folded sin) of positions ``0 .. P-1`` with ``P >= size``."""
        table: torch.Tensor | None = self.__dict__["_rope_tab"]
        same = table is not None and table.device == like.device and table.dtype == like.dtype
        if table is not None and same and table.shape[0] >= size:
            return table
        if table is not None and same:
            size = max(size, 2 * table.shape[0])
        rotary = self._rotary_module(like.device)
        # Plain tensors even when first built inside inference_mode: training forwards read the table too.
        with torch.inference_mode(False), torch.no_grad():
            cos, sin = self._fixed_cos_sin(rotary, torch.arange(size, device=like.device), like.dtype)
            half = sin.shape[-1] // 2
            signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            table = torch.stack((cos, signed), dim=1).unsqueeze(2)
        self.__dict__["_rope_tab"] = table
        return table

