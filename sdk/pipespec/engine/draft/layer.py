"""The draft's decoder layer, the plain way: ``RMSNorm`` and ``Eagle3DraftLayer`` (its modules are the
trainable, checkpointed parameters; ``qkv``/``finish``/``attend`` are what training code runs).

Imports torch, transformers' activations and ``rotary``; must not import the model or the engine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

from pipespec.engine.draft.config import Eagle3DraftConfig
from pipespec.engine.draft.rotary import apply_rotary, rotary_factors


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The casts are skipped (not merely no-ops) for float32 inputs: each is a dispatched op.
        wide = x.dtype == torch.float32
        x32 = x if wide else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x32 if wide else x32.to(x.dtype))


class Eagle3DraftLayer(nn.Module):
    """The draft's one decoder layer: attention over ``cat(input_layernorm(embeds), hidden_norm(h))``."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        layer = config.layer
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads = int(layer.num_attention_heads)
        self.num_kv_heads = int(layer.num_key_value_heads)
        self.head_dim = head_dim
        self.norm_before_residual = config.norm_before_residual
        eps = float(layer.rms_norm_eps)
        bias = bool(getattr(layer, "attention_bias", False))
        mlp_bias = bool(getattr(layer, "mlp_bias", False))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * hidden, self.num_heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * head_dim, bias=bias)
        self.self_attn.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, int(layer.intermediate_size), bias=mlp_bias)
        self.mlp.up_proj = nn.Linear(hidden, int(layer.intermediate_size), bias=mlp_bias)
        self.mlp.down_proj = nn.Linear(int(layer.intermediate_size), hidden, bias=mlp_bias)
        self.act = ACT2FN[layer.hidden_act]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual and rotated q, k, v (``[B, heads, T, d]``) for one block; ``cos``/``sin`` as ``rotary`` gives."""
        return self.rotated_qkv(embeds, hidden, *rotary_factors(cos, sin))

    def rotated_qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` with the rotary factors already prepared by ``rotary_factors`` (shared by q and k)."""
        bsz, steps, _ = hidden.shape
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        attn = self.self_attn
        # Rotated in the projections' own contiguous [B, T, heads, d] layout (roll needs no copy), then transposed.
        q = apply_rotary(attn.q_proj(x).view(bsz, steps, self.num_heads, self.head_dim), cos, signed_sin)
        k = apply_rotary(attn.k_proj(x).view(bsz, steps, self.num_kv_heads, self.head_dim), cos, signed_sin)
        v = attn.v_proj(x).view(bsz, steps, self.num_kv_heads, self.head_dim)
        return residual, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``o_proj`` + residual, then post-attention norm + MLP + residual; ``attn_out`` is ``[B, heads, T, d]``."""
        bsz, _, steps, _ = attn_out.shape
        attn_out = attn_out.transpose(1, 2).reshape(bsz, steps, self.num_heads * self.head_dim)
        hidden = residual + self.self_attn.o_proj(attn_out)
        mlp_in = self.post_attention_layernorm(hidden)
        mlp = self.mlp
        return hidden + mlp.down_proj(self.act(mlp.gate_proj(mlp_in)) * mlp.up_proj(mlp_in))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention with GQA expansion; ``mask`` is boolean, True = may attend."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

