"""The benchmarks' run order (``pipespec.bench.run_order``): carry-over balance, for any number of repeats."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pipespec.bench.run_order import balanced_cycle, balanced_order, lead_in, rotation_order


@given(st.integers(1, 7), st.integers(1, 45))
@settings(max_examples=150, deadline=None)
def test_every_repeat_is_a_permutation_and_places_are_balanced(n: int, repeats: int) -> None:
    order = balanced_order(n, repeats)
    assert len(order) == repeats and all(sorted(p) == list(range(n)) for p in order)
    places = Counter((v, i) for perm in order for i, v in enumerate(perm))
    assert max(places.values()) <= math.ceil(repeats / n)
    if repeats % n == 0:
        assert set(places.values()) == {repeats // n} and len(places) == n * n


@given(st.integers(3, 5), st.integers(1, 45))
@settings(max_examples=120, deadline=None)
def test_no_variant_follows_itself_and_predecessors_stay_close(n: int, repeats: int) -> None:
    runs = [v for perm in balanced_order(n, repeats) for v in perm]
    pairs = Counter(zip([lead_in(balanced_order(n, repeats))] + runs, runs))
    assert all(a != b for a, b in pairs)
    counts = [pairs.get((a, b), 0) for a in range(n) for b in range(n) if a != b]
    assert max(counts) - min(counts) <= 3


@given(st.integers(3, 5), st.integers(1, 3))
@settings(max_examples=20, deadline=None)
def test_whole_cycles_balance_every_ordered_pair_exactly_with_the_lead_in(n: int, cycles: int) -> None:
    repeats = cycles * n * (n - 1)
    order = balanced_order(n, repeats)
    runs = [v for perm in order for v in perm]
    pairs = Counter(zip([lead_in(order)] + runs, runs))
    assert len(pairs) == n * (n - 1) and set(pairs.values()) == {cycles * n}, pairs


def test_the_search_finds_a_cycle_for_three_to_five_variants_and_the_rotation_is_the_fallback() -> None:
    for n in (3, 4, 5):
        cycle = balanced_cycle(n)
        assert cycle is not None and len(cycle) == n * (n - 1)
    assert balanced_cycle(2) is None and balanced_cycle(6) is None
    assert balanced_order(6, 4) == rotation_order(6, 4)
    assert rotation_order(3, 4) == [(0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]


def test_the_lead_in_is_never_the_first_variant() -> None:
    for n in range(2, 7):
        for repeats in range(1, 14):
            order = balanced_order(n, repeats)
            assert lead_in(order) != order[0][0]
    assert lead_in([(0,)]) == 0
