"""The draft's fused inference weights: q/k/v and gate/up concatenated, transposed output projections,
the draft → target id table; built from the modules and kept while they are unchanged (a mixin).

Imports torch and ``layer`` (for ``RMSNorm``); must not import the model (it inherits from this) or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from pipespec.engine.draft.layer import RMSNorm

if TYPE_CHECKING:
    from pipespec.engine.draft.layer import Eagle3DraftLayer


def linear_add(residual: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + x @ weight_t (+ bias)`` for 2D rows: the residual add rides in the matmul (``addmm``)."""
    out = torch.addmm(residual, x, weight_t)
    return out if bias is None else out + bias


class FusedNorm(NamedTuple):
    weight: torch.Tensor
    eps: float


class Fused(NamedTuple):
    """What the inference path reads, gathered once per call instead of looked up per op.

    q/k/v and gate/up are concatenated (one matmul each instead of three and two), the output
    projections are transposed views for ``addmm``, and ``target_ids`` is ``arange(draft vocab) + d2t``
    (draft id → target id in one gather); the other tensors are the parameters themselves. Built from
    the modules, which stay the trainable, checkpointed tensors; see ``Eagle3Draft._fused``.
    """

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    o_t: torch.Tensor
    o_bias: torch.Tensor | None
    down_t: torch.Tensor
    down_bias: torch.Tensor | None
    target_ids: torch.Tensor
    fc: torch.Tensor
    lm_head: torch.Tensor
    input_norm: FusedNorm
    hidden_norm: FusedNorm
    post_norm: FusedNorm
    final_norm: FusedNorm
    act: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    norm_before_residual: bool



class FusedWeights:
    """``_fused()`` for ``Eagle3Draft``: the fused weights, current with the parameters."""

    midlayer: Eagle3DraftLayer
    fc: nn.Linear
    lm_head: nn.Linear
    norm: RMSNorm
    d2t: torch.Tensor
    _modules: Any
    _buffers: Any

    def _fused_sources(self) -> tuple[torch.Tensor, ...]:
        # Straight from the modules' dicts: nn.Module attribute lookups would cost more than the check itself.
        modules: Any = self._modules
        layer = modules["midlayer"]._modules
        attn, mlp = layer["self_attn"]._modules, layer["mlp"]._modules
        linears = (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"], mlp["gate_proj"], mlp["up_proj"],
                   mlp["down_proj"], modules["fc"], modules["lm_head"])
        norms = (layer["input_layernorm"], layer["hidden_norm"], layer["post_attention_layernorm"], modules["norm"])
        params = [m._parameters for m in linears]
        return (
            *(p["weight"] for p in params), *(p["bias"] for p in params if p.get("bias") is not None),
            *(m._parameters["weight"] for m in norms), self._buffers["d2t"],
        )

    def _build_fused(self) -> Fused:
        layer = self.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        d2t = self.d2t

        def norm(module: RMSNorm) -> FusedNorm:
            return FusedNorm(module.weight, float(module.eps))

        return Fused(
            qkv=torch.cat((q.weight, k.weight, v.weight)),
            qkv_bias=None if q.bias is None else torch.cat((q.bias, k.bias, v.bias)),
            gate_up=torch.cat((gate.weight, up.weight)),
            gate_up_bias=None if gate.bias is None else torch.cat((gate.bias, up.bias)),
            o_t=o.weight.t(), o_bias=o.bias, down_t=down.weight.t(), down_bias=down.bias,
            target_ids=torch.arange(d2t.shape[0], device=d2t.device) + d2t,
            fc=self.fc.weight, lm_head=self.lm_head.weight,
            input_norm=norm(layer.input_layernorm), hidden_norm=norm(layer.hidden_norm),
            post_norm=norm(layer.post_attention_layernorm), final_norm=norm(self.norm), act=layer.act,
            heads=layer.num_heads, kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
            norm_before_residual=layer.norm_before_residual,
        )

    def _fused(self) -> Fused:
        """The fused weights, current with the parameters.

        With gradients enabled they are concatenated afresh on every call (differentiable: training through
        ``forward`` reaches the module parameters). Without, they are kept and reused while every source
        tensor has the same storage and version counter as when they were built: any in-place update
        (optimizer step, ``load_state_dict``, ``copy_``) bumps the version, any ``.to()`` or reassignment
        changes the storage. The kept entry holds its sources' storages, so an address cannot be reused
        by a new tensor while it is compared against; checking costs a few host reads, no device op.
        Parameters created inside ``inference_mode`` track no version: then nothing is kept.
        """
        if torch.is_grad_enabled():
            return self._build_fused()
        sources = self._fused_sources()
        try:
            versions = tuple(s._version for s in sources)
        except RuntimeError:  # inference tensors: in-place updates would go unseen, so build every time
            versions = None
        entry = self.__dict__.get("_fused_entry")
        if versions is not None and entry is not None and entry[2] == versions and all(
            s.data_ptr() == h.data_ptr() for s, h in zip(sources, entry[1], strict=True)
        ):
            return entry[0]
        with torch.inference_mode(False), torch.no_grad():
            fused = self._build_fused()
        if versions is not None:
            self.__dict__["_fused_entry"] = (fused, tuple(s.detach() for s in sources), versions)
        return fused

