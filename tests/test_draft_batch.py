"""Batched drafting: cache row operations, ``extend``, ragged batches against single rows, and a
propose path that never reads a device value back to the host.

References here are the draft itself run one sequence at a time (whose agreement with an independent
transformers oracle ``tests/test_draft.py`` establishes) and transformers' own rotary code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pipespec.engine.draft.counts import Counts
from pipespec.engine.draft.kv_cache import DraftKVCache
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft.rotary import apply_rotary as _apply_rotary
from pipespec.engine.draft.rotary import rotary_factors
from pipespec.engine.draft.storage import DraftStorage
from pipespec.engine.tiny_checkpoints import make_random_draft

ATOL = 2e-5
AUX = 32  # target hidden size; the draft's fc reads 3 x AUX features


def _draft(seed: int = 0, heads: int = 4, kv_heads: int = 2, **layer: Any) -> Eagle3Draft:
    target = LlamaConfig(hidden_size=AUX, vocab_size=80, num_hidden_layers=6, rms_norm_eps=1e-5)
    return make_random_draft(
        target, num_aux=3, with_embedding=True, num_attention_heads=heads, num_key_value_heads=kv_heads,
        draft_vocab_size=50, seed=seed, max_position_embeddings=64, **layer,
    ).eval()


def _sequence(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(next_ids [1, length], aux features [1, length, 3*AUX]) of one sequence."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 80, (1, length), generator=gen), torch.randn(1, length, 3 * AUX, generator=gen)


def _pad_rows(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Stack ``[1, n_i, ...]`` pieces into ``[B, max n_i, ...]``, padding each row with its own first entry."""
    width = max(p.shape[1] for p in pieces)
    rows = [torch.cat([p] + [p[:, :1]] * (width - p.shape[1]), dim=1) for p in pieces]
    return torch.cat(rows)


def _filled_cache(draft: Eagle3Draft, counts: list[int], seed: int = 3, capacity: int = 256) -> DraftKVCache:
    cache = draft.new_cache(len(counts), capacity=capacity)
    gen = torch.Generator().manual_seed(seed)
    width = max(counts)
    ids = torch.randint(0, 80, (len(counts), width), generator=gen)
    feats = torch.randn(len(counts), width, 3 * AUX, generator=gen)
    draft.extend(feats, ids, cache, num_valid=counts)
    return cache


def _assert_row_matches(batched: DraftKVCache, row: int, single: DraftKVCache) -> None:
    """Same length, and the same stored keys/values over that length."""
    length = single.lengths.tolist()[0]
    assert batched.lengths.tolist()[row] == length
    assert torch.allclose(batched.key[row, :, :length], single.key[0, :, :length], atol=ATOL)
    assert torch.allclose(batched.value[row, :, :length], single.value[0, :, :length], atol=ATOL)


# ------------------------------------------------------------------------------------------ rows
def test_select_copies_rows_in_order() -> None:
    draft = _draft()
    cache = _filled_cache(draft, [5, 2, 4], capacity=32)
    picked = cache.select([2, 0, 2])
    assert picked.lengths.tolist() == [4, 5, 4] and picked.host_lengths == (4, 5, 4)
    assert picked.max_length == 5
    assert (picked.capacity, picked.dtype, picked.device) == (cache.capacity, cache.dtype, cache.device)
    assert torch.equal(picked.key, cache.key[[2, 0, 2]]) and torch.equal(picked.value, cache.value[[2, 0, 2]])
    # A copy: writing the selection leaves the source alone.
    before = cache.key.clone()
    ids, feats = _sequence(3, seed=9)
    draft.extend(feats.expand(3, -1, -1), ids.expand(3, -1), picked)
    assert torch.equal(cache.key, before) and cache.lengths.tolist() == [5, 2, 4]
    assert picked.lengths.tolist() == [7, 8, 7]


@given(rows=st.lists(st.integers(0, 3), max_size=7))
def test_select_agrees_with_indexing(rows: list[int]) -> None:
    cache = DraftKVCache(4, 2, 4, capacity=6)
    cache.key = torch.arange(cache.key.numel(), dtype=torch.float32).view_as(cache.key)
    cache.crop([0, 0, 0, 0])
    picked = cache.select(rows)
    assert picked.batch_size == len(rows)
    assert torch.equal(picked.key, cache.key[rows]) and picked.lengths.tolist() == [0] * len(rows)


def test_select_rejects_rows_outside_the_cache_and_allows_none() -> None:
    cache = _filled_cache(_draft(), [3, 1])
    with pytest.raises(ValueError, match=r"select rows \[2\] are outside the cache's 2 rows"):
        cache.select([0, 2])
    with pytest.raises(ValueError, match=r"select rows \[-1\]"):
        cache.select([-1])
    empty = cache.select([])
    assert empty.batch_size == 0 and empty.lengths.shape == (0,) and empty.max_length == 0
    assert empty.capacity == cache.capacity
    both = DraftKVCache.concat([empty, cache, empty])
    assert both.lengths.tolist() == [3, 1] and torch.equal(both.key, cache.key)


def test_concat_stacks_rows_and_pads_smaller_capacities() -> None:
    draft = _draft()
    small = _filled_cache(draft, [4], seed=1, capacity=6)
    large = _filled_cache(draft, [2, 9], seed=2, capacity=20)
    merged = DraftKVCache.concat([small, large])
    assert merged.capacity == 20 and merged.batch_size == 3
    assert merged.lengths.tolist() == [4, 2, 9] and merged.host_lengths == (4, 2, 9)
    assert merged.max_length == max(small.max_length, large.max_length)
    assert torch.equal(merged.key[:1, :, :6], small.key) and not merged.key[:1, :, 6:].any()
    assert torch.equal(merged.value[1:], large.value)


def test_concat_refuses_mismatched_caches() -> None:
    base = DraftKVCache(1, 2, 8)
    with pytest.raises(ValueError, match="at least one cache"):
        DraftKVCache.concat([])
    for other in (DraftKVCache(1, 4, 8), DraftKVCache(1, 2, 16), DraftKVCache(1, 2, 8, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="cannot concat draft caches: cache 1 has"):
            DraftKVCache.concat([base, other])


# ------------------------------------------------------------------------------------------ extend
@pytest.mark.parametrize("split", [1, 4, 8])
def test_extend_then_propose_matches_propose_on_the_whole_block(split: int) -> None:
    """extend(first part) + propose(rest) drafts what propose(whole block) drafts, from the same state."""
    draft = _draft(seed=4)
    ids, feats = _sequence(9, seed=5)
    whole, parts = draft.new_cache(1), draft.new_cache(1)
    want = draft.propose(list(feats.split(AUX, dim=-1)), ids, whole, num_tokens=4)
    draft.extend(list(feats[:, :split].split(AUX, dim=-1)), ids[:, :split], parts)
    assert parts.lengths.tolist() == [split] and parts.max_length == split
    got = draft.propose(feats[:, split:], ids[:, split:], parts, num_tokens=4)
    assert torch.equal(got, want)
    _assert_row_matches(parts, 0, whole)
    # The states the next round builds on agree too: the pre-norm outputs of one more position.
    more_ids, more_feats = _sequence(1, seed=6)
    with torch.no_grad():
        a = draft(more_ids, draft.combine_aux(more_feats), whole)
        b = draft(more_ids, draft.combine_aux(more_feats), parts)
    assert torch.allclose(a, b, atol=ATOL), (a - b).abs().max()


def test_extend_rows_with_nothing_new_keep_their_cache() -> None:
    draft = _draft(seed=7)
    cache = _filled_cache(draft, [6, 3, 5])
    untouched = cache.select([1])
    keys = cache.key[1, :, :3].clone()
    ids, feats = _sequence(2, seed=8)
    draft.extend(feats.expand(3, -1, -1), ids.expand(3, -1), cache, num_valid=[2, 0, 1])
    assert cache.lengths.tolist() == [8, 3, 6] and cache.host_lengths == (8, 3, 6)
    assert torch.equal(cache.key[1, :, :3], keys)
    # The junk written past row 1's length is never seen: it proposes as if the round never happened.
    nxt_ids, nxt_feats = _sequence(2, seed=10)
    got = draft.propose(nxt_feats.expand(3, -1, -1), nxt_ids.expand(3, -1), cache, num_tokens=3)
    want = draft.propose(nxt_feats, nxt_ids, untouched, num_tokens=3)
    assert torch.equal(got[1:2], want)
    # Nothing at all to append is a no-op.
    before = (cache.lengths.tolist(), cache.max_length)
    draft.extend(feats[:, :0].expand(3, -1, -1), ids[:, :0].expand(3, -1), cache)
    assert (cache.lengths.tolist(), cache.max_length) == before


def _first_pass(
    draft: Eagle3Draft, feats: torch.Tensor, ids: torch.Tensor, cache: DraftKVCache, counts: list[int] | None,
    *, on_device: bool, full_layer: bool,
) -> None:
    """One extend round: ``extend``'s key/value-only pass, or (``full_layer``) the reference, the whole layer
    over the new positions as ``propose``'s first pass runs it, output dropped. ``on_device``: the counts
    as ``Counts`` holding a tensor only (what a CUDA tensor gives; a CPU tensor would be read as host ints)."""
    with torch.no_grad():
        hidden, parsed, f = draft._verified(feats, ids, cache, None if on_device else counts, minimum=0,
                                            want_last=False)
        if on_device and counts is not None:
            parsed = Counts(torch.tensor(counts), None, None)
        if full_layer:
            draft._pass(f, ids, hidden, cache, parsed, None)
        elif on_device:
            draft._append(f, ids, hidden, cache, parsed)
        else:
            draft.extend(feats, ids, cache, num_valid=counts)


@pytest.mark.parametrize("adopted", [False, True])
@pytest.mark.parametrize("counts_mode", ["full", "host", "device"])
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (8, 2)])
def test_extend_leaves_the_cache_a_full_layer_pass_leaves(
    heads: int, kv_heads: int, steps: int, counts_mode: str, adopted: bool
) -> None:
    """extend runs only the key/value side; rounds of extend and propose (ragged, full, counted on the
    device; GQA groups 1, 2 and 4; masked and unmasked spans; plain and adopted caches) against the same rounds
    with the whole layer run for extend: identical drafts and bit-identical keys, values and lengths."""
    draft = _draft(seed=30 + heads + kv_heads, heads=heads, kv_heads=kv_heads)
    bsz = 3
    caches = []
    for _ in range(2):
        cache = draft.new_cache(bsz, capacity=8)  # small: plain caches grow along the way
        if adopted:
            layer = draft.midlayer
            cache = DraftStorage(bsz, layer.num_kv_heads, layer.head_dim, capacity=64).adopt(cache)
        caches.append(cache)
    gen = torch.Generator().manual_seed(steps)
    for round_ in range(4):
        ids = torch.randint(0, 80, (bsz, steps), generator=gen)
        feats = torch.randn(bsz, steps, 3 * AUX, generator=gen)
        counts = None if counts_mode == "full" else [(round_ + b) % (steps + 1) for b in range(bsz)]
        for cache, full_layer in zip(caches, (False, True), strict=True):
            _first_pass(draft, feats, ids, cache, counts, on_device=counts_mode == "device", full_layer=full_layer)
        ids = torch.randint(0, 80, (bsz, steps), generator=gen)
        feats = torch.randn(bsz, steps, 3 * AUX, generator=gen)
        valid = None if counts_mode == "full" else [1 + (round_ + 2 * b) % steps for b in range(bsz)]
        got, want = (draft.propose(feats, ids, cache, num_tokens=3, num_valid=valid) for cache in caches)
        assert torch.equal(got, want), (round_, got, want)
        mine, ref = caches
        assert torch.equal(mine.lengths, ref.lengths), (round_, mine.lengths, ref.lengths)
        assert (mine.host_lengths, mine.max_length) == (ref.host_lengths, ref.max_length)
        assert (counts_mode == "device") == (mine.host_lengths is None)
        assert torch.equal(mine.key, ref.key) and torch.equal(mine.value, ref.value), round_


# ------------------------------------------------------------------------------------------ batched vs single
def test_batched_rows_match_single_row_caches() -> None:
    """Three sequences of different lengths: B=1 caches vs one concat-ed B=3 cache with ragged counts,
    then a select([0, 2]) of it; counts given as host integers and as a tensor."""
    draft = _draft(seed=11)
    k = 3
    prompts = [_sequence(n, seed=20 + n) for n in (7, 3, 5)]
    singles = [draft.new_cache(1) for _ in prompts]
    rows = [draft.new_cache(1, capacity=cap) for cap in (4, 16, 64)]  # growth, then padding in concat
    for (ids, feats), single, row in zip(prompts, singles, rows, strict=True):
        want = draft.propose(feats, ids, single, num_tokens=k)
        assert torch.equal(draft.propose(feats, ids, row, num_tokens=k), want)
    batched = DraftKVCache.concat(rows)
    assert batched.lengths.tolist() == [7, 3, 5]

    def round_(cache: DraftKVCache, members: list[int], counts: list[int], seed: int, as_tensor: bool) -> None:
        pieces = [_sequence(n, seed=seed + m) for m, n in zip(members, counts, strict=True)]
        want = [draft.propose(f, i, singles[m], num_tokens=k) for m, (i, f) in zip(members, pieces, strict=True)]
        num_valid: Any = torch.tensor(counts) if as_tensor else counts
        got = draft.propose(_pad_rows([f for _, f in pieces]), _pad_rows([i for i, _ in pieces]), cache,
                            num_tokens=k, num_valid=num_valid)
        assert torch.equal(got, torch.cat(want)), (got, want)
        for row, m in enumerate(members):
            _assert_row_matches(cache, row, singles[m])

    round_(batched, [0, 1, 2], [3, 1, 2], seed=100, as_tensor=False)
    round_(batched, [0, 1, 2], [1, 4, 4], seed=200, as_tensor=True)
    assert batched.max_length == max(batched.lengths.tolist())  # host counts keep it exact: no drift
    kept = batched.select([0, 2])
    round_(kept, [0, 2], [2, 4], seed=300, as_tensor=False)
    round_(kept, [0, 2], [4, 1], seed=400, as_tensor=False)


# ------------------------------------------------------------------------------------------ lengths bookkeeping
def test_host_lengths_track_device_lengths() -> None:
    draft = _draft()
    cache = _filled_cache(draft, [4, 1, 3])
    ids, feats = _sequence(2, seed=1)
    for counts in ([2, 1, 0], [1, 2, 2]):
        draft.extend(feats.expand(3, -1, -1), ids.expand(3, -1), cache, num_valid=counts)
        assert list(cache.host_lengths or ()) == cache.lengths.tolist()
        assert cache.max_length == max(cache.lengths.tolist())
    cache.crop([2, 1, 3])
    assert cache.lengths.tolist() == [2, 1, 3] and cache.max_length == 3 and cache.host_lengths == (2, 1, 3)
    cache.lengths = torch.tensor([2, 1, 2])  # set from outside: the host copy is dropped, crop still validates
    assert cache.host_lengths is None
    with pytest.raises(ValueError, match=r"crop to \[3, 1, 2\] is outside the cached lengths \[2, 1, 2\]"):
        cache.crop([3, 1, 2])
    cache.crop(torch.tensor([1, 0, 2]))
    assert cache.host_lengths == (1, 0, 2) and cache.max_length == 2


def test_counts_given_as_integers_are_checked() -> None:
    draft = _draft()
    cache = draft.new_cache(2)
    ids, feats = _sequence(3, seed=2)
    ids2, feats2 = ids.expand(2, -1), feats.expand(2, -1, -1)
    with pytest.raises(ValueError, match=r"num_valid \[0, 2\] must lie in \[1, 3\]"):
        draft.propose(feats2, ids2, cache, num_tokens=2, num_valid=[0, 2])
    with pytest.raises(ValueError, match=r"num_valid \[4, 2\] must lie in \[0, 3\]"):
        draft.extend(feats2, ids2, cache, num_valid=[4, 2])
    with pytest.raises(ValueError, match="num_valid has 1 entries, expected 2"):
        draft.extend(feats2, ids2, cache, num_valid=[1])
    with pytest.raises(ValueError, match="next_ids has shape"):
        draft.propose(feats, ids, cache, num_tokens=2)
    with pytest.raises(ValueError, match="aux states cover"):
        draft.propose(feats2[:, :2], ids2, cache, num_tokens=2)
    with pytest.raises(ValueError, match="use extend"):
        draft.propose(feats2[:, :0], ids2[:, :0], cache, num_tokens=2)
    assert cache.lengths.tolist() == [0, 0] and cache.max_length == 0


# ------------------------------------------------------------------------------------------ no host syncs
class _HostReads(TorchFunctionMode):
    """Records every tensor method call that hands a value to Python."""

    NAMES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _watch() -> Iterator[tuple[_HostReads, list[str]]]:
    ops: list[str] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof, _HostReads() as reads:
        yield reads, ops
    ops.extend(e.name for e in prof.events())


SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"}


@pytest.mark.parametrize(("bsz", "steps", "ragged"), [(1, 1, False), (8, 4, True), (8, 4, False)])
def test_propose_and_extend_read_nothing_back(bsz: int, steps: int, ragged: bool) -> None:
    draft = _draft(seed=2)
    cache = _filled_cache(draft, [5 + b % 3 for b in range(bsz)])
    gen = torch.Generator().manual_seed(bsz)
    ids, feats = torch.randint(0, 80, (bsz, steps), generator=gen), torch.randn(bsz, steps, 3 * AUX, generator=gen)
    counts = [1 + b % steps for b in range(bsz)] if ragged else None
    with _watch() as (reads, ops):
        drafts = draft.propose(list(feats.split(AUX, dim=-1)), ids, cache, num_tokens=3, num_valid=counts)
        draft.extend(feats, ids, cache, num_valid=counts)
    assert drafts.shape == (bsz, 3)
    assert "aten::scaled_dot_product_attention" in ops, "the profiler saw the propose path"
    assert not SYNC_OPS & set(ops), sorted(SYNC_OPS & set(ops))
    assert reads.seen == []


def test_propose_runs_on_a_device_without_host_values() -> None:
    """On the meta device any host read of a value, or a CPU tensor mixed into the device path, raises."""
    draft = _draft(seed=3).to("meta")
    meta = torch.device("meta")
    cache = draft.new_cache(3, capacity=4)
    ids = torch.zeros(3, 5, dtype=torch.long, device=meta)
    feats = torch.zeros(3, 5, 3 * AUX, device=meta)
    draft.extend(feats, ids, cache, num_valid=[5, 2, 0])
    assert cache.host_lengths == (5, 2, 0) and cache.max_length == 5
    out = draft.propose(feats, ids, cache, num_tokens=4, num_valid=[1, 5, 3])
    assert out.shape == (3, 4) and out.device == meta and cache.capacity >= 13
    # Lengths are now (6, 7, 3); one real position of two per row, counted on the device: the host
    # bound becomes 7 + 2 although the longest row holds 8.
    out = draft.propose(feats[:, :2], ids[:, :2], cache, num_tokens=2,
                        num_valid=torch.ones(3, dtype=torch.long, device=meta))
    assert out.shape == (3, 2)
    assert cache.host_lengths is None and cache.max_length == 9
    merged = DraftKVCache.concat([cache.select([2]), cache.select([0, 1])])
    assert merged.lengths.shape == (3,) and merged.device == meta


# ------------------------------------------------------------------------------------------ rotary
ROPES: dict[str, dict[str, Any]] = {
    "default": {},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5e5}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "rope_theta": 1e4}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_transformers_bit_for_bit(rope: str, dtype: torch.dtype) -> None:
    draft = _draft(**ROPES[rope]).to(dtype)
    reference = LlamaRotaryEmbedding(draft.config.layer)
    if rope == "yarn":
        assert reference.attention_scaling != 1.0, "yarn should exercise the attention scaling"
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 60, (3, 5), generator=gen)
    like = torch.zeros(3, 5, 8, dtype=dtype)
    cos, sin = draft.rotary(like, positions)
    want_cos, want_sin = reference(like, positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    q = torch.randn(3, 4, 5, draft.config.head_dim, generator=gen).to(dtype)
    k = torch.randn(3, 2, 5, draft.config.head_dim, generator=gen).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, want_cos, want_sin)
    cos_f, sin_f = rotary_factors(cos, sin)
    got_q = _apply_rotary(q.transpose(1, 2), cos_f, sin_f).transpose(1, 2)
    got_k = _apply_rotary(k.transpose(1, 2), cos_f, sin_f).transpose(1, 2)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


# ------------------------------------------------------------------------------------------ fused inference path
def _plain_forward(draft: Eagle3Draft, ids: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """One causal pass through the draft's per-module helpers: separate q/k/v and gate/up projections,
    transformers' rotary, repeated key/value heads. Shares no code with the fused path of ``forward``."""
    layer = draft.midlayer
    bsz, steps = ids.shape
    if positions is None:
        positions = torch.arange(steps).expand(bsz, steps)
    residual, q, k, v = layer.qkv(draft.embed(ids), hidden, *draft.rotary(hidden, positions))
    mask = (positions[:, None, :] <= positions[:, :, None]).unsqueeze(1)
    return layer.finish(residual, layer.attend(q, k, v, mask))


def _plain_chain(draft: Eagle3Draft, ids: torch.Tensor, feats: torch.Tensor, k: int) -> list[int]:
    """Greedy drafts of one row by recomputing the whole sequence with ``_plain_forward`` after each step."""
    with torch.no_grad():
        hidden = draft.combine_aux(feats)
        drafts: list[int] = []
        for _ in range(k):
            out = _plain_forward(draft, ids, hidden)
            token = draft.greedy_target_ids(out[:, -1:])
            drafts.append(int(token))
            ids, hidden = torch.cat((ids, token), dim=1), torch.cat((hidden, out[:, -1:]), dim=1)
    return drafts


FUSED_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "mqa": {"num_key_value_heads": 1},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "norm-before-residual": {"norm_before_residual": True},
    "dynamic-rope": ROPES["dynamic"],
    "yarn-rope": ROPES["yarn"],
}


def _variant(name: str, seed: int = 0) -> Eagle3Draft:
    layer = dict(FUSED_VARIANTS[name])
    heads = layer.pop("num_key_value_heads", 2)
    target = LlamaConfig(hidden_size=AUX, vocab_size=80, num_hidden_layers=6, rms_norm_eps=1e-5)
    return make_random_draft(
        target, num_aux=3, with_embedding=True, num_attention_heads=4, num_key_value_heads=heads, draft_vocab_size=50,
        seed=seed, max_position_embeddings=64, **layer,
    ).eval()


@pytest.mark.parametrize("variant", list(FUSED_VARIANTS))
def test_fused_path_matches_the_module_helpers(variant: str) -> None:
    """forward (whole block, explicit positions, cached chunks with ragged rows) and propose agree with the
    plain per-module computation for every layer shape the fused path special-cases."""
    draft = _variant(variant, seed=12)
    gen = torch.Generator().manual_seed(13)
    ids, feats = torch.randint(0, 80, (2, 9), generator=gen), torch.randn(2, 9, 3 * AUX, generator=gen)
    with torch.no_grad():
        hidden = draft.combine_aux(feats)
        want = _plain_forward(draft, ids, hidden)
        torch.testing.assert_close(draft(ids, hidden), want, atol=ATOL, rtol=0)
        shifted = torch.arange(9).expand(2, 9) + torch.tensor([[3], [11]])
        torch.testing.assert_close(draft(ids, hidden, position_ids=shifted), _plain_forward(draft, ids, hidden, shifted),
                                   atol=ATOL, rtol=0)
        # Row 0 takes 4 then 5 positions, row 1 takes 2, 1, then 6 (padding past its count in each call).
        cache = draft.new_cache(2, capacity=4)
        out0 = [draft(ids[:, :4], hidden[:, :4], cache, num_valid=[4, 2])]
        row1 = [out0[0][1, :2]]
        out1 = draft(torch.stack([ids[0, 4:5], ids[1, 2:3]]), torch.stack([hidden[0, 4:5], hidden[1, 2:3]]), cache,
                     num_valid=[0, 1])
        row1.append(out1[1])
        out2 = draft(torch.stack([torch.cat([ids[0, 4:], ids[0, :1]]), ids[1, 3:]]),
                     torch.stack([torch.cat([hidden[0, 4:], hidden[0, :1]]), hidden[1, 3:]]), cache, num_valid=[5, 6])
        row1.append(out2[1, :6])
    assert cache.lengths.tolist() == [9, 9] and cache.host_lengths == (9, 9)
    torch.testing.assert_close(torch.cat([out0[0][0], out2[0, :5]]), want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(row1), want[1], atol=ATOL, rtol=0)
    for row in range(2):
        fresh = draft.new_cache(1)
        got = draft.propose(feats[row : row + 1], ids[row : row + 1], fresh, num_tokens=4)[0].tolist()
        assert got == _plain_chain(draft, ids[row : row + 1], feats[row : row + 1], 4)


def test_fused_path_in_bfloat16_stays_close_to_the_module_helpers() -> None:
    draft = _draft(seed=14).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(15)
    ids, feats = torch.randint(0, 80, (2, 7), generator=gen), torch.randn(2, 7, 3 * AUX, generator=gen)
    with torch.no_grad():
        hidden = draft.combine_aux(feats.to(torch.bfloat16))
        got, want = draft(ids, hidden), _plain_forward(draft, ids, hidden)
        cache = draft.new_cache(2)
        stepped = torch.cat([draft(ids[:, :5], hidden[:, :5], cache)] + [
            draft(ids[:, t : t + 1], hidden[:, t : t + 1], cache) for t in (5, 6)], dim=1)
    assert got.dtype == torch.bfloat16 and cache.key.dtype == torch.bfloat16
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 0.02 * scale
    assert (stepped.float() - want.float()).abs().max() <= 0.02 * scale


def test_fused_weights_follow_every_kind_of_parameter_update() -> None:
    """The kept fused weights are rebuilt after in-place updates (optimizer step, load_state_dict, copy_
    into d2t), parameter reassignment and dtype conversion; the no-grad forward then matches the module
    helpers on the updated weights."""
    draft = _draft(seed=16)
    gen = torch.Generator().manual_seed(17)
    ids, feats = torch.randint(0, 80, (1, 6), generator=gen), torch.randn(1, 6, 3 * AUX, generator=gen)

    def check(model: Eagle3Draft) -> torch.Tensor:
        with torch.no_grad():
            hidden = model.combine_aux(feats.to(model.fc.weight.dtype))
            got = model(ids, hidden)
            torch.testing.assert_close(got, _plain_forward(model, ids, hidden), atol=ATOL, rtol=0)
        return got

    before = check(draft)
    # An optimizer step (in place, under no_grad) on every parameter, through a grad-mode forward.
    optimizer = torch.optim.SGD(draft.parameters(), lr=0.5)
    draft(ids, draft.combine_aux(feats)).square().mean().backward()
    optimizer.step()
    after_step = check(draft)
    assert not torch.allclose(after_step, before, atol=1e-3)
    # load_state_dict copies into the same tensors.
    other = _draft(seed=18)
    draft.load_state_dict(other.state_dict())
    torch.testing.assert_close(check(draft), check(other), atol=0, rtol=0)
    # A reassigned parameter (a new tensor object, as assign=True loading makes).
    with torch.no_grad():
        draft.midlayer.mlp.up_proj.weight = torch.nn.Parameter(draft.midlayer.mlp.up_proj.weight * -1.5)
        draft.midlayer.self_attn.k_proj.weight = torch.nn.Parameter(draft.midlayer.self_attn.k_proj.weight.flip(0))
    check(draft)
    # dtype round trip: new storages each time.
    check(draft.double())
    check(draft.float())
    # d2t rewritten in place: drafts follow the new mapping (the first one shifts, the rest are fed from it).
    plain = draft.propose(feats, ids, draft.new_cache(1), num_tokens=3)
    with torch.no_grad():
        draft.d2t.add_(1)
    again = draft.propose(feats, ids, draft.new_cache(1), num_tokens=3)
    assert again[0, 0] == plain[0, 0] + 1
    assert again[0].tolist() == _plain_chain(draft, ids, feats, 3)


def test_forward_with_gradients_reaches_the_module_parameters() -> None:
    """With autograd on, the fused weights are rebuilt differentiably: gradients land on q/k/v, gate/up and
    the rest exactly where the plain per-module computation puts them."""
    draft = _draft(seed=19).train()
    gen = torch.Generator().manual_seed(20)
    ids, feats = torch.randint(0, 80, (2, 5), generator=gen), torch.randn(2, 5, 3 * AUX, generator=gen)
    names = [n for n, p in draft.named_parameters() if p.requires_grad]

    def grads(run: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        draft.zero_grad(set_to_none=True)
        hidden = draft.combine_aux(feats)
        draft.logits(run(hidden)).logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    fused = grads(lambda hidden: draft(ids, hidden))
    plain = grads(lambda hidden: _plain_forward(draft, ids, hidden))
    assert sorted(fused) == sorted(plain) == sorted(names)
    for name in names:
        torch.testing.assert_close(fused[name], plain[name], atol=1e-4, rtol=1e-4, msg=name)
    assert fused["midlayer.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_gives_the_rotary_factors_and_grows(dtype: torch.dtype) -> None:
    draft = _draft(**ROPES["llama3"]).to(dtype)
    like = torch.zeros(1, 8, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 15, 16, 63])
    cos, sin = draft._rope_factors(like, positions, 64)
    table = draft.__dict__["_rope_tab"]
    assert table.shape[0] == 64 and table.dtype == dtype
    want_cos, want_sin = rotary_factors(*draft.rotary(like, positions[None]))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cos, want_cos[0], atol=tol, rtol=0)
    torch.testing.assert_close(sin, want_sin[0], atol=tol, rtol=0)
    # Positions past the table grow it (at least doubling); the early rows stay what they were.
    far = torch.tensor([[3, 100], [200, 299]])
    cos2, sin2 = draft._rope_factors(like, far, 300)
    grown = draft.__dict__["_rope_tab"]
    assert grown.shape[0] == 300 and torch.equal(grown[:64], table)
    want_cos, want_sin = rotary_factors(*draft.rotary(like, far))
    torch.testing.assert_close(cos2, want_cos.reshape(4, 1, -1), atol=tol, rtol=0)
    torch.testing.assert_close(sin2, want_sin.reshape(4, 1, -1), atol=tol, rtol=0)
    draft._rope_factors(like, positions[:3], 8)
    assert draft.__dict__["_rope_tab"] is grown  # large enough: kept
    draft._rope_factors(like.double(), positions[:3], 8)
    assert draft.__dict__["_rope_tab"].dtype == torch.float64  # another dtype: rebuilt


def test_cache_write_stores_rows_at_their_own_lengths() -> None:
    cache = DraftKVCache(3, 2, 4, capacity=4)
    cache.crop([0, 0, 0])
    first = torch.randn(3, 2, 3, 4)
    slots = cache.write(first, -first, [3, 1, 2])
    assert slots.tolist() == [[0, 1, 2]] * 3 and cache.host_lengths == (3, 1, 2)
    second = torch.randn(3, 2, 2, 4)
    slots = cache.write(second, -second, None)
    assert slots.tolist() == [[3, 4], [1, 2], [2, 3]] and cache.host_lengths == (5, 3, 4) and cache.capacity >= 5
    for row, length in enumerate((3, 1, 2)):
        assert torch.equal(cache.key[row, :, :length], first[row, :, :length])
        assert torch.equal(cache.key[row, :, length : length + 2], second[row])
        assert torch.equal(cache.value[row, :, length : length + 2], -second[row])


def _top_level_ops(run: Callable[[], Any]) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    names = []
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None:
            names.append(event.name)
    return names


@pytest.mark.parametrize(("bsz", "steps", "ragged"), [(1, 1, False), (8, 4, True)])
def test_draft_steps_stay_lean(bsz: int, steps: int, ragged: bool) -> None:
    """One draft step is one fused layer pass: three matmuls (q/k/v, gate/up, lm_head) plus two addmm
    (o_proj and down_proj with their residuals), no key/value head expansion, and a bounded number of
    top-level ops (launch-bound models pay per op)."""
    draft = _draft(seed=21)
    gen = torch.Generator().manual_seed(22)
    ids, feats = torch.randint(0, 80, (bsz, steps), generator=gen), torch.randn(bsz, steps, 3 * AUX, generator=gen)
    counts = [1 + b % steps for b in range(bsz)] if ragged else None
    cache = _filled_cache(draft, [5 + b % 3 for b in range(bsz)])
    runs = {k: _top_level_ops(lambda k=k: draft.propose(feats, ids, cache, num_tokens=k, num_valid=counts))
            for k in (3, 4)}
    step = list(runs[4])
    for name in runs[3]:
        step.remove(name)
    assert step.count("aten::linear") == 3 and step.count("aten::addmm") == 2, step
    assert step.count("aten::scaled_dot_product_attention") == 1
    assert "aten::repeat_interleave" not in runs[4]
    assert len(step) <= (32 if bsz == 1 else 36), (len(step), step)
    assert len(runs[3]) <= (100 if bsz == 1 else 130), (len(runs[3]), runs[3])


def test_parameters_made_in_inference_mode_are_never_stale() -> None:
    """Inference tensors track no version counter: in-place updates inside inference_mode still show."""
    gen = torch.Generator().manual_seed(23)
    ids, feats = torch.randint(0, 80, (1, 6), generator=gen), torch.randn(1, 6, 3 * AUX, generator=gen)
    with torch.inference_mode():
        draft = _draft(seed=24)
        assert draft.midlayer.self_attn.q_proj.weight.is_inference()
        first = draft.propose(feats, ids, draft.new_cache(1), num_tokens=3)[0].tolist()
        assert first == _plain_chain(draft, ids, feats, 3)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(draft.midlayer.self_attn, name).weight.mul_(-2.0)
        draft.midlayer.mlp.gate_proj.weight.add_(0.5)
        again = draft.propose(feats, ids, draft.new_cache(1), num_tokens=3)[0].tolist()
        assert again == _plain_chain(draft, ids, feats, 3)
        hidden = draft.combine_aux(feats)
        torch.testing.assert_close(draft(ids, hidden), _plain_forward(draft, ids, hidden), atol=ATOL, rtol=0)
