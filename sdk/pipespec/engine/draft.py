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
    drafts = draft.propose(aux, next_ids, cache, num_tokens=K, num_valid=[a_b + 1 for each row])
    # a round without speculation: keep the draft's cache in step with the target, draft nothing
    #   (num_valid entries may be 0 here: such a row is left as it was)
    draft.extend(aux, next_ids, cache, num_valid=counts)

    # batches of sequences (one cache row each) are regrouped between rounds:
    merged = DraftKVCache.concat([cache_a, cache_b, cache_c])   # rows stacked in order, capacities padded
    kept = merged.select([0, 2])                                # a copy holding those rows, in that order
    cache.crop(lengths)                                         # validated rollback (see crop)

    # fixed storage for CUDA graphs (pipespec.engine.draft_graph): an *adopted* cache lives in it
    storage = DraftStorage(max_rows, num_kv_heads, head_dim, capacity=C, dtype=dtype, device=device)
    cache = storage.adopt(cache)                 # rows copied in; select/concat keep it adopted, in place

``num_valid`` is best passed as host integers (a list, or a CPU tensor): they are validated, copied to
the device once (pinned, non-blocking on CUDA), and let the cache keep exact host-side lengths, so
attention spans never drift past the longest row. A device tensor is used as is, unvalidated. Neither
``propose`` nor ``extend`` ever reads a device value back to the host (no ``.item()``, ``.tolist()``,
``bool(tensor)``): the engine's own ``drafts.tolist()`` is the one synchronisation a round needs.

Semantics (EAGLE3): at target position ``t`` the draft's input pair is (feature ``f_t = fc(cat(aux
states at t))``, token ``x_{t+1}``) and its output predicts ``x_{t+2}``; later draft steps feed back the
draft's own pre-norm output hidden and the token it drafted. The draft cache is position-aligned with
the target: cache slot ``t`` holds the draft's key/value for target position ``t``, and rotary positions
are the slot indices. ``propose`` leaves the cache holding exactly the target-verified positions (it
drops its own speculative entries before returning), so the engine never rolls the draft cache back
itself; ``DraftKVCache.crop`` is public for engines that want a different policy.

Architecture: ``fc`` (k·H_t → H, no bias), ONE Llama-style decoder layer (``midlayer``) whose attention
q/k/v read ``cat(input_layernorm(embeds), hidden_norm(h))`` (2H inputs) and whose residual is ``h``
(or ``hidden_norm(h)`` when ``norm_before_residual``, as speculators allows), post-attention norm + MLP,
final ``norm``, ``lm_head`` over the draft vocabulary, and ``d2t`` offsets (target id = draft id +
``d2t[draft id]``). Token embeddings come from ``embed_tokens``: the draft's own, or the target's module
shared via ``pipespec.contract.embed.maybe_share_target_embed``. Rotary embeddings follow the layer's Llama config
(any ``rope_parameters`` transformers understands, e.g. llama3 scaling), computed exactly as transformers'
``LlamaRotaryEmbedding`` does.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

__all__ = ["DraftKVCache", "DraftStorage", "Eagle3Draft", "Eagle3DraftConfig", "Eagle3DraftLayer", "RMSNorm"]


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
        # The casts are skipped (not merely no-ops) for float32 inputs: each is a dispatched op.
        wide = x.dtype == torch.float32
        x32 = x if wide else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x32 if wide else x32.to(x.dtype))


def _long_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers as an int64 tensor on ``device``; to CUDA via pinned memory without a stream sync."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class _Counts(NamedTuple):
    """A parsed ``num_valid``.

    ``device``: the per-row counts on the cache's device, or None when every row counts all ``T`` new
    positions (known on the host: nothing to copy, the lengths advance by ``T``). ``host``: the same counts
    as host integers when known. ``last``: when asked for and the counts are ragged host integers, the
    flat index ``b·T + n_b − 1`` of each row's last valid position (copied to the device with the counts).
    """

    device: torch.Tensor | None
    host: list[int] | None
    last: torch.Tensor | None


def _valid_counts(
    num_valid: torch.Tensor | Sequence[int] | None, batch: int, steps: int, device: torch.device, *, minimum: int,
    want_last: bool = False,
) -> _Counts | None:
    """Parse ``num_valid``; host values are checked against ``[minimum, steps]``, a device tensor is used as is."""
    if num_valid is None:
        return None
    if isinstance(num_valid, torch.Tensor) and num_valid.device.type != "cpu":
        if tuple(num_valid.shape) != (batch,):
            raise ValueError(f"num_valid has shape {tuple(num_valid.shape)}, expected ({batch},): one count per row")
        counts = num_valid if num_valid.dtype == torch.long else num_valid.long()
        return _Counts(counts if counts.device == device else counts.to(device), None, None)
    if isinstance(num_valid, torch.Tensor):
        if num_valid.dim() != 1:
            raise ValueError(f"num_valid has shape {tuple(num_valid.shape)}, expected ({batch},): one count per row")
        host = [int(n) for n in num_valid.tolist()]  # host memory: no device synchronisation
    else:
        host = [operator.index(n) for n in num_valid]
    if len(host) != batch:
        raise ValueError(f"num_valid has {len(host)} entries, expected {batch}: one count per row")
    if any(not minimum <= n <= steps for n in host):
        raise ValueError(f"num_valid {host} must lie in [{minimum}, {steps}] for every row ({steps} new positions)")
    if all(n == steps for n in host):
        return _Counts(None, host, None)
    if not want_last:
        return _Counts(_long_on(host, device), host, None)
    both = _long_on(host + [b * steps + n - 1 for b, n in enumerate(host)], device)
    return _Counts(both[:batch], host, both[batch:])


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[start, stop)`` covering ``rows`` in order (so selection needs no index tensor)."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


class DraftStorage:
    """Fixed storage for up to ``max_rows`` cache rows that *adopted* caches live in (for CUDA graphs).

    An adopted ``DraftKVCache`` holds views of the storage's first ``B`` rows (keys, values, lengths), so
    the addresses a captured graph reads and writes never change. Whatever would give an adopted cache
    new tensors works in place instead: its lengths advance and crop in place, ``select`` and ``concat``
    (with an adopted cache first) write their rows into the same storage, packed to the front, and return
    a new adopted cache, and ``reserve`` never grows it (past ``capacity`` it is an error). Each of those
    writes makes the storage's earlier adopted caches stale (their views now show other rows): using one
    again raises instead of reading them. Only one adopted cache of a storage is current at a time.

    Slots past a row's length may hold another row's old entries; they are never read (attention is
    bounded or masked by position), as with the padded writes of ragged batches.
    """

    def __init__(
        self, max_rows: int, num_kv_heads: int, head_dim: int, *, capacity: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        if max_rows < 1 or capacity < 1:
            raise ValueError(f"draft storage needs max_rows >= 1 and capacity >= 1, got {max_rows} and {capacity}")
        # Plain tensors even when made inside inference_mode: adopted caches may be written outside it too.
        with torch.inference_mode(False):
            self.key = torch.zeros(max_rows, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
            self.value = torch.zeros_like(self.key)
            self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.generation = 0  # bumped by every write of rows: adopted caches of older generations are stale

    @property
    def max_rows(self) -> int:
        return int(self.key.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.key.shape[2])

    def adopt(self, cache: DraftKVCache) -> DraftKVCache:
        """A cache in this storage with ``cache``'s rows, lengths and host lengths (copied in); ``cache``
        itself when it already lives here. Its earlier adopted caches become stale."""
        if cache._static is self:
            self.check(cache)
            return cache
        return self._fill(0, [cache], cache.max_length, cache._host)

    def check(self, cache: DraftKVCache) -> None:
        """Refuse a stale adopted cache (one whose rows a later adopt/select/concat rewrote)."""
        if cache._generation != self.generation:
            raise RuntimeError(
                "this draft cache is stale: its rows lived in static storage that a later adopt/select/concat "
                "rewrote; use the cache that call returned"
            )

    def _fill(
        self, start: int, parts: Sequence[DraftKVCache], max_length: int, host: list[int] | None,
    ) -> DraftKVCache:
        """Copy ``parts``' rows in after the first ``start`` rows (kept as they are); the adopted cache of all."""
        rows = start + sum(part.batch_size for part in parts)
        capacity = self.capacity
        if rows > self.max_rows:
            raise ValueError(
                f"{rows} draft cache rows do not fit static storage of {self.max_rows} rows (max_rows); "
                "make the storage (DraftGraphRunner max_rows) as large as the biggest batch"
            )
        mine = (self.key.shape[1], self.key.shape[3], self.key.dtype, self.key.device)
        for part in parts:
            theirs = (part.num_kv_heads, part.head_dim, part.dtype, part.device)
            if theirs != mine:
                raise ValueError(
                    f"cannot place a draft cache with {theirs[0]} kv heads, head_dim {theirs[1]}, {theirs[2]} on "
                    f"{theirs[3]} in static storage with {mine[0]} kv heads, head_dim {mine[1]}, {mine[2]} on {mine[3]}"
                )
            if part.max_length > capacity:
                raise ValueError(
                    f"a draft cache holding up to {part.max_length} positions does not fit static storage of "
                    f"capacity {capacity}; size the capacity for the longest sequence plus the draft's lookahead"
                )
            if part._static is self:  # the current cache: rows [0, start), disjoint from where we write
                self.check(part)
        offset = start
        for part in parts:
            count, width = part.batch_size, min(part.capacity, capacity)
            if count:
                self.key[offset : offset + count, :, :width].copy_(part.key[:, :, :width])
                self.value[offset : offset + count, :, :width].copy_(part.value[:, :, :width])
                self.lengths[offset : offset + count].copy_(part._lengths)
            offset += count
        self.generation += 1
        with torch.inference_mode(False):  # plain views: in-place writes must work inside and outside it
            key, value, lengths = self.key[:rows], self.value[:rows], self.lengths[:rows]
        return DraftKVCache._of(key, value, lengths, max_length, None if host is None else list(host), static=self)


class DraftKVCache:
    """Per-row key/value storage of the draft's single attention layer, position-aligned with the target.

    ``lengths[b]`` (a device tensor) is how many positions row ``b`` holds; slot ``t`` is target position
    ``t``. Writes of a ragged batch put every row's ``T`` new entries at ``lengths[b] ..`` and advance
    ``lengths`` by that row's valid count only: padded entries lie beyond ``lengths`` and are masked out
    and overwritten later. ``crop`` rolls rows back; nothing is freed.

    ``max_length`` is a host-side upper bound of ``max(lengths)``: it sizes writes and attention spans
    without a device sync. While every update came with host-known counts (``num_valid`` as integers, int
    or list crops) the cache also keeps ``host_lengths``, and ``max_length`` is then exact.

    A cache may be *adopted* into a ``DraftStorage`` (``storage`` is then that storage): it then works in
    place in fixed tensors; see ``DraftStorage``.
    """

    def __init__(
        self, batch_size: int, num_kv_heads: int, head_dim: int, *, capacity: int = 256,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        if batch_size < 0 or capacity < 0:
            raise ValueError(f"a draft cache needs batch_size >= 0 and capacity >= 0, got {batch_size} and {capacity}")
        key = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._set(key, torch.zeros_like(key), lengths, 0, [0] * batch_size)

    def _set(
        self, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, max_length: int, host: list[int] | None,
        static: DraftStorage | None = None,
    ) -> None:
        self.key, self.value = key, value
        self._static = static  # the storage this cache is adopted into (its tensors are views of it), or None
        self._generation = 0 if static is None else static.generation
        self._lengths = lengths
        self._host = host
        self.max_length = max_length
        self._slot_ids: torch.Tensor | None = None  # arange over slots on the cache's device, grown lazily
        self._row_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # arange(B) as [B] and [B, 1], kept

    @classmethod
    def _of(
        cls, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, max_length: int, host: list[int] | None,
        static: DraftStorage | None = None,
    ) -> DraftKVCache:
        cache = cls.__new__(cls)
        cache._set(key, value, lengths, max_length, host, static)
        return cache

    # ------------------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        return int(self.key.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[1])

    @property
    def capacity(self) -> int:
        return int(self.key.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.key.shape[3])

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def device(self) -> torch.device:
        return self.key.device

    @property
    def storage(self) -> DraftStorage | None:
        """The ``DraftStorage`` this cache is adopted into, or None."""
        return self._static

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        # Set from outside: the host copy can no longer be trusted (max_length must stay an upper bound).
        if self._static is not None:
            self._static.check(self)
            self._lengths.copy_(value)
        else:
            self._lengths = value
        self._host = None

    @property
    def host_lengths(self) -> tuple[int, ...] | None:
        """Every row's length as host integers, when all updates were host-known; else None."""
        return None if self._host is None else tuple(self._host)

    # ------------------------------------------------------------------------------ rows
    def select(self, rows: Sequence[int]) -> DraftKVCache:
        """A new cache holding copies of ``rows`` (in that order); same capacity, dtype and device.

        On an adopted cache the rows are written back into its storage (packed to the front) and the
        result is adopted there too; this cache is stale afterwards.
        """
        if self._static is not None:
            self._static.check(self)
        size = self.batch_size
        picked = [operator.index(r) for r in rows]
        bad = [r for r in picked if not 0 <= r < size]
        if bad:
            raise ValueError(f"select rows {bad} are outside the cache's {size} rows")
        runs = _runs(picked)

        def take(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[a:b] for a, b in runs]) if runs else t[:0].clone()

        host = None if self._host is None else [self._host[r] for r in picked]
        max_length = self.max_length if host is None else max(host, default=0)
        picked_rows = DraftKVCache._of(take(self.key), take(self.value), take(self._lengths), max_length, host)
        if self._static is None:
            return picked_rows
        return self._static._fill(0, [picked_rows], max_length, host)

    @classmethod
    def concat(cls, caches: Sequence[DraftKVCache]) -> DraftKVCache:
        """One cache holding the rows of ``caches`` in order; smaller capacities are padded to the largest.

        When the first cache is adopted, the others' rows are written into its storage after its own (which
        stay in place) and the result is adopted there, with the storage's capacity; the first is stale
        afterwards.
        """
        parts = list(caches)
        if not parts:
            raise ValueError("DraftKVCache.concat needs at least one cache")
        first = parts[0]
        for i, part in enumerate(parts[1:], start=1):
            mine = (part.num_kv_heads, part.head_dim, part.dtype, part.device)
            theirs = (first.num_kv_heads, first.head_dim, first.dtype, first.device)
            if mine != theirs:
                raise ValueError(
                    f"cannot concat draft caches: cache {i} has {mine[0]} kv heads, head_dim {mine[1]}, {mine[2]} on "
                    f"{mine[3]}; cache 0 has {theirs[0]} kv heads, head_dim {theirs[1]}, {theirs[2]} on {theirs[3]}"
                )
        host: list[int] | None = []
        for part in parts:
            host = None if host is None or part._host is None else host + part._host
        static = first._static
        if static is not None:
            static.check(first)
            return static._fill(first.batch_size, parts[1:], max(part.max_length for part in parts), host)
        capacity = max(part.capacity for part in parts)

        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            padded = [t if t.shape[2] == capacity else F.pad(t, (0, 0, 0, capacity - t.shape[2])) for t in tensors]
            return torch.cat(padded)

        return cls._of(
            stack([p.key for p in parts]), stack([p.value for p in parts]), torch.cat([p._lengths for p in parts]),
            max(part.max_length for part in parts), host,
        )

    # ------------------------------------------------------------------------------ storage
    def reserve(self, extra: int) -> None:
        """Grow storage (doubling) so ``extra`` more positions fit after the longest row.

        An adopted cache never grows: past its storage's capacity this raises.
        """
        needed = self.max_length + extra
        if self._static is not None:
            self._static.check(self)
            if needed > self.capacity:
                raise ValueError(
                    f"the draft cache is adopted into static storage of capacity {self.capacity}, which does not "
                    f"grow: {extra} more positions after the longest row ({self.max_length}) need {needed}; size "
                    "the capacity for the longest sequence plus the widest update plus the draft's lookahead"
                )
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        pad = new_cap - self.capacity
        self.key = F.pad(self.key, (0, 0, 0, pad))
        self.value = F.pad(self.value, (0, 0, 0, pad))

    def slot_ids(self, count: int) -> torch.Tensor:
        """``arange(count)`` on the cache's device, sliced from a kept range (no kernel per call)."""
        ids = self._slot_ids
        if ids is None or ids.shape[0] < count:
            ids = torch.arange(max(count, self.capacity), device=self.key.device)
            self._slot_ids = ids
        return ids[:count]

    def crop(self, lengths: int | Sequence[int] | torch.Tensor) -> None:
        """Keep only the first ``lengths`` positions (an int for every row, or one per row).

        Rolling forward is refused: a row cannot claim positions it never wrote. Validation reads lengths on
        the host: free for ints and lists while ``host_lengths`` is known, a device sync otherwise.
        """
        size = self.batch_size
        if isinstance(lengths, torch.Tensor):
            if lengths.dim() > 1 or (lengths.dim() == 1 and lengths.shape[0] != size):
                raise ValueError(f"crop lengths have shape {tuple(lengths.shape)}, the cache has {size} rows")
            values = [int(lengths)] * size if lengths.dim() == 0 else [int(n) for n in lengths.tolist()]
        elif isinstance(lengths, int):
            values = [lengths] * size
        else:
            values = [operator.index(n) for n in lengths]
            if len(values) != size:
                raise ValueError(f"crop lengths have shape ({len(values)},), the cache has {size} rows")
        if self._static is not None:
            self._static.check(self)
        current = self._host if self._host is not None else [int(n) for n in self._lengths.tolist()]
        if any(not 0 <= new <= old for new, old in zip(values, current, strict=True)):
            raise ValueError(f"crop to {values} is outside the cached lengths {current}")
        if self._static is not None:  # in place: the storage's addresses stay
            if isinstance(lengths, int):
                self._lengths.fill_(lengths)
            else:
                self._lengths.copy_(_long_on(values, self._lengths.device))
        elif isinstance(lengths, int):
            self._lengths = torch.full_like(self._lengths, lengths)
        else:
            self._lengths = _long_on(values, self._lengths.device)
        self._host = values
        self.max_length = max(values, default=0)

    def write(
        self, key: torch.Tensor, value: torch.Tensor, num_valid: torch.Tensor | Sequence[int] | None,
    ) -> torch.Tensor:
        """Store ``[B, kvh, T, d]`` new entries; return their slot indices ``[B, T]`` (pre-advance)."""
        steps = key.shape[2]
        counts = _valid_counts(num_valid, self.batch_size, steps, self.device, minimum=0)
        self.reserve(steps)
        slots = self._lengths[:, None] + self.slot_ids(steps)
        self._put(key.transpose(1, 2), value.transpose(1, 2), slots)
        self._advance(steps, counts)
        return slots

    def _rows(self, flat: bool) -> torch.Tensor:
        """``arange(B)`` on the cache's device: ``[B]`` (``flat``) or ``[B, 1]``; made once per cache."""
        rows = self._row_ids
        if rows is None:
            ids = torch.arange(self.batch_size, device=self.key.device)
            rows = self._row_ids = (ids, ids.unsqueeze(1))
        return rows[0] if flat else rows[1]

    def _put(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[B, T, kvh, d]`` at ``slots [B, T]``, or ``[B, kvh, d]`` at ``slots [B]``.

        One ``index_put_`` per tensor: the entries go in their projection layout (no transpose, no index
        expansion). Slots must fit the capacity (``reserve``); lengths are not advanced (``_advance``).
        """
        index = [self._rows(slots.dim() == 1), None, slots]
        dtype = self.key.dtype
        torch.ops.aten.index_put_(self.key, index, key if key.dtype == dtype else key.to(dtype))
        torch.ops.aten.index_put_(self.value, index, value if value.dtype == dtype else value.to(dtype))

    def _advance(self, steps: int, counts: _Counts | None) -> None:
        """Count ``steps`` newly written positions for every row, or ``counts`` of them where given."""
        added: torch.Tensor | int = steps if counts is None or counts.device is None else counts.device
        if self._static is not None:  # in place: the storage's addresses stay
            self._lengths.add_(added)
        else:
            self._lengths = self._lengths + added
        self._count(steps, None if counts is None else counts.host, every=isinstance(added, int))

    def _count(self, steps: int, host_counts: Sequence[int] | None, *, every: bool) -> None:
        """The host side of an advance (device lengths untouched): every row by ``steps`` (``every``), or
        by ``host_counts`` when known (else the host lengths are lost and ``max_length`` grows by ``steps``)."""
        if every:
            self._host = None if self._host is None else [n + steps for n in self._host]
            self.max_length += steps
        elif self._host is not None and host_counts is not None:
            self._host = [n + c for n, c in zip(self._host, host_counts, strict=True)]
            self.max_length = max(self._host, default=0)
        else:
            self._host = None
            self.max_length += steps


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
        q = _apply_rotary(attn.q_proj(x).view(bsz, steps, self.num_heads, self.head_dim), cos, signed_sin)
        k = _apply_rotary(attn.k_proj(x).view(bsz, steps, self.num_kv_heads, self.head_dim), cos, signed_sin)
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


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T, d]`` cos/sin → cos and the sign-folded sin ``_apply_rotary`` takes, ``[B, T, 1, d]`` each.

    Llama's ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = cat(-x₂, x₁)`` equals
    ``x·cos + roll(x, d/2)·cat(-sin₁, sin₂)`` exactly (a sign moves between the factors of a product):
    one roll per tensor instead of two slices, a negation and a concatenation, and the sign work is
    done once for q and k together.
    """
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2), signed.unsqueeze(2)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, heads, d]`` by the factors of ``rotary_factors``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _linear_add(residual: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + x @ weight_t (+ bias)`` for 2D rows: the residual add rides in the matmul (``addmm``)."""
    out = torch.addmm(residual, x, weight_t)
    return out if bias is None else out + bias


class _Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


class _Fused(NamedTuple):
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
    input_norm: _Norm
    hidden_norm: _Norm
    post_norm: _Norm
    final_norm: _Norm
    act: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    norm_before_residual: bool


class Eagle3Draft(nn.Module):
    """EAGLE3 draft head. Parameter names match Format A (``midlayer.*``); see ``draft_checkpoint``.

    ``forward``, ``extend`` and ``propose`` run one fused implementation of the layer over 2D rows
    (``B·T`` of them): one q/k/v matmul, one gate/up matmul, residual adds inside ``addmm``, one
    ``rms_norm`` op per norm, rotary factors gathered from a per-position table, cache writes with one
    ``index_put_`` each, and grouped-query attention with the query heads of a key/value head as extra
    query rows (no expanded key/value copies). The per-module helpers (``Eagle3DraftLayer.qkv``,
    ``finish``, ``attend``, ``rotary``, ``logits``) compute the same layer the plain way; training code
    (``bench/train_demo.py``) uses them.
    """

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
            rotary = LlamaRotaryEmbedding(self.config.layer)
        self.__dict__["_rotary"] = rotary
        # Dynamic/longrope variants update their frequencies from the positions (a host read for "dynamic"):
        # those keep going through the module; every other type uses the fixed frequencies directly.
        rope_type = str(rotary.rope_type)
        self.__dict__["_rope_fixed"] = "dynamic" not in rope_type and rope_type != "longrope"
        self.__dict__["_rope_tab"] = None

    # ------------------------------------------------------------------------------ pieces
    def _aux_features(self, aux: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        x = aux if isinstance(aux, torch.Tensor) else torch.cat(list(aux), dim=-1)
        if x.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"the draft's fc takes {self.fc.in_features} features ({self.config.num_aux} aux states x "
                f"{self.config.target_hidden_size}) but got {x.shape[-1]}"
            )
        dtype = self.fc.weight.dtype
        return x if x.dtype == dtype else x.to(dtype)

    def combine_aux(self, aux: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc(cat(aux states))``: k tensors ``[B, T, H_t]`` in id order → ``[B, T, H]``."""
        return self.fc(self._aux_features(aux))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed_rows(input_ids, self.fc.weight.dtype)

    def _embed_rows(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        embed = self._modules.get("embed_tokens")
        if embed is None:
            raise RuntimeError(
                "the draft has no embed_tokens: load one from the checkpoint or share the target's input "
                "embedding with pipespec.contract.embed.maybe_share_target_embed(draft, target_embed)"
            )
        out = embed(input_ids)
        return out if out.dtype == dtype else out.to(dtype)

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

    # ----------------------------------------------------------------------------- fused weights
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

    def _build_fused(self) -> _Fused:
        layer = self.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        d2t = self.d2t

        def norm(module: RMSNorm) -> _Norm:
            return _Norm(module.weight, float(module.eps))

        return _Fused(
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

    def _fused(self) -> _Fused:
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

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        cache: DraftKVCache | None = None,
        num_valid: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass of the draft layer over ``T`` input pairs; returns the pre-norm output ``[B, T, H]``.

        ``hidden_states`` are fc features (first pass over verified positions) or the draft's own earlier
        outputs. With a ``cache`` the positions are ``cache.lengths[b] + i`` and the new keys/values are
        appended (``num_valid[b]`` of them count for row ``b``); without one the block is causal on its
        own with ``position_ids`` (default ``0..T-1``).
        """
        bsz, steps = input_ids.shape
        counts = None
        if cache is not None:
            counts = _valid_counts(num_valid, cache.batch_size, steps, cache.device, minimum=0)
        dtype = self.fc.weight.dtype
        hidden = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)
        out = self._pass(self._fused(), input_ids, hidden.reshape(bsz * steps, -1), cache, counts, position_ids)
        return out.view(bsz, steps, -1)

    def _pass(
        self,
        f: _Fused,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cache: DraftKVCache | None,
        counts: _Counts | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` on 2D rows: ``input_ids [B, T]``, ``hidden [B·T, H]`` → ``[B·T, H]``; advances ``cache``."""
        bsz, steps = input_ids.shape
        ids = input_ids.reshape(-1)
        if cache is None:
            size: int | None = steps
            if position_ids is None:
                positions = torch.arange(steps, device=hidden.device).expand(bsz, steps)
            else:
                positions, size = position_ids.expand(bsz, steps), None
            if steps == 1:
                positions = positions.reshape(bsz)
            return self._layer(f, ids, hidden, bsz, steps, positions, None, steps, steps > 1, size)
        cache.reserve(steps)
        host = cache._host
        # One key span serves every row unmasked only when all rows are known to hold the same length.
        masked = steps > 1 or host is None or any(n != host[0] for n in host)
        lengths = cache.lengths
        positions = lengths if steps == 1 else lengths.unsqueeze(1) + cache.slot_ids(steps)
        out = self._layer(f, ids, hidden, bsz, steps, positions, cache, cache.max_length + steps, masked, cache.capacity)
        cache._advance(steps, counts)
        return out

    def _layer(
        self,
        f: _Fused,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        bsz: int,
        steps: int,
        positions: torch.Tensor,
        cache: DraftKVCache | None,
        span: int,
        masked: bool,
        table_size: int | None,
    ) -> torch.Tensor:
        """The decoder layer over ``N = B·T`` rows (row ``b·T + t``): ``ids [N]``, ``hidden [N, H]`` → ``[N, H]``.

        ``positions`` are ``[B]`` when ``T == 1``, else ``[B, T]``. With a ``cache`` the new keys/values are
        stored at those slots (lengths untouched) and the queries read slots ``[0, span)``, masked by position
        when ``masked`` (without a mask every row must see exactly that span); without a cache the block
        attends to itself, causally by position. ``table_size`` bounds the positions for the rotary table
        (None: compute the factors directly).
        """
        heads, kv_heads, head_dim = f.heads, f.kv_heads, f.head_dim
        groups = heads // kv_heads
        shape = (hidden.shape[-1],)
        normed = F.rms_norm(hidden, shape, *f.hidden_norm)
        x = torch.cat((F.rms_norm(self._embed_rows(ids, hidden.dtype), shape, *f.input_norm), normed), dim=-1)
        residual = normed if f.norm_before_residual else hidden
        projected = F.linear(x, f.qkv, f.qkv_bias).view(-1, heads + 2 * kv_heads, head_dim)
        cos, signed_sin = self._rope_factors(hidden, positions, table_size)
        # Rotated over all heads of the contiguous projection (CUDA's roll copies a strided input first);
        # the value heads' rotation is dropped.
        rotated = torch.addcmul(projected * cos, projected.roll(head_dim // 2, -1), signed_sin)
        q, k, _ = rotated.split((heads, kv_heads, kv_heads), dim=1)
        v = projected[:, heads + kv_heads :]

        # Grouped-query attention without expanding keys/values: the query heads sharing a key/value head
        # are rows of that head's query block, ordered (group, step); the mask is repeated to match.
        if steps == 1:
            query = q.view(bsz, kv_heads, groups, head_dim)
            query_pos = positions.reshape(bsz, 1, 1, 1) if masked else None
        else:
            query = q.view(bsz, steps, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
            query = query.reshape(bsz, kv_heads, groups * steps, head_dim)
            by_row = positions.repeat(1, groups) if groups > 1 else positions
            query_pos = by_row.reshape(bsz, 1, groups * steps, 1) if masked else None
        if cache is not None:
            if steps == 1:
                cache._put(k, v, positions)
            else:
                cache._put(k.view(bsz, steps, kv_heads, head_dim), v.view(bsz, steps, kv_heads, head_dim), positions)
            keys, values = cache.key.narrow(2, 0, span), cache.value.narrow(2, 0, span)
            mask = None if query_pos is None else cache.slot_ids(span) <= query_pos
        else:
            keys = k.view(bsz, steps, kv_heads, head_dim).transpose(1, 2)
            values = v.view(bsz, steps, kv_heads, head_dim).transpose(1, 2)
            mask = None if query_pos is None else positions.reshape(bsz, 1, 1, steps) <= query_pos
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
        if steps == 1:
            attn = out.reshape(bsz, heads * head_dim)
        else:
            attn = out.view(bsz, kv_heads, groups, steps, head_dim).permute(0, 3, 1, 2, 4)
            attn = attn.reshape(bsz * steps, heads * head_dim)

        hidden = _linear_add(residual, attn, f.o_t, f.o_bias)
        gate, up = F.linear(F.rms_norm(hidden, shape, *f.post_norm), f.gate_up, f.gate_up_bias).chunk(2, dim=-1)
        return _linear_add(hidden, f.act(gate) * up, f.down_t, f.down_bias)

    def _greedy(self, f: _Fused, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target ids ``[N]`` of pre-norm rows ``[N, H]``."""
        normed = F.rms_norm(hidden, (hidden.shape[-1],), *f.final_norm)
        return f.target_ids.take(F.linear(normed, f.lm_head).argmax(dim=-1))

    # ----------------------------------------------------------------------------- the engine's calls
    def _extend(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_valid: torch.Tensor | Sequence[int] | None,
        *,
        minimum: int,
        want_last: bool,
    ) -> tuple[torch.Tensor, _Counts | None, _Fused]:
        """The first pass over verified positions: (pre-norm outputs ``[B·T, H]``, the parsed counts, weights)."""
        if next_ids.dim() != 2 or next_ids.shape[0] != cache.batch_size:
            raise ValueError(f"next_ids has shape {tuple(next_ids.shape)}, expected (batch={cache.batch_size}, T)")
        features = self._aux_features(aux)
        if tuple(features.shape[:2]) != tuple(next_ids.shape):
            raise ValueError(
                f"aux states cover (batch, positions) = {tuple(features.shape[:2])} but next_ids has shape "
                f"{tuple(next_ids.shape)}"
            )
        bsz, steps = next_ids.shape
        counts = _valid_counts(num_valid, bsz, steps, cache.device, minimum=minimum, want_last=want_last)
        f = self._fused()
        hidden = F.linear(features.reshape(bsz * steps, -1), f.fc)
        return self._pass(f, next_ids, hidden, cache, counts, None), counts, f

    @torch.no_grad()
    def extend(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_valid: torch.Tensor | Sequence[int] | None = None,
    ) -> None:
        """Append target-verified positions to the cache without drafting (a round with no speculation).

        Same inputs as ``propose``; ``num_valid`` entries may be 0 (a row with nothing new this round keeps
        its cache as it was). Afterwards drafting resumes with full context.
        """
        if next_ids.dim() == 2 and next_ids.shape[1] == 0:
            return
        self._extend(aux, next_ids, cache, num_valid, minimum=0, want_last=False)

    @torch.no_grad()
    def propose(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_tokens: int,
        num_valid: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Extend the cache with target-verified positions, then draft ``num_tokens`` target ids per row.

        ``aux``: the target's aux states at the new verified positions (k tensors ``[B, T, H_t]`` in id
        order, or their concatenation); ``next_ids [B, T]``: the token following each of those positions;
        ``num_valid [B]``: how many of the ``T`` are real per row (default all; at least 1 each, checked
        when given as host integers). Returns ``[B, num_tokens]`` target ids; the cache afterwards holds
        only verified positions. No device value is read back to the host.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if next_ids.dim() == 2 and next_ids.shape[1] == 0:
            raise ValueError("propose needs at least one new verified position (next_ids has T = 0); use extend")
        out, counts, f = self._extend(aux, next_ids, cache, num_valid, minimum=1, want_last=True)
        bsz, steps = next_ids.shape
        if steps == 1:
            last = out
        elif counts is None or counts.device is None:
            last = out[steps - 1 :: steps]
        elif counts.last is not None:
            last = out.index_select(0, counts.last)
        else:  # counts on the device, unvalidated: clamp rather than index out of range
            last = out.index_select(0, (counts.device - 1).clamp(min=0) + cache._rows(True) * steps)
        token = self._greedy(f, last)
        if num_tokens == 1:
            return token.unsqueeze(1)
        # Draft steps write their keys/values past every row's length and attend through an explicit span;
        # the cache's lengths never move, so it holds exactly the verified positions afterwards.
        cache.reserve(num_tokens - 1)
        host = cache._host
        masked = host is None or any(n != host[0] for n in host)
        position, span = cache.lengths, cache.max_length
        drafts = [token]
        for i in range(num_tokens - 1):
            if i:
                position = position + 1
            span += 1
            last = self._layer(f, token, last, bsz, 1, position, cache, span, masked, cache.capacity)
            token = self._greedy(f, last)
            drafts.append(token)
        return torch.stack(drafts, dim=1)
