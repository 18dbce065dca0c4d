"""The EAGLE3 draft model that runs on the last pipeline stage, with its own rollback-able KV cache.

API (stable; the engine codes against it)::

    from pipespec.engine.draft import Eagle3Draft, Eagle3DraftConfig, DraftKVCache
    from pipespec.engine.draft_checkpoint import inspect_draft_checkpoint, load_draft_checkpoint, TargetInfo

    # every stage, before loading target weights (reads config.json + tensor headers only):
    info = inspect_draft_checkpoint(draft_dir, TargetInfo.from_config(target_config), aux_convention=None)
    model.set_aux_hidden_state_layers(info.aux_layers)        # input-index ids, sorted, unique
    print(info.aux_convention, info.aux_convention_source, info.aux_layers, info.warnings)

    # last stage only:
    loaded = load_draft_checkpoint(draft_dir, target_info, aux_convention=None, dtype=torch.float32,
                                   device="cpu", target_embed=model.model.embed_tokens)
    draft: Eagle3Draft = loaded.model          # loaded.info is the DraftCheckpointInfo above
    cache = draft.new_cache(batch_size, capacity=max_total_len)

    # after the target's prefill of prompt x_0..x_{n-1} that sampled x_n:
    #   aux      = list of k tensors [B, n, H_t] in id order (mixin.collect + own captures)
    #   next_ids = [x_1, ..., x_n]  ([B, n]; per-row valid counts in num_valid for ragged batches)
    drafts = draft.propose(aux, next_ids, cache, num_tokens=K, num_valid=None)   # [B, K] target ids
    # after a verify step where a_b drafts of row b were accepted (+ one bonus token):
    #   aux      = the target's aux states at the a_b + 1 accepted positions (padded to a common T)
    #   next_ids = [d_1, ..., d_{a_b}, bonus]  (the tokens that follow those positions)
    drafts = draft.propose(aux, next_ids, cache, num_tokens=K, num_valid=accepted + 1)

Semantics (EAGLE3): at target position ``t`` the draft's input pair is (feature ``f_t = fc(cat(aux
states at t))``, token ``x_{t+1}``) and its output predicts ``x_{t+2}``; later draft steps feed back the
draft's own pre-norm output hidden and the token it drafted. The draft cache is position-aligned with
the target: cache slot ``t`` holds the draft's key/value for target position ``t``, and rotary positions
are the slot indices. ``propose`` leaves the cache holding exactly the target-verified positions (it
crops its own speculative entries before returning), so the engine never rolls the draft cache back
itself; ``DraftKVCache.crop`` is public for engines that want a different policy.

Architecture: ``fc`` (k·H_t → H, no bias), ONE Llama-style decoder layer (``midlayer``) whose attention
q/k/v read ``cat(input_layernorm(embeds), hidden_norm(h))`` (2H inputs) and whose residual is ``h``
(or ``hidden_norm(h)`` when ``norm_before_residual``, as speculators allows), post-attention norm + MLP,
final ``norm``, ``lm_head`` over the draft vocabulary, and ``d2t`` offsets (target id = draft id +
``d2t[draft id]``). Token embeddings come from ``embed_tokens``: the draft's own, or the target's module
shared via ``pipespec.embed.maybe_share_target_embed``. Rotary embeddings follow the layer's Llama config
(any ``rope_parameters`` transformers understands, e.g. llama3 scaling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

__all__ = ["DraftKVCache", "Eagle3Draft", "Eagle3DraftConfig", "Eagle3DraftLayer", "RMSNorm"]


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


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale by ``weight`` in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DraftKVCache:
    """Per-row key/value storage of the draft's single attention layer, position-aligned with the target.

    ``lengths[b]`` is how many positions row ``b`` holds; slot ``t`` is target position ``t``. Writes of
    a ragged batch put every row's ``T`` new entries at ``lengths[b] ..`` and advance ``lengths`` by that
    row's valid count only: padded entries lie beyond ``lengths`` and are masked out and overwritten
    later. ``crop`` rolls rows back; nothing is freed.
    """

    def __init__(
        self, batch_size: int, num_kv_heads: int, head_dim: int, *, capacity: int = 256,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        self.batch_size = batch_size
        self.key = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.value = torch.zeros_like(self.key)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Host-side upper bound of max(lengths): sizes writes and attention spans without a device sync.
        self.max_length = 0

    @property
    def capacity(self) -> int:
        return int(self.key.shape[2])

    def reserve(self, extra: int) -> None:
        """Grow storage (doubling) so ``extra`` more positions fit after the longest row."""
        needed = self.max_length + extra
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        pad = new_cap - self.capacity
        self.key = F.pad(self.key, (0, 0, 0, pad))
        self.value = F.pad(self.value, (0, 0, 0, pad))

    def crop(self, lengths: int | Sequence[int] | torch.Tensor) -> None:
        """Keep only the first ``lengths`` positions (an int for every row, or one per row).

        Rolling forward is refused: a row cannot claim positions it never wrote.
        """
        new = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        new = new.expand(self.batch_size) if new.dim() == 0 else new
        if new.shape != self.lengths.shape:
            raise ValueError(f"crop lengths have shape {tuple(new.shape)}, the cache has {self.batch_size} rows")
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"crop to {new.tolist()} is outside the cached lengths {self.lengths.tolist()}")
        self.lengths = new.clone()
        if isinstance(lengths, int):
            self.max_length = lengths

    def write(self, key: torch.Tensor, value: torch.Tensor, num_valid: torch.Tensor | None) -> torch.Tensor:
        """Store ``[B, kvh, T, d]`` new entries; return their slot indices ``[B, T]`` (pre-advance)."""
        steps = key.shape[2]
        self.reserve(steps)
        slots = self.lengths[:, None] + torch.arange(steps, device=key.device)
        index = slots[:, None, :, None].expand_as(key)
        self.key.scatter_(2, index, key.to(self.key.dtype))
        self.value.scatter_(2, index, value.to(self.value.dtype))
        self.lengths = self.lengths + (steps if num_valid is None else num_valid.to(self.lengths.device))
        self.max_length += steps
        return slots


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
        """Residual and rotated q, k, v (``[B, heads, T, d]``) for one block of inputs."""
        bsz, steps, _ = hidden.shape
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        attn = self.self_attn
        q = attn.q_proj(x).view(bsz, steps, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        return residual, q, k, v

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Eagle3Draft(nn.Module):
    """EAGLE3 draft head. Parameter names match Format A (``midlayer.*``); see ``draft_checkpoint``."""

    def __init__(self, config: Eagle3DraftConfig, with_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3DraftLayer(config)
        self.norm = RMSNorm(hidden, float(config.layer.rms_norm_eps))
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # None until the checkpoint provides one or the target's module is shared in (embed.py).
        self.register_module("embed_tokens", nn.Embedding(config.vocab_size, hidden) if with_embedding else None)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Not a registered buffer owner: ``.to(torch.bfloat16)`` would round ``inv_freq`` (transformers
        # computes rotary angles in float32 from it); rotary() moves it to the input's device instead.
        self.reset_rotary()

    def reset_rotary(self) -> None:
        """(Re)build the rotary tables on the CPU in float32 (after construction on the meta device)."""
        with torch.device("cpu"):
            self.__dict__["_rotary"] = LlamaRotaryEmbedding(self.config.layer)

    # ------------------------------------------------------------------------------ pieces
    def combine_aux(self, aux: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc(cat(aux states))``: k tensors ``[B, T, H_t]`` in id order → ``[B, T, H]``."""
        x = aux if isinstance(aux, torch.Tensor) else torch.cat(list(aux), dim=-1)
        if x.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"the draft's fc takes {self.fc.in_features} features ({self.config.num_aux} aux states x "
                f"{self.config.target_hidden_size}) but got {x.shape[-1]}"
            )
        return self.fc(x.to(self.fc.weight.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens
        if embed is None:
            raise RuntimeError(
                "the draft has no embed_tokens: load one from the checkpoint or share the target's input "
                "embedding with pipespec.embed.maybe_share_target_embed(draft, target_embed)"
            )
        return embed(input_ids).to(self.fc.weight.dtype)

    def rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, d]`` for integer ``positions [B, T]``, via transformers' Llama rotary."""
        rotary: LlamaRotaryEmbedding = self.__dict__["_rotary"]
        if rotary.inv_freq.device != like.device:
            rotary.to(like.device)
        return rotary(like, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm hidden states."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: ``id + d2t[id]``."""
        return draft_ids + self.d2t[draft_ids]

    def greedy_target_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.to_target_ids(self.logits(hidden).argmax(dim=-1))

    def new_cache(self, batch_size: int, capacity: int = 256) -> DraftKVCache:
        weight = self.fc.weight
        layer = self.midlayer
        return DraftKVCache(
            batch_size, layer.num_kv_heads, layer.head_dim, capacity=capacity, dtype=weight.dtype, device=weight.device
        )

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        cache: DraftKVCache | None = None,
        num_valid: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass of the draft layer over ``T`` input pairs; returns the pre-norm output ``[B, T, H]``.

        ``hidden_states`` are fc features (first pass over verified positions) or the draft's own earlier
        outputs. With a ``cache`` the positions are ``cache.lengths[b] + i`` and the new keys/values are
        appended (``num_valid[b]`` of them count for row ``b``); without one the block is causal on its
        own with ``position_ids`` (default ``0..T-1``).
        """
        embeds = self.embed(input_ids)
        hidden = hidden_states.to(self.fc.weight.dtype)
        bsz, steps, _ = hidden.shape
        device = hidden.device
        if cache is None:
            positions = position_ids if position_ids is not None else torch.arange(steps, device=device).expand(bsz, steps)
        else:
            positions = cache.lengths[:, None] + torch.arange(steps, device=device)
        cos, sin = self.rotary(hidden, positions)
        layer = self.midlayer
        residual, q, k, v = layer.qkv(embeds, hidden, cos, sin)
        if cache is None:
            key_pos = positions
            keys, values = k, v
        else:
            cache.write(k, v, num_valid)
            span = cache.max_length
            keys, values = cache.key[:, :, :span], cache.value[:, :, :span]
            key_pos = torch.arange(span, device=device).expand(bsz, span)
        # Causal by position: each query sees every stored position up to its own.
        mask = (key_pos[:, None, :] <= positions[:, :, None])[:, None]
        return layer.finish(residual, layer.attend(q, keys, values, mask))

    @torch.no_grad()
    def propose(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_tokens: int,
        num_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Extend the cache with target-verified positions, then draft ``num_tokens`` target ids per row.

        ``aux``: the target's aux states at the new verified positions (k tensors ``[B, T, H_t]`` in id
        order, or their concatenation); ``next_ids [B, T]``: the token following each of those positions;
        ``num_valid [B]``: how many of the ``T`` are real per row (default all; at least 1 each). Returns
        ``[B, num_tokens]`` target ids; the cache afterwards holds only verified positions.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        out = self(next_ids, self.combine_aux(aux), cache, num_valid=num_valid)
        bsz, steps, hidden_size = out.shape
        if num_valid is None:
            last = out[:, -1:]
        else:
            index = (num_valid.to(out.device) - 1).clamp(min=0).view(bsz, 1, 1).expand(bsz, 1, hidden_size)
            last = out.gather(1, index)
        verified = cache.lengths.clone()
        verified_max = cache.max_length
        token = self.greedy_target_ids(last)
        drafts = [token]
        for _ in range(num_tokens - 1):
            last = self(token, last, cache)
            token = self.greedy_target_ids(last)
            drafts.append(token)
        cache.crop(verified)
        cache.max_length = verified_max
        return torch.cat(drafts, dim=1)
