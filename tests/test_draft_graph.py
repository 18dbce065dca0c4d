"""The draft's graph runner: adopted caches in fixed storage, and a captured propose that drafts what the
eager ``Eagle3Draft.propose`` drafts.

The reference everywhere is the eager path on ordinary caches, driven through the same rounds and row
operations (whose own correctness ``tests/test_draft.py`` and ``tests/test_draft_batch.py`` establish).
On a CPU the runner runs in "emulate" mode (the captured body re-executed on its static tensors); the
CUDA test replays real graphs.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from pipespec.engine.draft.kv_cache import DraftKVCache
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_graph import DraftGraphRunner, GraphMode
from pipespec.engine.tiny_checkpoints import make_random_draft

ATOL = 2e-5
AUX = 32  # target hidden size; the draft's fc reads 3 x AUX features
VOCAB = 80


def _draft(seed: int = 0, device: str = "cpu", **layer: Any) -> Eagle3Draft:
    target = LlamaConfig(hidden_size=AUX, vocab_size=VOCAB, num_hidden_layers=6, rms_norm_eps=1e-5)
    draft = make_random_draft(
        target, num_aux=3, with_embedding=True, num_attention_heads=4, num_key_value_heads=2, draft_vocab_size=50,
        seed=seed, max_position_embeddings=256, **layer,
    )
    return draft.to(device).eval()


def _inputs(gen: torch.Generator, bsz: int, steps: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(next_ids [B, T], aux features [B, T, 3*AUX])."""
    ids = torch.randint(0, VOCAB, (bsz, steps), generator=gen)
    feats = torch.randn(bsz, steps, 3 * AUX, generator=gen)
    return ids.to(device), feats.to(device)


def _ragged(gen: torch.Generator, bsz: int, steps: int, minimum: int = 1) -> list[int]:
    return torch.randint(minimum, steps + 1, (bsz,), generator=gen).tolist()


def _prefilled(draft: Eagle3Draft, gen: torch.Generator, counts: list[int], capacity: int,
               device: str = "cpu") -> tuple[DraftKVCache, DraftKVCache]:
    """Two identical ordinary caches after a prefill propose of ``counts`` positions per row."""
    ids, feats = _inputs(gen, len(counts), max(counts), device)
    caches = draft.new_cache(len(counts), capacity=capacity), draft.new_cache(len(counts), capacity=capacity)
    first, second = (draft.propose(feats, ids, c, num_tokens=3, num_valid=counts) for c in caches)
    assert torch.equal(first, second)
    return caches


def _assert_same_cache(got: DraftKVCache, want: DraftKVCache) -> None:
    """Same lengths (device and host) and the same keys/values over every row's length."""
    assert got.host_lengths == want.host_lengths and got.max_length == want.max_length
    lengths = want.lengths.tolist()
    assert got.lengths.tolist() == lengths
    for row, length in enumerate(lengths):
        torch.testing.assert_close(got.key[row, :, :length], want.key[row, :, :length], atol=ATOL, rtol=0)
        torch.testing.assert_close(got.value[row, :, :length], want.value[row, :, :length], atol=ATOL, rtol=0)


class _Pair:
    """An adopted cache driven by the runner and an ordinary cache driven eagerly, through the same calls."""

    def __init__(self, draft: Eagle3Draft, runner: DraftGraphRunner, cache: DraftKVCache, ref: DraftKVCache) -> None:
        self.draft, self.runner, self.ref = draft, runner, ref
        self.cache = runner.adopt(cache)
        assert self.cache.storage is runner.storage
        self.key_ptr, self.lengths_ptr = runner.storage.key.data_ptr(), runner.storage.lengths.data_ptr()
        _assert_same_cache(self.cache, ref)

    def propose(self, gen: torch.Generator, steps: int, num_tokens: int, counts: list[int] | None) -> list[list[int]]:
        ids, feats = _inputs(gen, self.ref.batch_size, steps, str(self.ref.device))
        want = self.draft.propose(feats, ids, self.ref, num_tokens=num_tokens, num_valid=counts)
        got = self.runner.propose(list(feats.split(AUX, dim=-1)), ids, self.cache, num_tokens, num_valid=counts)
        assert got.tolist() == want.tolist()
        self.check()
        return got.tolist()

    def extend(self, gen: torch.Generator, steps: int, counts: list[int]) -> None:
        ids, feats = _inputs(gen, self.ref.batch_size, steps, str(self.ref.device))
        self.draft.extend(feats, ids, self.ref, num_valid=counts)
        self.runner.extend(feats, ids, self.cache, num_valid=counts)
        self.check()

    def select(self, rows: list[int]) -> None:
        old = self.cache
        self.cache, self.ref = self.cache.select(rows), self.ref.select(rows)
        with pytest.raises(RuntimeError, match="stale"):
            old.select(rows)
        self.check()

    def concat(self, cache: DraftKVCache, ref: DraftKVCache) -> None:
        self.cache = DraftKVCache.concat([self.cache, cache])
        self.ref = DraftKVCache.concat([self.ref, ref])
        self.check()

    def check(self) -> None:
        cache, storage = self.cache, self.runner.storage
        assert cache.storage is storage and cache.capacity == storage.capacity
        assert storage.key.data_ptr() == self.key_ptr and storage.lengths.data_ptr() == self.lengths_ptr
        assert cache.key.untyped_storage().data_ptr() == self.key_ptr  # views of the storage (also at 0 rows)
        assert cache.lengths.untyped_storage().data_ptr() == self.lengths_ptr
        if cache.batch_size:
            assert cache.key.data_ptr() == self.key_ptr and cache.value.data_ptr() == storage.value.data_ptr()
            assert cache.lengths.data_ptr() == self.lengths_ptr
        _assert_same_cache(cache, self.ref)


def _runner(draft: Eagle3Draft, mode: GraphMode = "emulate", **kwargs: Any) -> DraftGraphRunner:
    options: dict[str, Any] = dict(max_rows=8, capacity=128, num_tokens=3)
    options.update(kwargs)
    return DraftGraphRunner(draft, mode=mode, **options)


# ------------------------------------------------------------------------------------------ propose
@pytest.mark.timeout(240)
@pytest.mark.parametrize("bsz", [1, 3, 8])
def test_emulated_rounds_draft_what_eager_propose_drafts(bsz: int) -> None:
    """Verify-like rounds with ragged host counts (T from 1 to k + 1, some full): the same tokens, lengths,
    host lengths and cached keys/values as eager propose, with one capture per shape and no fallback."""
    draft = _draft(seed=1)
    gen = torch.Generator().manual_seed(100 + bsz)
    runner = _runner(draft)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, _ragged(gen, bsz, 9), capacity=40))
    shapes = set()
    for round_ in range(14):
        steps = 1 + round_ % 4
        counts = None if round_ % 5 == 4 else _ragged(gen, bsz, steps)
        pair.propose(gen, steps, 3, counts)
        shapes.add((bsz, steps, 3))
    assert runner.graphs == len(shapes) and runner.replays == 14 and runner.eager_calls == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_other_draft_lengths_are_captured_too(num_tokens: int) -> None:
    """A draft length other than the runner's own is one more shape key, with the eager path's tokens."""
    draft = _draft(seed=2)
    gen = torch.Generator().manual_seed(7)
    runner = _runner(draft)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [4, 7], capacity=20))
    for steps in (2, 1, 2):
        pair.propose(gen, steps, num_tokens, _ragged(gen, 2, steps))
    assert runner.graphs == 2 and runner.eager_calls == 0


@pytest.mark.timeout(120)
def test_counts_as_a_host_tensor_are_host_integers() -> None:
    """Counts given as a CPU tensor are validated host integers, as for the eager path: host lengths kept."""
    draft = _draft(seed=3)
    gen = torch.Generator().manual_seed(8)
    runner = _runner(draft)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [5, 2, 6], capacity=30))
    ids, feats = _inputs(gen, 3, 3)
    counts = torch.tensor([3, 1, 2])
    want = draft.propose(feats, ids, pair.ref, num_tokens=3, num_valid=counts)
    got = runner.propose(feats, ids, pair.cache, 3, num_valid=counts)
    assert got.tolist() == want.tolist() and pair.cache.host_lengths == (8, 3, 8)
    pair.check()
    with pytest.raises(ValueError, match=r"num_valid \[0, 1, 1\] must lie in \[1, 3\]"):
        runner.propose(feats, ids, pair.cache, 3, num_valid=torch.tensor([0, 1, 1]))
    pair.check()


# ------------------------------------------------------------------------------------------ rows
@pytest.mark.timeout(240)
def test_select_and_concat_keep_the_storage_and_the_drafts() -> None:
    """Rows dropped (select) and prefilled rows merged after the running ones (concat), between rounds:
    the adopted cache stays in the runner's storage (same addresses) and keeps drafting what eager caches
    driven through the same row operations draft; the caches replaced are refused as stale."""
    draft = _draft(seed=4)
    gen = torch.Generator().manual_seed(9)
    runner = _runner(draft, capacity=96)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [6, 3, 8, 5], capacity=30))
    pair.propose(gen, 4, 3, [4, 2, 1, 3])
    pair.select([0, 3, 2])  # row 1 finished: the last row fills its gap, moved within the storage (RowBatch.drop)
    pair.propose(gen, 2, 3, [2, 1, 2])
    # Two new sequences prefilled in their own (smaller) caches join the running rows.
    pair.concat(*_prefilled(draft, gen, [7, 2], capacity=12))
    assert pair.cache.batch_size == 5
    pair.propose(gen, 3, 3, [1, 3, 2, 3, 3])
    pair.select([4, 1, 0])  # reordered as well as dropped: packed to the front through a copy
    pair.propose(gen, 1, 3, None)
    # A part with a larger capacity than the storage's is copied in as long as its rows fit.
    pair.concat(*_prefilled(draft, gen, [9], capacity=200))
    pair.propose(gen, 4, 3, [4, 1, 2, 3])
    pair.select([])  # everything finished
    assert pair.cache.batch_size == 0
    pair.concat(*_prefilled(draft, gen, [3, 5], capacity=16))
    for steps in (2, 4, 1):
        pair.propose(gen, steps, 3, _ragged(gen, 2, steps))
    assert runner.eager_calls == 0


@pytest.mark.timeout(120)
def test_adopt_is_idempotent_and_copies_other_storages_in() -> None:
    """Adopting the current cache returns it; a cache adopted by another runner (or an older one of this
    runner, once it is no longer current) is copied in or refused as stale."""
    draft = _draft(seed=5)
    gen = torch.Generator().manual_seed(10)
    first, second = _runner(draft), _runner(draft)
    cache, ref = _prefilled(draft, gen, [4, 6], capacity=24)
    adopted = first.adopt(cache)
    assert first.adopt(adopted) is adopted
    moved = second.adopt(adopted)  # from the other runner: copied, and the source is still current there
    assert moved.storage is second.storage and first.adopt(adopted) is adopted
    _assert_same_cache(moved, ref)
    again = first.adopt(draft.new_cache(1))
    assert again.batch_size == 1
    with pytest.raises(RuntimeError, match="stale"):
        first.adopt(adopted)
    with pytest.raises(RuntimeError, match="stale"):
        first.propose(torch.zeros(2, 1, 3 * AUX), torch.zeros(2, 1, dtype=torch.long), adopted, 3)


@pytest.mark.timeout(120)
def test_extend_between_proposes_keeps_step_with_eager() -> None:
    """Rounds without speculation (extend, rows with nothing new included) between proposes."""
    draft = _draft(seed=6)
    gen = torch.Generator().manual_seed(11)
    runner = _runner(draft)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [3, 7, 5], capacity=30))
    pair.propose(gen, 2, 3, [2, 1, 2])
    pair.extend(gen, 5, [5, 0, 3])
    pair.propose(gen, 3, 3, [1, 3, 2])
    pair.extend(gen, 1, [1, 1, 1])
    pair.extend(gen, 4, [0, 4, 2])
    pair.propose(gen, 2, 3, [2, 2, 1])
    assert runner.eager_calls == 0


# ------------------------------------------------------------------------------------------ limits
@pytest.mark.timeout(120)
def test_capacity_overflow_is_a_clear_error_and_nothing_moves() -> None:
    """The storage never grows: a propose or extend that would write past its capacity raises, naming the
    capacity, and leaves the cache as it was; adopting more rows or longer rows than fit raises too."""
    draft = _draft(seed=7)
    gen = torch.Generator().manual_seed(12)
    runner = _runner(draft, max_rows=2, capacity=12)
    cache = runner.adopt(_prefilled(draft, gen, [6, 4], capacity=12)[0])
    key_ptr = cache.key.data_ptr()
    ids, feats = _inputs(gen, 2, 4)
    # 6 + 4 new positions fit, but 4 drafts after row 0's 6 + 4 would write slot 12.
    with pytest.raises(ValueError, match=r"needs 13 positions per row .* storage holds 12"):
        runner.propose(feats, ids, cache, 4, num_valid=[4, 1])
    wide_ids, wide_feats = _inputs(gen, 2, 7)  # 6 + 7 > 12 before anything is written
    with pytest.raises(ValueError, match=r"adopted into static storage of capacity 12"):
        draft.propose(wide_feats, wide_ids, cache, num_tokens=1)  # eager: reserve refuses to grow
    with pytest.raises(ValueError, match=r"adopted into static storage of capacity 12"):
        runner.extend(wide_feats, wide_ids, cache)
    assert cache.host_lengths == (6, 4) and cache.lengths.tolist() == [6, 4] and cache.key.data_ptr() == key_ptr
    assert runner.propose(feats, ids, cache, 3, num_valid=[4, 1]).shape == (2, 3)  # one draft fewer fits
    assert cache.host_lengths == (10, 5) and runner.eager_calls == 0
    with pytest.raises(ValueError, match=r"3 draft cache rows do not fit static storage of 2 rows"):
        DraftKVCache.concat([cache, draft.new_cache(1)])
    with pytest.raises(ValueError, match=r"holding up to 14 positions does not fit static storage of capacity 12"):
        runner.adopt(_prefilled(draft, gen, [14], capacity=20)[0])


@pytest.mark.timeout(120)
def test_caches_not_adopted_run_eagerly() -> None:
    """An ordinary cache goes through Eagle3Draft.propose: same tokens, nothing captured, not adopted."""
    draft = _draft(seed=8)
    gen = torch.Generator().manual_seed(13)
    runner = _runner(draft)
    cache, ref = _prefilled(draft, gen, [5, 3], capacity=16)
    ids, feats = _inputs(gen, 2, 3)
    got = runner.propose(feats, ids, cache, 3, num_valid=[3, 2])
    assert got.tolist() == draft.propose(feats, ids, ref, num_tokens=3, num_valid=[3, 2]).tolist()
    assert cache.storage is None and runner.graphs == 0 and runner.eager_calls == 1
    _assert_same_cache(cache, ref)
    with pytest.raises(ValueError, match="num_valid"):  # the eager path's own checks still apply
        runner.propose(feats, ids, runner.adopt(cache), 3, num_valid=[0, 2])


@pytest.mark.timeout(120)
def test_a_shape_that_fails_to_capture_warns_once_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture failure (here injected after the warm-up has already advanced the lengths) is warned about
    once, the shape runs eagerly from then on, and the cache is not left advanced twice."""
    draft = _draft(seed=9)
    gen = torch.Generator().manual_seed(14)
    runner = _runner(draft)
    real_body = runner._body

    def failing_body(*args: Any) -> Any:
        body = real_body(*args)

        def run() -> None:
            body()
            raise RuntimeError("operation not permitted when stream is capturing")

        return run

    monkeypatch.setattr(runner, "_body", failing_body)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [4, 6], capacity=24))
    with pytest.warns(RuntimeWarning, match=r"\(B=2, T=2, num_tokens=3\) could not be captured"):
        pair.propose(gen, 2, 3, [2, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pair.propose(gen, 2, 3, [1, 2])
    assert runner.graphs == 0 and runner.eager_calls == 2 and runner.replays == 0


@pytest.mark.timeout(120)
def test_weight_updates_are_captured_again() -> None:
    """An in-place weight update after capture: the runner recaptures and drafts what eager drafts."""
    draft = _draft(seed=10)
    gen = torch.Generator().manual_seed(15)
    runner = _runner(draft)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [4, 6], capacity=24))
    before = pair.propose(gen, 2, 3, [2, 1])
    with torch.no_grad():
        draft.midlayer.self_attn.q_proj.weight.mul_(-3.0)
        draft.lm_head.weight.add_(0.3 * torch.randn(draft.lm_head.weight.shape, generator=gen))
    after = pair.propose(gen, 2, 3, [1, 2])
    assert runner.graphs == 2 and before != after


# ------------------------------------------------------------------------------------------ CUDA
def _engine_like_rounds(device: str, mode: GraphMode) -> DraftGraphRunner:
    """Ragged rounds, extend, select and concat between them, counts as host integers and (on a GPU) as a
    device tensor; every propose checked against eager propose on ordinary caches."""
    draft = _draft(seed=1, device=device)
    gen = torch.Generator().manual_seed(16)
    runner = _runner(draft, mode=mode, capacity=96)
    pair = _Pair(draft, runner, *_prefilled(draft, gen, [6, 3, 8, 5], capacity=30, device=device))
    shapes = set()
    for round_ in range(10):
        steps = 1 + round_ % 4
        pair.propose(gen, steps, 3, None if round_ == 5 else _ragged(gen, 4, steps))
        shapes.add((4, steps, 3))
    pair.extend(gen, 3, [3, 0, 2, 1])
    pair.select([0, 2, 3])
    pair.propose(gen, 2, 3, [2, 1, 2])
    pair.concat(*_prefilled(draft, gen, [7, 2], capacity=12, device=device))
    for steps in (1, 3, 4, 3):
        pair.propose(gen, steps, 3, _ragged(gen, 5, steps))
    # Counts as a tensor on the cache's device: on a GPU used as they are (never read back), and the host
    # lengths become an upper bound; on a CPU they are host integers.
    ids, feats = _inputs(gen, 5, 2, device)
    counts = torch.tensor([2, 1, 1, 2, 2], device=device)
    want = draft.propose(feats, ids, pair.ref, num_tokens=3, num_valid=counts)
    assert runner.propose(feats, ids, pair.cache, 3, num_valid=counts).tolist() == want.tolist()
    assert (pair.cache.host_lengths is None) == (device != "cpu")
    pair.check()
    pair.propose(gen, 2, 3, [1, 2, 2, 1, 2])
    shapes |= {(3, 2, 3), (5, 1, 3), (5, 3, 3), (5, 4, 3), (5, 2, 3)}
    assert runner.graphs == len(shapes) and runner.replays == 17 and runner.eager_calls == 0
    return runner


@pytest.mark.timeout(240)
def test_engine_like_rounds_in_emulation() -> None:
    """The CUDA test's scenario, emulated on the CPU."""
    runner = _engine_like_rounds("cpu", "emulate")
    assert all(c.graph is None and c.body is not None for c in runner._captured.values())


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_drafts_what_eager_drafts() -> None:
    """Real CUDA graphs (one per shape, one shared pool): replay drafts what eager propose drafts."""
    runner = _engine_like_rounds("cuda", "cuda")
    assert all(c.graph is not None for c in runner._captured.values())


# ------------------------------------------------------------------------------------------ timing
def _time_propose(bsz: int, capacity: int, iters: int = 200, k: int = 3, steps: int = 4) -> dict[str, float]:
    """Median ms of one verify-like propose (T = k + 1, ragged counts), eager vs the emulated runner."""
    draft = _draft(seed=1)
    gen = torch.Generator().manual_seed(0)
    base = [60 + 7 * b for b in range(bsz)]
    eager_cache, graph_cache = _prefilled(draft, gen, base, capacity=capacity)
    runner = _runner(draft, capacity=capacity, num_tokens=k)
    graph_cache = runner.adopt(graph_cache)
    ids, feats = _inputs(gen, bsz, steps)
    aux = list(feats.split(AUX, dim=-1))
    counts = [1 + b % steps for b in range(bsz)]
    calls = {
        "eager": (eager_cache, lambda c: draft.propose(aux, ids, c, num_tokens=k, num_valid=counts)),
        "emulate": (graph_cache, lambda c: runner.propose(aux, ids, c, k, num_valid=counts)),
    }
    medians = {}
    for name, (cache, call) in calls.items():
        times = []
        for i in range(iters + 20):
            cache.crop(base)  # every call sees the same lengths
            started = time.perf_counter()
            call(cache)
            if i >= 20:
                times.append((time.perf_counter() - started) * 1e3)
        medians[name] = statistics.median(times)
    assert runner.eager_calls == 0
    return medians


if __name__ == "__main__":  # python tests/test_draft_graph.py: CPU timings, reported (not asserted)
    torch.set_num_threads(1)
    for rows in (1, 8):
        for cap in (128, 1024):
            ms = _time_propose(rows, cap)
            print(f"B={rows} capacity={cap:5d} k=3 T=4: eager {ms['eager']:.3f} ms, emulate {ms['emulate']:.3f} ms")
