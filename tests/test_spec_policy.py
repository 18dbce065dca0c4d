"""``SpecPolicy``: the last stage's speculate-or-not choice, driven by measured tokens per second.

A simulated pipeline (a clock advanced by a per-round cost model, M rounds in flight so a decision
takes effect M rounds later) checks that the policy settles on whichever mode is faster, keeps
probing, and that ``always`` never stops speculating.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipespec.engine.spec_policy import SpecPolicy


def simulate(policy: SpecPolicy, rounds: int, spec_cost: float, spec_tokens: int, plain_cost: float,
             in_flight: int = 2, tokens_per_row: int = 1, draft_cost: float | None = None,
             slow_rounds: int = 0, slow_factor: float = 1.0) -> list[bool]:
    """Run ``rounds`` rounds of one sequence; returns the mode each round ran in. With ``draft_cost`` the
    rounds also report the draft's share of a speculative round (and one row); the first ``slow_rounds``
    rounds cost ``slow_factor`` times as much (a fresh stage's one-time costs)."""
    now = 0.0
    queue: deque[bool] = deque([True] * in_flight)  # modes already decided for rounds in flight
    modes = []
    for i in range(rounds):
        mode = queue.popleft()
        now += (spec_cost if mode else plain_cost) * (slow_factor if i < slow_rounds else 1.0)
        if draft_cost is None:
            policy.record(mode, spec_tokens if mode else tokens_per_row, now)
        else:
            policy.record(mode, spec_tokens if mode else tokens_per_row, now, rows=1, draft_seconds=draft_cost if mode else 0.0)
        queue.append(policy.speculate())
        modes.append(mode)
    return modes


def test_falls_back_to_plain_when_drafting_loses_and_keeps_probing() -> None:
    policy = SpecPolicy("adaptive", window=4, exploit=3, settle=2)
    # Drafting commits 2 tokens per round at 3x the cost: 0.67 tokens per unit vs plain's 1.0.
    modes = simulate(policy, 200, spec_cost=3.0, spec_tokens=2, plain_cost=1.0)
    tail = modes[50:]
    assert tail.count(False) > 0.6 * len(tail)
    assert any(tail), "the policy never probed speculation again"
    assert policy.rates()["plain"] > policy.rates()["speculate"]


def test_keeps_speculating_when_drafting_wins() -> None:
    policy = SpecPolicy("adaptive", window=4, exploit=3, settle=2)
    modes = simulate(policy, 200, spec_cost=1.2, spec_tokens=3, plain_cost=1.0)
    tail = modes[50:]
    assert tail.count(True) > 0.75 * len(tail)
    assert not all(tail), "the policy never measured plain decoding again"


def test_always_speculates_every_round() -> None:
    policy = SpecPolicy("always")
    modes = simulate(policy, 100, spec_cost=10.0, spec_tokens=1, plain_cost=1.0)
    assert all(modes) and policy.switches == 0


def test_prefill_rounds_are_not_measured() -> None:
    policy = SpecPolicy("adaptive", window=2, exploit=1)
    for t in range(20):
        policy.record(True, 5, float(t), prefill=True)
    assert policy.speculate() and policy.rates() == {"speculate": 0.0, "plain": 0.0, "plain_bound": False}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="load_ratio must be > 1"):
        SpecPolicy("adaptive", load_ratio=1.0)
    with pytest.raises(ValueError, match="bound_slack must be >= 1"):
        SpecPolicy("adaptive", bound_slack=0.5)
    with pytest.raises(ValueError, match="unknown speculation policy"):
        SpecPolicy("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        SpecPolicy("adaptive", window=0)
    with pytest.raises(ValueError, match="exploit"):
        SpecPolicy("adaptive", exploit=8, max_exploit=4)


@given(
    spec_cost=st.floats(0.5, 5.0), spec_tokens=st.integers(1, 6), plain_cost=st.floats(0.5, 5.0),
    in_flight=st.integers(1, 4),
)
def test_ends_up_no_slower_than_the_worse_mode_and_close_to_the_better(
    spec_cost: float, spec_tokens: int, plain_cost: float, in_flight: int
) -> None:
    policy = SpecPolicy("adaptive", window=4, exploit=4, settle=in_flight)
    modes = simulate(policy, 400, spec_cost, spec_tokens, plain_cost, in_flight=in_flight)
    tail = modes[100:]
    time = sum(spec_cost if m else plain_cost for m in tail)
    rate = sum(spec_tokens if m else 1 for m in tail) / time
    best, worst = max(spec_tokens / spec_cost, 1 / plain_cost), min(spec_tokens / spec_cost, 1 / plain_cost)
    assert rate >= worst * 0.999
    # Probing costs at most the two measuring windows per cycle; the margin favours speculating.
    assert rate >= best * 0.75


def test_plain_decoding_is_not_probed_when_drafting_beats_its_bound() -> None:
    """Round 1.5 (draft 0.5 of it) committing 6 tokens: plain is estimated at best 1 / (1.5 - 0.5) = 1 token
    per unit, drafting does 4, more than bound_slack (2.5) times that: plain decoding is never run."""
    policy = SpecPolicy("adaptive", window=4)
    modes = simulate(policy, 300, spec_cost=1.5, spec_tokens=6, plain_cost=1.0, draft_cost=0.5)
    assert all(modes) and policy.plain_rounds == 0
    assert policy.rates() == {"speculate": 4.0, "plain": 1.0, "plain_bound": True}


def test_an_estimate_beaten_by_less_than_the_slack_is_checked_by_measuring() -> None:
    """What 2x H200 showed at c = 8 (per row): a round of 3.9 (draft 1.4 of it) commits 2.1 tokens; the
    estimate 1 / 2.5 = 0.4 tokens per unit is beaten (0.54), but plain rounds really cost 1.3 (0.77 per
    unit, above the estimate): plain decoding must be measured, then chosen."""
    policy = SpecPolicy("adaptive", window=4, settle=2)
    modes = simulate(policy, 300, spec_cost=3.9, spec_tokens=2, plain_cost=1.3, draft_cost=1.4)
    assert modes[100:].count(False) > 0.8 * 200
    assert policy.rates()["plain_bound"] is False and policy.rates()["plain"] > policy.rates()["speculate"]


def test_plain_decoding_is_probed_and_chosen_when_the_bound_does_not_rule_it_out() -> None:
    """Round 3 (draft 2.5 of it) committing 2 tokens: the bound (2 per unit) does not exclude plain, whose
    measured 1 token per 0.5 wins."""
    policy = SpecPolicy("adaptive", window=4, settle=2)
    modes = simulate(policy, 300, spec_cost=3.0, spec_tokens=2, plain_cost=0.5, draft_cost=2.5)
    assert modes[100:].count(False) > 0.6 * 200
    assert policy.rates()["plain_bound"] is False


def test_a_change_of_load_restarts_the_measuring() -> None:
    """Full load: drafting commits 2.4 tokens per row at 2.2 the cost of a plain round, and wins. Then
    six of eight sequences finish: the two left accept little (1.2 per row), and plain decoding wins for
    them. The long exploit period decided at full load must not outlive the load it was measured at."""
    policy = SpecPolicy("adaptive", window=4, settle=2, exploit=48, max_exploit=48)
    now, modes, queue = 0.0, [], deque([True, True])
    for i in range(600):
        load = 8 if i < 200 else 2
        mode = queue.popleft()
        per_row = (2.4 if load == 8 else 1.2) if mode else 1.0
        now += 2.2 if mode else 1.0  # launch-bound: a round costs the same whatever the rows
        policy.record(mode, round(per_row * load), now, rows=load, load=load)
        queue.append(policy.speculate())
        modes.append(mode)
    assert modes[20:200].count(True) > 0.8 * 180  # drafting at full load
    # Plain within a few rounds of the drop (measured anew), every round after that; without the load
    # the exploit period measured at full load would keep drafting for ~100 more rounds.
    assert all(not m for m in modes[220:280]) and modes[280:].count(False) > 0.9 * 320
    assert policy.load_changes == 1


def test_small_changes_of_load_wait_for_the_next_cycle() -> None:
    """Sequences finishing one by one (8, 7, 6, 5) change the load by less than 2x: no restart until 4."""
    policy = SpecPolicy("adaptive", window=4)
    now = 0.0
    for i in range(100):
        load = 8 - min(i // 10, 4)  # 8 .. 4
        now += 1.0
        policy.record(True, 2 * load, now, rows=load, load=load)
    assert policy.load_changes == 1  # 8 -> 4 only


@pytest.mark.parametrize("warmup", [0, 6])
def test_warmup_rounds_are_not_measured(warmup: int) -> None:
    """A fresh stage's first rounds are slow (one-time costs): measured, they make drafting lose its first
    window and the policy decodes plainly for the exploit period; left out (``warmup``), it keeps drafting."""
    policy = SpecPolicy("adaptive", window=4, exploit=6, settle=2, warmup=warmup)
    # Drafting: 3 tokens in 1.2 units (2.5x plain's rate) once warm; the first 6 rounds cost 4x.
    modes = simulate(policy, 60, spec_cost=1.2, spec_tokens=3, plain_cost=1.0, slow_rounds=6, slow_factor=4.0)
    plain = modes[:50].count(False)
    if warmup:
        assert plain <= 10  # one plain window (and its settling rounds), then drafting
    else:
        assert plain >= 20  # the slow first window lost: plain for the whole exploit period


def test_warmup_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="warmup"):
        SpecPolicy("adaptive", warmup=-1)
