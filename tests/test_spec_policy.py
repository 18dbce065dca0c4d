"""``SpecPolicy``: the last stage's speculate-or-not choice, driven by measured tokens per second.

A simulated pipeline (a clock advanced by a per-round cost model, M rounds in flight so a decision
takes effect M rounds later) checks that the policy settles on whichever mode is faster, keeps
probing, and that ``always`` never stops speculating. ``replay`` drives it with round costs recorded
from real ``pipespec generate --json`` runs (``policy_trace.rounds``) instead of a cost model: each mode
draws its next round from its own recorded rounds, in order, so the noise of the shared 2-core machine
they were recorded on (intervals of one mode moving 3x from round to round) is in the test.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipespec.engine.spec_policy import SpecPolicy, _Window


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


Round = tuple[int, float, int, float]  # tokens committed, ms since the last round, rows verified, draft ms

# Recorded on the 2-core CPU machine (shared with other agents), demo pair, PP = 2, k = 3, 2026-12-01,
# from ``policy_trace.rounds`` of `pipespec generate --json --spec-policy adaptive` runs (full-load rounds).
# c = 1, one micro-batch: drafting commits ~3 tokens a round, plain decoding 1 in a similar time.
C1_SPEC: list[Round] = [(4, 32, 1, 10), (2, 43, 1, 14), (4, 31, 1, 2), (4, 31, 1, 14), (3, 34, 1, 10), (2, 41, 1, 10),
                        (4, 46, 1, 10), (1, 36, 1, 11), (1, 32, 1, 8), (4, 28, 1, 15), (2, 44, 1, 2), (4, 40, 1, 2),
                        (3, 28, 1, 10), (4, 44, 1, 2), (4, 26, 1, 9), (2, 40, 1, 6)]
C1_PLAIN: list[Round] = [(1, 51, 1, 0), (1, 46, 1, 0), (1, 49, 1, 0), (1, 57, 1, 0), (1, 24, 1, 0), (1, 35, 1, 0)]
# c = 8, one micro-batch, a random draft (bench/pipeline_microbatches.py's CPU shape): nothing is accepted,
# so a drafting round commits what a plain one does at about twice its cost (the draft, 4 positions).
R8_SPEC: list[Round] = [(8, 125.9, 8, 22.8), (8, 107.4, 8, 28.4), (8, 130.1, 8, 39.5), (8, 93.4, 8, 32.0),
                        (8, 96.4, 8, 16.1), (8, 71.8, 8, 22.6), (8, 68.0, 8, 19.0), (8, 48.1, 8, 0.1),
                        (8, 132.2, 8, 32.5), (8, 137.9, 8, 10.5), (8, 123.8, 8, 31.1), (8, 122.1, 8, 2.8),
                        (8, 95.9, 8, 23.7), (8, 110.6, 8, 0.1)]
R8_PLAIN: list[Round] = [(8, 28.0, 8, 0.1), (8, 40.0, 8, 0.1), (8, 67.9, 8, 0.1), (8, 56.4, 8, 0.1), (8, 23.7, 8, 0.1),
                         (8, 106.1, 8, 22.7), (8, 71.3, 8, 0.1), (8, 77.9, 8, 0.1), (8, 46.2, 8, 0.1), (8, 34.1, 8, 0.0),
                         (8, 61.9, 8, 0.1), (8, 52.2, 8, 0.1), (8, 80.3, 8, 20.7), (8, 59.6, 8, 0.0), (8, 69.8, 8, 0.0),
                         (8, 70.2, 8, 0.1)]
WINS = {True: C1_SPEC, False: C1_PLAIN}
LOSES = {True: R8_SPEC, False: R8_PLAIN}


def replay(policy: SpecPolicy, costs: dict[bool, list[Round]], rounds: int, in_flight: int = 1,
           change_at: int | None = None, after: dict[bool, list[Round]] | None = None) -> tuple[list[bool], float]:
    """Run ``rounds`` rounds on recorded costs (``after`` from round ``change_at`` on): the mode each round
    ran in, and the tokens per second of the whole run."""
    now, tokens = 0.0, 0
    queue: deque[bool] = deque([True] * in_flight)
    drawn = {True: 0, False: 0}
    modes = []
    for i in range(rounds):
        mode = queue.popleft()
        table = (after if after is not None and change_at is not None and i >= change_at else costs)[mode]
        got, ms, rows, draft_ms = table[drawn[mode] % len(table)]
        drawn[mode] += 1
        now += ms / 1e3
        tokens += got
        policy.record(mode, got, now, rows=rows, draft_seconds=draft_ms / 1e3, load=rows * in_flight)
        queue.append(policy.speculate())
        modes.append(mode)
    return modes, tokens / now


def plain_stretches(modes: list[bool]) -> list[str]:
    """The runs of consecutive plain rounds in ``modes``, one "p" per round ("" between adjacent drafting rounds)."""
    return "".join("p" if not m else "S" for m in modes).split("S")


def fixed_rate(costs: dict[bool, list[Round]], mode: bool, rounds: int) -> float:
    """Tokens per second of ``rounds`` rounds all in ``mode`` (what ``always`` / ``--num-spec-tokens 0`` get)."""
    table = costs[mode]
    picked = [table[i % len(table)] for i in range(rounds)]
    return sum(r[0] for r in picked) / sum(r[1] / 1e3 for r in picked)


def test_falls_back_to_plain_when_drafting_loses_and_keeps_probing() -> None:
    policy = SpecPolicy("adaptive", window=4, exploit=3, max_exploit=6, settle=2)
    # Drafting commits 2 tokens per round at 3x the cost: 0.67 tokens per unit vs plain's 1.0.
    modes = simulate(policy, 600, spec_cost=3.0, spec_tokens=2, plain_cost=1.0)
    tail = modes[50:]
    assert tail.count(False) > 0.6 * len(tail)
    assert any(tail), "the policy never probed speculation again"
    assert policy.rates()["plain"] > policy.rates()["speculate"]


def test_keeps_speculating_when_drafting_wins() -> None:
    policy = SpecPolicy("adaptive", window=4, exploit=3, max_exploit=6, settle=2)
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
    assert all(not m for m in modes[230:280]) and modes[280:].count(False) > 0.9 * 320
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


@pytest.mark.parametrize(("warmup", "slow_factor"), [(0, 4.0), (6, 4.0), (0, 8.0), (6, 8.0)])
def test_a_slow_start_is_not_measured(warmup: int, slow_factor: float) -> None:
    """A fresh stage's first rounds are slow (one-time costs: 1.6x a steady round on the 2-core CPU for
    its first 5). Left out (``warmup``), they do not count: the policy keeps drafting, which wins 2.5x.
    Measured, they make drafting's first block look slower than plain decoding's. By 1.6x (4x rounds), the
    first decision's switch waits for the bracketing block of drafting, which runs warm, and drafting is
    kept; by 3.2x (8x rounds: wider than a stall is taken for, ``_bracket_first_switch``) plain decoding is
    chosen at once, for the whole exploit period."""
    policy = SpecPolicy("adaptive", window=4, exploit=6, settle=2, warmup=warmup)
    # Drafting: 3 tokens in 1.2 units (2.5x plain's rate) once warm; the first 6 rounds cost ``slow_factor``x.
    modes = simulate(policy, 60, spec_cost=1.2, spec_tokens=3, plain_cost=1.0, slow_rounds=6, slow_factor=slow_factor)
    plain = modes[:50].count(False)
    first = policy.trace()["trace"][0]["reason"]
    if warmup or slow_factor == 4.0:
        assert plain <= 10 and first == "drafting measured faster"  # one plain block (and its settling rounds)
    else:
        assert plain >= 20 and first == "plain decoding measured faster"  # the slow first block lost


def test_warmup_rounds_are_not_measured() -> None:
    policy = SpecPolicy("adaptive", window=1, warmup=5)
    for t in range(6):  # the first round only sets the clock; five more are the warm-up
        policy.record(True, 3, float(t))
    assert policy.trace()["decisions"] == 0 and policy.speculate()
    for t in range(6, 11):  # a block of drafting, one of plain, one of drafting (each after a settling round)
        policy.record(policy.speculate(), 3 if policy.speculate() else 1, float(t))
    assert policy.trace()["decisions"] == 1


def test_warmup_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="warmup"):
        SpecPolicy("adaptive", warmup=-1)


def worker_policy(micro_batches: int = 1) -> SpecPolicy:
    """The policy as the worker builds it on the last stage."""
    return SpecPolicy("adaptive", settle=1, warmup=3 * micro_batches)


def test_recorded_trace_where_drafting_wins() -> None:
    """c = 1 on the demo pair: drafting commits ~3 tokens a round. Drafting mostly beats plain decoding's
    estimated best by more than the few-rows slack, so plain decoding is seldom run (a block of low
    acceptance brings the estimate close, and one plain block is measured, 3.5x slower)."""
    policy = worker_policy()
    modes, rate = replay(policy, WINS, 200)
    best = max(fixed_rate(WINS, True, 200), fixed_rate(WINS, False, 200))
    assert rate >= 0.97 * best
    assert modes.count(False) <= 10 and policy.spec_rounds >= 190
    assert policy.trace()["trace"][0]["reason"].startswith("drafting beats plain decoding's estimated best by 1.5x")


def test_recorded_trace_where_drafting_loses() -> None:
    """c = 8 with a random draft: the policy measures drafting, plain decoding and drafting again (the first
    drafting window was 1.65x slower than plain decoding's, within what a stall could do: the first
    decision's switch waits for the bracket, ``_bracket_first_switch``), then decodes plainly. Its cost,
    those two drafting blocks, is 3.4 % of a 300-round run of plain decoding (1.5 % with one block, before
    the bracket) and 1.1 % of a 900-round one."""
    policy = worker_policy()
    modes, rate = replay(policy, LOSES, 300)
    plain = fixed_rate(LOSES, False, 300)
    assert rate >= 0.96 * max(plain, fixed_rate(LOSES, True, 300))
    modes, rate = replay(worker_policy(), LOSES, 900)
    assert rate >= 0.985 * fixed_rate(LOSES, False, 900)
    assert modes[40:].count(False) >= 0.97 * len(modes[40:])
    decisions = policy.trace()["trace"]
    assert decisions[0]["mode"] == "plain" and decisions[0]["reason"] == "plain decoding measured faster"
    assert decisions[0]["plain_tps"] > decisions[0]["speculate_tps"]


@pytest.mark.parametrize("with_load", [True, False])
def test_recorded_trace_that_changes_midway(with_load: bool) -> None:
    """120 rounds where drafting wins, then rounds where it loses (from c = 1 on the demo pair to the random
    draft's c = 8 costs, as when seven requests arrive with text the draft cannot predict). With the load
    reported the change restarts the measuring at once; without it the next measuring cycle finds it —
    after at most ``max_exploit`` times the loser's cost of the last cycle."""
    policy = worker_policy()
    now, modes, queue = 0.0, [], deque([True])
    drawn = {True: 0, False: 0}
    for i in range(600):
        table = (WINS if i < 120 else LOSES)[queue[0]]
        mode = queue.popleft()
        got, ms, rows, draft_ms = table[drawn[mode] % len(table)]
        drawn[mode] += 1
        now += ms / 1e3
        policy.record(mode, got, now, rows=rows, draft_seconds=draft_ms / 1e3, load=rows if with_load else None)
        queue.append(policy.speculate())
        modes.append(mode)
    assert modes[10:120].count(True) >= 100  # drafting while it wins (a plain block at most)
    first_plain = modes.index(False, 120)
    assert first_plain <= (140 if with_load else 400)
    assert modes[first_plain + 20 :].count(False) >= 0.95 * len(modes[first_plain + 20 :])
    reasons = [d["reason"] for d in policy.trace()["trace"]]
    assert "plain decoding measured faster (switched)" in reasons or "plain decoding measured faster" in reasons
    if with_load:
        assert any(r.startswith("load 1 -> 8") for r in reasons)


def test_the_trace_reports_rounds_per_mode_and_every_round() -> None:
    policy = worker_policy()
    replay(policy, LOSES, 60)
    trace = policy.trace()
    assert trace["spec_rounds"] + trace["plain_rounds"] == 60 == len(trace["rounds"])
    assert trace["switches"] == policy.switches >= 1 and trace["decisions"] == len(trace["trace"])
    assert all(len(r) == 7 for r in trace["rounds"])


# Recorded on one H200 (CUDA graphs, bf16, PP = 1, demo pair, k = 3, c = 1), 2026-12-01, from
# ``policy_trace.rounds`` of `bench/p3_speedup.py --device cuda --pp 1`: rounds of ~2 ms, the draft ~0.5 ms.
# Acceptance swings: the 4-round window [2, 1, 1, 4] commits 8 tokens, 1.5x the estimate only just.
G1_SPEC: list[Round] = [(4, 1.80, 1, 0.43), (4, 1.90, 1, 0.42), (4, 1.76, 1, 0.43), (4, 1.85, 1, 0.47),
                        (2, 2.04, 1, 0.51), (1, 2.05, 1, 0.64), (1, 2.09, 1, 0.48), (4, 2.08, 1, 0.52),
                        (4, 2.04, 1, 0.50), (2, 2.07, 1, 0.51), (1, 1.85, 1, 0.43), (1, 2.05, 1, 0.61),
                        (4, 2.18, 1, 0.55), (4, 2.02, 1, 0.49), (3, 1.83, 1, 0.45), (4, 2.00, 1, 0.49)]
G1_PLAIN: list[Round] = [(1, 1.53, 1, 0.06), (1, 1.40, 1, 0.05), (1, 1.56, 1, 0.06), (1, 1.46, 1, 0.04), (1, 1.31, 1, 0.04)]


def test_a_window_of_low_acceptance_does_not_send_it_to_plain_decoding() -> None:
    """One 4-round window of drafting that only just beats the estimate is pooled with the next ones
    (``bound_windows``) before plain decoding is run to check: at c = 1 drafting wins by 2.5x here."""
    costs = {True: G1_SPEC, False: G1_PLAIN}
    modes, rate = replay(SpecPolicy("adaptive", window=4), costs, 300)
    assert modes.count(False) == 0
    assert rate >= 0.97 * max(fixed_rate(costs, True, 300), fixed_rate(costs, False, 300))
    pooled_off = SpecPolicy("adaptive", window=4, bound_windows=1)  # a single window decides
    modes_off, _ = replay(pooled_off, costs, 300)
    assert modes_off.count(False) > 0  # the test can fail: without pooling the window sends it to plain


def test_a_window_of_low_acceptance_is_judged_with_the_drafting_just_before() -> None:
    """c = 1, drafting 3.1 tokens a round at 2.2 ms against plain decoding's 1 token at 1.7 ms (one H200's
    figures, 2026-12-02), but 8 rounds in every 32 accept nothing: a 4-round window there alone falls below
    plain decoding's estimated best (4 tokens in 8.8 ms against 1 per 1.6 ms), and measuring plain
    decoding for such a window cost ~5 % at c = 1 there. Judged together with the drafting rounds just
    before it (16 rounds in all), the figure is drafting's (1.8x the estimate or more): plain is never run."""
    pattern = [4, 4, 4, 4, 3, 4, 4, 4, 4, 3, 4, 4] * 2 + [1] * 8
    policy = worker_policy()
    now, drafted, modes = 0.0, 0, []
    mode = True
    for _ in range(400):
        got = pattern[drafted % len(pattern)] if mode else 1
        drafted += mode
        now += (2.2 if mode else 1.7) / 1e3
        policy.record(mode, got, now, rows=1, draft_seconds=0.6e-3 if mode else 0.0, load=1)
        modes.append(mode)
        mode = policy.speculate()
    bad = _window_rate([1, 1, 1, 1], 2.2)
    assert bad < 1 / 1.6e-3  # the premise: a bad window alone is below plain decoding's estimate
    assert modes.count(False) == 0
    assert policy.trace()["decisions"] == 1


def _window_rate(tokens: list[int], ms: float) -> float:
    return sum(tokens) / (len(tokens) * ms / 1e3)


# A fixed batch draining (the bench's --ignore-eos runs): every sequence needs the same number of tokens,
# drafting commits each sequence's own acceptance per round, so the sequences finish at different rounds
# and the running rows shrink 8 -> 4 -> 2 -> 1 over the last third of the run. Round costs are a model of
# one H200 at PP = 1 with CUDA graphs (launch- and weights-bound: a plain round 1.48 ms at 1 row, 2.0 ms
# at 8; a drafting round 2.11 ms at 1 row, 3.23 ms at 8, 0.5 ms of it the draft's; the first drafting
# round after plain ones also ingests their positions into the draft, 1 ms more), the figures behind
# issue 16's c = 8 miss (there: 153 rounds, 19 of them plain, 6 switches; this model under the policy
# before the load check: 164 rounds, 17 plain, 6 switches).
def plain_ms(rows: int) -> float:
    return 1.40 + 0.075 * rows


def spec_ms(rows: int) -> float:
    return 1.95 + 0.16 * rows


CATCH_UP_MS = 1.0

# Tokens committed per drafting round (accepted drafts + 1), per sequence, repeating: the well-predicted
# sequences finish first, the ones left in the tail accept least (3.4 ... 1.6 tokens per round).
ACCEPTANCE: list[list[int]] = [[4, 3, 4, 3, 3], [3, 3, 4, 3], [3, 2, 3, 3], [2, 3, 2, 3], [2, 2, 2, 3],
                               [2, 2, 2, 2, 2, 2, 3, 2, 2, 2], [2, 1, 2, 2], [2, 1, 2, 1, 2, 2, 2, 1]]


def drain(policy: SpecPolicy, need: int = 256, acceptance: list[list[int]] = ACCEPTANCE,
          tail_acceptance: list[int] | None = None, costs: tuple[Callable[[int], float], Callable[[int], float],
                                                                 Callable[[int], float]] | None = None,
          told: bool = False) -> tuple[list[bool], list[int], float]:
    """Run one fixed batch to its end, one round in flight (PP = 1): the mode and the running rows of every
    round, and the tokens per second of the whole run. ``tail_acceptance``: what every sequence commits
    per drafting round once half of them have finished. ``costs``: (plain round ms, drafting round ms,
    the draft's ms in it) by running rows, instead of the H200 model below. ``told``: the policy is told
    every row's tokens left, and that no request waits (as the engine tells it)."""
    plain_cost, spec_cost, draft_cost = costs or (plain_ms, spec_ms, lambda rows: 0.5)
    left = [need] * len(acceptance)
    steps = [0] * len(acceptance)
    now, tokens, modes, loads = 0.0, 0, [], []
    mode = True
    while any(left):
        rows = [i for i, n in enumerate(left) if n]
        half_done = len(rows) <= len(acceptance) // 2
        got, per_row = 0, []
        for i in rows:
            pattern = tail_acceptance if tail_acceptance is not None and half_done else acceptance[i]
            take = min(left[i], pattern[steps[i] % len(pattern)] if mode else 1)
            steps[i] += mode
            left[i] -= take
            got += take
            per_row.append((i, take, left[i]))
        catch_up = CATCH_UP_MS if mode and modes and not modes[-1] else 0.0
        now += ((spec_cost(len(rows)) + catch_up) if mode else plain_cost(len(rows))) / 1e3
        tokens += got
        modes.append(mode)
        loads.append(len(rows))
        policy.record(mode, got, now, rows=len(rows), draft_seconds=(draft_cost(len(rows)) + catch_up) * 1e-3 if mode else 0.0,
                      load=sum(1 for n in left if n), per_row=per_row if told else None, queued=0 if told else None)
        mode = policy.speculate()
    return modes, loads, tokens / now


def test_a_draining_batch_does_not_measure_plain_decoding_at_every_halving() -> None:
    """Drafting wins at every load of the drain (1.4x per round at 8 rows). The policy measures plain
    decoding once, at full load, and keeps the round-cost ratio it found there (1.6); when the rows halve,
    drafting's acceptance in the tail (1.9 and 1.7 tokens per row and round) still beats that ratio, so
    the halvings to 4 and 2 rows are settled by drafting's own rounds: no plain round there (before the
    check: 12 more plain rounds and 4 more switches in the tail), and the run within 3 % of ``always``.
    The last row accepts 1.5, short of the carried ratio (an upper bound: 1.43 at one row), so plain
    decoding is measured once more there, one block."""
    policy = worker_policy()
    modes, loads, rate = drain(policy)
    _, _, always = drain(SpecPolicy("always"))
    plain = 8 * 256 / (256 * plain_ms(8) / 1e3)  # --num-spec-tokens 0: 256 rounds of all 8 rows
    assert always > 1.1 * plain  # the premise: drafting wins the whole run (1.14x)
    assert rate >= 0.97 * max(always, plain)
    first_cycle = next(i for i, load in enumerate(loads) if load < 8)
    # At most one plain block (and its settling round) in the tail: the periodic re-measuring, or the last row.
    assert sum(not m for m in modes[first_cycle:]) <= policy.window + 1
    trace = policy.trace()
    decisions = trace["trace"]
    for checking, settled in zip(decisions, decisions[1:]):
        if checking["reason"].startswith(("load 8 -> 4", "load 4 -> 2")):
            assert settled["reason"].endswith("plain not run"), "plain decoding was measured again at 4 or 2 rows"
    assert policy.load_checks >= 2
    assert not any(d["reason"].endswith("measuring again") for d in trace["trace"])
    assert "8" in trace["ratios"] and 1.4 < trace["ratios"]["8"] < 1.8
    assert any(d["reason"].startswith("drafting's acceptance beats the round-cost ratio measured at load 8")
               for d in trace["trace"])


def test_a_draining_batch_whose_tail_accepts_little_measures_plain_there() -> None:
    """The same drain, but once half the sequences are done the rest accept nothing (1 token per drafting
    round, below the ratio carried from full load): the check fails, plain decoding is measured at the new
    load, wins, and runs the tail."""
    policy = worker_policy()
    modes, loads, rate = drain(policy, tail_acceptance=[1])
    _, _, always = drain(SpecPolicy("always"), tail_acceptance=[1])
    half = next(i for i, load in enumerate(loads) if load <= 4)
    assert modes[:half].count(True) >= 0.9 * half  # drafting while it wins
    assert modes.index(False, half) <= half + policy.window + 1  # one drafting window, then plain measured
    tail = modes[half + 10:]
    assert tail and tail.count(False) >= 0.6 * len(tail)  # plain, with a measuring cycle per halving
    decisions = policy.trace()["trace"]
    check = next(i for i, d in enumerate(decisions) if d["reason"].startswith("load 8 -> 4 running sequences: checking"))
    assert decisions[check + 1]["reason"].startswith("drafting's acceptance 1.00 does not beat the round-cost ratio")
    assert decisions[check + 2]["reason"] == "plain decoding measured faster (switched)"
    assert policy.load_checks == 0
    assert rate >= 1.03 * always  # plain for the tail beats drafting it


# The 2-core CPU machine, demo pair, PP = 2, c = 8 (bench/p3_speedup.py, 2026-12-02, quiet machine): a plain
# round 5.4 ms at 8 rows, a drafting round 11.3 ms at 8 rows (2.2 ms of it the draft's) and 8.6-9.2 ms at 4;
# the sequences left at 4 rows commit ~1.45 tokens a drafting round. Drafting wins at full load (1.3x), loses
# the tail, and is still ahead of plain decoding's *estimate* there (the round less the draft's time).
def cpu_plain_ms(rows: int) -> float:
    return 4.6 + 0.1 * rows


def cpu_spec_ms(rows: int) -> float:
    return 6.0 + 0.66 * rows


def cpu_draft_ms(rows: int) -> float:
    return 1.0 + 0.15 * rows


def test_a_failed_load_check_measures_plain_decoding_at_once() -> None:
    """The check at 8 -> 4 rows fails (τ 1.4 against the ratio 2.1 carried from full load), while drafting is
    ahead of plain decoding's estimate at 4 rows (the round less the draft: 5.7 tokens per 7 ms against 4).
    Plain decoding is then measured in the next round, not after up to 4 more windows of drafting pooled
    for the estimate (as before, on the CPU: 17 rounds of drafting to the end of the batch), and wins the
    tail."""
    policy = worker_policy()
    acceptance = [[4, 3, 3, 4, 3]] * 4 + [[2, 1, 1, 2, 1, 2, 1]] * 4
    costs = (cpu_plain_ms, cpu_spec_ms, cpu_draft_ms)
    modes, loads, rate = drain(policy, need=96, acceptance=acceptance, costs=costs)
    _, _, always = drain(SpecPolicy("always"), need=96, acceptance=acceptance, costs=costs)
    decisions = policy.trace()["trace"]
    assert decisions[0]["reason"] == "drafting measured faster"  # at full load, rows' finish not told
    failed = next(d for d in decisions if d["reason"].startswith("drafting's acceptance 1."))
    assert failed["reason"].endswith("measuring plain") and failed["ratio"] > 1.8
    assert modes[failed["round"]] is False, "drafting kept after the check failed"  # the next round is plain
    tail = [m for m, load in zip(modes, loads) if load == 4]
    assert tail.count(False) >= 0.8 * len(tail)
    assert rate >= 1.05 * always


def test_told_the_rows_finish_a_cpu_batch_whose_slow_rows_set_it_is_decoded_plainly() -> None:
    """The same batch at 256 tokens, the policy told each row's tokens left and that no request waits:
    drafting's 1.15x at full load is worth 0.7x for the batch's finish (its 4 slow rows get 1.4 tokens per
    11.3 ms round against 1 per 5.4 ms plain), so its first decision is plain decoding, and the run is
    within 4 % of the better fixed choice (plain decoding, 1.26x ``always``; what is lost is the first
    cycle's 13 drafting rounds and one drafting block measured when the rows halve), where told nothing
    it loses 14 %."""
    acceptance = [[4, 3, 3, 4, 3]] * 4 + [[2, 1, 1, 2, 1, 2, 1]] * 4
    costs = (cpu_plain_ms, cpu_spec_ms, cpu_draft_ms)
    _, _, always = drain(SpecPolicy("always"), acceptance=acceptance, costs=costs)
    plain = 8 * 256 / (256 * cpu_plain_ms(8) / 1e3)
    policy = worker_policy()
    _, _, rate = drain(policy, acceptance=acceptance, costs=costs, told=True)
    _, _, blind = drain(worker_policy(), acceptance=acceptance, costs=costs)
    assert plain > 1.2 * always  # the premise: drafting loses the batch's finish
    assert rate >= 0.96 * max(always, plain) and blind < 0.9 * plain
    first = policy.trace()["trace"][0]
    assert first["mode"] == "plain" and first["finish_scale"] < 0.75


# One H200, PP = 1, CUDA graphs, c = 32 (docs/benchmarks.md, 2026-12-02): a plain round costs about the same at
# any load (2.9-3.4 ms: launch-bound), while a drafting round cost 4.5 ms at full load and 6.3-7.1 ms in the
# tail. The ratio measured at full load (1.3) is then no bound in the tail.
def gpu_plain_ms(rows: int) -> float:
    return 2.9 + 0.015 * rows


def gpu_spec_ms(rows: int) -> float:
    return 4.5 if rows > 16 else 6.6


def test_a_tail_whose_drafting_rounds_got_dearer_measures_plain_there() -> None:
    """The drafting round got dearer as the rows left, and the tail's acceptance (1.6-1.75 tokens per row and
    round) still beats the ratio carried from full load (1.3): only the check of drafting's round time now
    against a plain round at full load (6.6 / 3.4 ms) sees that plain decoding wins the tail."""
    policy = worker_policy()
    acceptance = [[4, 3, 4, 3, 3]] * 16 + [[2, 2, 1, 2, 1]] * 16
    now, tokens, modes, loads = 0.0, 0, [], []
    left, steps, mode = [256] * 32, [0] * 32, True
    while any(left):
        rows = [i for i, n in enumerate(left) if n]
        got = 0
        for i in rows:
            pattern = [2, 2, 1, 2, 1] if len(rows) <= 16 else acceptance[i]
            take = min(left[i], pattern[steps[i] % len(pattern)] if mode else 1)
            steps[i] += mode
            left[i] -= take
            got += take
        now += (gpu_spec_ms(len(rows)) if mode else gpu_plain_ms(len(rows))) / 1e3
        tokens += got
        modes.append(mode)
        loads.append(len(rows))
        policy.record(mode, got, now, rows=len(rows), draft_seconds=1e-3 if mode else 0.0,
                      load=sum(1 for n in left if n))
        mode = policy.speculate()
    tail = [m for m, load in zip(modes, loads) if load <= 16]
    assert tail.count(False) >= 0.8 * len(tail), "drafting kept in the tail it loses"
    reasons = [d["reason"] for d in policy.trace()["trace"]]
    assert any(r.startswith("drafting's acceptance 1.") and "does not beat the round-cost ratio 1.9" in r for r in reasons)
    assert "16" not in policy.trace()["ratios"] or policy.trace()["ratios"]["16"] > 1.6


def finish_drain(policy: SpecPolicy, hard_rows: int, queued: int | None = 0) -> tuple[list[bool], float]:
    """32 sequences of 256 tokens in one micro-batch: ``32 - hard_rows`` accept well (3.4 tokens per drafting
    round), ``hard_rows`` accept nothing; a drafting round costs 3.5 ms at 32 rows and less as rows finish,
    a plain round 2.6 ms (one H200's figures at c = 32, 2026-12-02). The policy is told every row's tokens
    left and the requests waiting (``queued``; None: not told)."""
    easy = [4, 3, 4, 3, 3]
    left, steps, now, mode, modes = [256] * 32, [0] * 32, 0.0, True, []
    while any(left):
        rows = [i for i in range(32) if left[i]]
        got, per_row = 0, []
        for i in rows:
            pattern = [1] if i >= 32 - hard_rows else easy
            take = min(left[i], pattern[steps[i] % len(pattern)] if mode else 1)
            steps[i] += mode
            left[i] -= take
            got += take
            per_row.append((i, take, left[i]))
        now += ((2.5 + len(rows) / 32) if mode else (2.3 + 0.3 * len(rows) / 32)) / 1e3
        modes.append(mode)
        policy.record(mode, got, now, rows=len(rows), draft_seconds=0.8e-3 if mode else 0.0,
                      load=sum(1 for n in left if n), per_row=per_row if queued is not None else None, queued=queued)
        mode = policy.speculate()
    return modes, 32 * 256 / now


def test_with_no_request_waiting_the_batch_finish_decides() -> None:
    """Drafting commits 2.7 tokens per row and round at full load, 1.6x plain decoding's tokens/s, but 8 rows
    accept nothing and set when the batch finishes: drafted, they advance one token per 3.5 ms round
    instead of per 2.6 ms. With the rows' tokens left known and no request waiting, the first decision
    compares the batch's finish (drafting's figure scaled by the slowest row's acceptance over the mean)
    and decodes plainly; told nothing, it drafts at full load for ~70 rounds."""
    _, always = finish_drain(SpecPolicy("always"), 8)
    plain = 32 * 256 / (256 * (2.3 + 0.3) / 1e3)
    assert always < 0.9 * plain  # the premise: drafting loses the batch's finish
    policy = worker_policy()
    modes, rate = finish_drain(policy, 8)
    assert rate >= 0.97 * max(always, plain)
    first = policy.trace()["trace"][0]
    assert first["mode"] == "plain" and first["finish_scale"] < 0.5
    blind_modes, blind = finish_drain(worker_policy(), 8, queued=None)
    assert rate > blind and modes.count(False) > blind_modes.count(False) + 30


def test_requests_waiting_for_a_slot_keep_the_throughput_view() -> None:
    """The same batch with requests waiting for a slot: a finished row takes the next request, so the
    tokens/s of the round is what counts, and drafting (1.6x) is chosen."""
    policy = worker_policy()
    finish_drain(policy, 8, queued=3)
    first = policy.trace()["trace"][0]
    assert first["mode"] == "speculate" and "finish_scale" not in first


def test_a_load_above_every_measured_one_is_measured_afresh() -> None:
    """Load grows past what was measured (new requests arriving): the carried ratio is no bound there
    (more rows make drafting's extra positions dearer), so both modes are measured again."""
    policy = SpecPolicy("adaptive", window=4, settle=1)
    now = 0.0
    queue = True
    for i in range(400):
        load = 2 if i < 150 else 8
        now += (spec_ms(load) if queue else plain_ms(load)) / 1e3
        policy.record(queue, (2 * load) if queue else load, now, rows=load, draft_seconds=0.5e-3 if queue else 0.0,
                      load=load)
        queue = policy.speculate()
    assert policy.carried_ratio(2) is not None and policy.carried_ratio(8) is not None
    assert policy.load_checks == 0 and policy.load_changes == 1
    reasons = [d["reason"] for d in policy.trace()["trace"]]
    assert "load 2 -> 8 running sequences: measuring again" in reasons


# The 2-core CPU at c = 32 on the demo pair (bench/results/cpu-2026-12-02e, PP = 2, two micro-batches of 16):
# a drafting round 8.7 ms (2.5 ms of it the draft's), a plain one 3.6 ms, ~3.1-3.3 tokens per row and round
# for every row alike; drafting (``always``) ran 1.27x plain decoding. Modelled as one batch of 32 rows.
def alike_spec_ms(rows: int) -> float:
    return 1.0 + 0.24 * rows


def alike_plain_ms(rows: int) -> float:
    return 0.6 + 0.094 * rows


def alike_draft_ms(rows: int) -> float:
    return 0.3 + 0.07 * rows


def test_rows_that_accept_alike_are_not_judged_by_the_noisiest_one() -> None:
    """Every row draws its acceptance from the same 10 rounds (mean 3.3), in its own order: after a few drafting
    rounds the rows' means differ only by noise. The finish view keeps drafting, within 3 % of the better fixed
    choice. (With one batch each row has ~11 drafting rounds at the first decision, so the raw means were
    close enough here before too; the engine's two micro-batches gave 6, the case of the next test.)"""
    rng = random.Random(5)
    base = [4, 4, 4, 3, 4, 2, 4, 1, 3, 4]
    acceptance = [rng.sample(base, len(base)) for _ in range(32)]
    costs = (alike_plain_ms, alike_spec_ms, alike_draft_ms)
    _, _, always = drain(SpecPolicy("always"), acceptance=acceptance, costs=costs)
    plain = 32 * 256 / (256 * alike_plain_ms(32) / 1e3)
    assert always > 1.2 * plain  # the premise: drafting wins the batch's finish too
    policy = worker_policy()
    _, _, rate = drain(policy, acceptance=acceptance, costs=costs, told=True)
    assert rate >= 0.97 * max(always, plain)
    first = policy.trace()["trace"][0]
    assert first["mode"] == "speculate" and first.get("finish_scale", 1.0) > 0.85


def test_row_acceptance_keeps_a_real_spread_and_removes_noise() -> None:
    """Half the rows accept 4 every round, half 1-2: the spread is real (no noise within rows to explain it),
    so the estimates stay apart. 32 rows alike but for the order of their draws, 6 drafting rounds each (what
    a row had at the first decision on the CPU at c = 32 with two micro-batches): the finish scale stays near 1
    (the slowest raw mean, shrunk by one round as before, said ~0.6)."""
    policy = SpecPolicy("adaptive")
    for _ in range(6):
        policy._track_rows(True, [(r, 4 if r < 4 else 1 + (r % 2), 100) for r in range(8)])
    est = policy.row_acceptance(2.75)
    assert min(est[r] for r in range(4)) > 3.5 and max(est[r] for r in range(4, 8)) < 2.2
    alike = SpecPolicy("adaptive")
    alike._queued = 0
    rng = random.Random(1)
    draws = [[rng.choice([1, 2, 3, 4, 4, 4]) for _ in range(6)] for _ in range(32)]
    for i in range(6):
        alike._track_rows(True, [(r, draws[r][i], 90) for r in range(32)])
    tau = sum(map(sum, draws)) / (6 * 32)
    raw_slowest = min((sum(0.9 ** (5 - i) * d[i] for i in range(6)) + tau) /
                      (sum(0.9 ** (5 - i) for i in range(6)) + 1) for d in draws)
    assert raw_slowest / tau < 0.8  # the premise: the noisiest row alone says drafting loses a fifth or more
    window = _Window(tokens=sum(map(sum, draws)), rows=6 * 32, intervals=[0.01] * 6)
    assert alike.finish_scale(window) > 0.9


# c = 8 on the demo pair, PP = 2 with 2 micro-batches of 4 rows (the CPU P3 row), 2026-12-02, from
# ``policy_trace.rounds`` of one adaptive run: its first drafting window and its first plain block.
C8_SPEC: list[Round] = [(11, 8.108, 4, 2.531), (8, 7.822, 4, 2.324), (14, 7.923, 4, 2.382), (13, 7.81, 4, 2.427),
                        (14, 7.927, 4, 2.553), (13, 8.044, 4, 2.389), (7, 7.704, 4, 2.384), (10, 8.648, 4, 2.646),
                        (13, 8.032, 4, 2.438), (11, 11.799, 4, 2.553)]
C8_PLAIN: list[Round] = [(4, 6.293, 4, 0.023), (4, 7.783, 4, 0.021), (4, 8.014, 4, 0.021), (4, 6.903, 4, 0.025),
                         (4, 5.254, 4, 0.023)]


@pytest.mark.parametrize("probe_rounds", [1, 2])
def test_a_plain_block_that_clearly_loses_ends_early(probe_rounds: int) -> None:
    """Drafting beats plain decoding's estimate by less than the slack (1.9x), so the first cycle measures
    plain decoding; its first measured round already loses to drafting's window by 2x, and the block ends
    there instead of after a whole window: every stretch of plain rounds is the probe's own rounds."""
    costs = {True: C8_SPEC, False: C8_PLAIN}
    policy = SpecPolicy("adaptive", settle=1, warmup=6, probe_rounds=probe_rounds, in_flight=1)
    modes, rate = replay(policy, costs, 64, in_flight=2)
    assert policy.trace()["trace"][0]["reason"] == "drafting measured faster"
    stretches = plain_stretches(modes)
    assert {len(p) for p in stretches if p} == {probe_rounds}
    if probe_rounds == 1:  # the default
        assert rate >= 0.97 * fixed_rate(costs, True, 64)


# c = 8 on the demo pair, PP = 2, 2 micro-batches of 4 rows, 2026-12-03, from ``policy_trace.rounds`` of one
# adaptive run: its first 24 drafting rounds at full load, in order (tokens, ms, rows, the draft's ms in
# it), and its plain block's rounds, the last two less the draft's catch-up they carried (12.2, 12.9 ms).
C8B_SPEC: list[Round] = [(11, 19.371, 4, 4.356), (8, 19.936, 4, 4.647), (14, 13.167, 4, 4.218), (13, 13.76, 4, 4.667),
                         (14, 12.941, 4, 4.165), (13, 13.532, 4, 4.682), (7, 13.436, 4, 4.53), (10, 14.145, 4, 4.616),
                         (13, 13.715, 4, 4.589), (11, 13.3, 4, 4.552), (13, 14.419, 4, 4.826), (15, 13.152, 4, 4.396),
                         (16, 13.597, 4, 4.421), (16, 14.455, 4, 4.8), (14, 13.843, 4, 4.656), (12, 14.205, 4, 4.538),
                         (16, 13.434, 4, 4.338), (16, 13.381, 4, 4.607), (16, 12.279, 4, 3.556), (16, 10.274, 4, 3.328),
                         (16, 10.859, 4, 3.736), (13, 11.451, 4, 3.584), (16, 11.369, 4, 3.646), (16, 10.8, 4, 3.682)]
C8B_PLAIN: list[Round] = [(4, 7.517, 4, 0.0), (4, 6.677, 4, 0.0), (4, 6.941, 4, 0.0), (4, 7.669, 4, 0.0)]
C8B_CATCH_UP_MS = 5.27  # the draft's catch-up in a plain round after which drafting resumes


def turns(policy: SpecPolicy, spec: list[Round], plain: list[Round], rounds: int, micro_batches: int = 2,
          catch_up_ms: float = C8B_CATCH_UP_MS, unmeasured_plain: int = 0, first_plain_ms: float | None = None,
          plain_after: tuple[int, list[Round]] | None = None) -> tuple[list[bool], float]:
    """The last stage's turns, as the engine runs them: ``policy.speculate()`` at the start of each turn, a
    round of its micro-batch verified (with drafts when that micro-batch's previous turn drafted), then the
    draft's work when this turn drafts — in this round's interval, with ``catch_up_ms`` more when the
    micro-batch's previous turn did not (the draft ingests the positions it missed). Drafting rounds cost
    their recorded verify share (ms less draft ms) and their draft; plain rounds their recorded ms, or
    ``first_plain_ms`` right after a round with drafts (the first stage's share of the plain round was done
    while the last stage still drafted: only the last stage's share shows). The first ``unmeasured_plain``
    plain rounds land as prefill rounds (a request admitted in them); ``plain_after`` = (round, rows):
    plain rounds cost those from that round on. Returns each round's mode and the run's tokens per second."""
    now, tokens = 0.0, 0
    carried = [True] * micro_batches  # whether each micro-batch's previous turn drafted
    drawn = {True: 0, False: 0}
    modes: list[bool] = []
    for t in range(rounds):
        mb = t % micro_batches
        drafts = policy.speculate()
        mode = carried[mb]
        table = spec if mode else (plain_after[1] if plain_after is not None and t >= plain_after[0] else plain)
        got, ms, rows, draft_ms = table[drawn[mode] % len(table)]
        drawn[mode] += 1
        verify_ms = ms - draft_ms if mode else ms
        if not mode and first_plain_ms is not None and modes and modes[-1]:
            verify_ms = first_plain_ms
        draft_now = (spec[t % len(spec)][3] + (0.0 if mode else catch_up_ms)) if drafts else 0.0
        now += (verify_ms + draft_now) / 1e3
        tokens += got
        prefill = not mode and unmeasured_plain > 0
        unmeasured_plain -= int(prefill)
        policy.record(mode, got, now, prefill=prefill, rows=rows, draft_seconds=draft_now / 1e3, load=rows * micro_batches)
        carried[mb] = drafts
        modes.append(mode)
    return modes, tokens / now


def test_a_probe_resumes_drafting_before_its_plain_round_lands() -> None:
    """On rounds recorded at c = 8 (2 micro-batches), a probe launches one round without drafts and drafts
    again on the next turn: the rounds in flight keep their drafts, the probe costs one plain round (its
    interval carries the draft's catch-up, which is not counted against plain decoding), and the run stays
    within 3 % of always drafting. Each probe is measured as a plain round of its own cost, not a
    drafting one's."""
    policy = SpecPolicy("adaptive", settle=1, warmup=6, in_flight=2)
    modes, rate = turns(policy, C8B_SPEC, C8B_PLAIN, 64)
    _, always = turns(SpecPolicy("always"), C8B_SPEC, C8B_PLAIN, 64)
    decisions = [d for d in policy.trace()["trace"] if "measured faster" in d["reason"]]
    assert decisions and all(d["reason"] == "drafting measured faster" for d in decisions)
    stretches = plain_stretches(modes)
    assert {len(p) for p in stretches if p} == {1}
    plain_ms = 4 / decisions[0]["plain_tps"] * 1e3
    assert min(r[1] for r in C8B_PLAIN) <= plain_ms + 1e-6 and plain_ms <= max(r[1] for r in C8B_PLAIN) + 1e-6
    assert rate >= 0.97 * always


def test_a_probe_that_plain_decoding_might_win_becomes_a_plain_block() -> None:
    """Plain rounds about as fast as drafting's window: the probe's round does not settle it, so plain
    decoding is switched to for real and measured for a whole window; where it is clearly faster it is
    chosen."""
    for plain_ms, winner in ((4.7, "drafting"), (2.5, "plain decoding")):  # drafting: ~843 tokens/s
        plain = [(4, plain_ms, 4, 0.0)]
        policy = SpecPolicy("adaptive", settle=1, warmup=6, in_flight=2)
        modes, _ = turns(policy, C8B_SPEC, plain, 80)
        first = next(d for d in policy.trace()["trace"] if "measured faster" in d["reason"])
        assert first["reason"].startswith(f"{winner} measured faster")
        stretches = plain_stretches(modes)
        assert max(len(p) for p in stretches) >= 1 + policy.window  # the probe, then a whole block


def test_a_probe_whose_plain_round_is_not_measured_becomes_a_plain_block() -> None:
    """The probe's plain round lands as a prefill round (not measured): once more rounds with drafts have
    landed than are in flight, the policy stops waiting for it and runs plain decoding for real."""
    policy = SpecPolicy("adaptive", settle=1, warmup=6, in_flight=2)
    modes, _ = turns(policy, C8B_SPEC, C8B_PLAIN, 64, unmeasured_plain=1)
    assert policy.trace()["trace"][0]["reason"] == "drafting measured faster"
    stretches = plain_stretches(modes)
    assert [len(p) for p in stretches if p][0] == 1 and sum(1 for p in stretches if p) >= 2


def test_a_plain_block_that_might_win_is_measured_whole() -> None:
    """Plain rounds within the margin of drafting's window are not cut short: the block runs its window."""
    spec = [(12, 8.0, 4, 2.5)] * 4
    plain = [(4, 2.7, 4, 0.0)]  # 1481 tokens/s against drafting's 1500: within the 3 % margin
    policy = SpecPolicy("adaptive", settle=1)
    modes, _ = replay(policy, {True: spec, False: plain}, 40, in_flight=1)
    first_plain = modes.index(False)
    assert modes[first_plain:first_plain + 1 + policy.window] == [False] * (1 + policy.window)


def fixed_batch(policy: SpecPolicy, need: int, queued: int) -> list[bool]:
    """8 rows that all need ``need`` tokens, one round in flight; drafting commits 3 tokens per row in 10 ms
    (4 of them the draft's), plain decoding 1 in 6 ms (1.8x slower, so the first cycle measures it):
    the mode of every round. ``queued``: the requests the engine says wait for a slot."""
    left = [need] * 8
    now, modes, mode = 0.0, [], True
    while any(left):
        per_row = []
        for i, n in enumerate(left):
            if n:
                take = min(n, 3 if mode else 1)
                left[i] -= take
                per_row.append((i, take, left[i]))
        now += 0.010 if mode else 0.006
        modes.append(mode)
        policy.record(mode, sum(t for _, t, _ in per_row), now, rows=len(per_row), draft_seconds=0.004 if mode else 0.0,
                      load=sum(1 for n in left if n), per_row=per_row, queued=queued)
        mode = policy.speculate()
    return modes


def test_no_probe_near_the_end_of_a_fixed_batch() -> None:
    """Drafting wins by 1.8x. With no request waiting, a periodic re-measure that the batch would end
    before its next exploit period could pay for is skipped: the plain rounds are the first cycle's only.
    With requests waiting (the batch's end is not the end of the work) the same rounds are re-measured."""
    counts = {}
    for queued in (0, 3):
        policy = worker_policy()
        modes = fixed_batch(policy, 3 * 130, queued)  # the periodic probe falls ~60 rounds before the end
        first = policy.trace()["trace"][0]
        assert first["reason"] == "drafting measured faster"
        skipped = [d for d in policy.trace()["trace"] if d["reason"].startswith("the batch ends before another probe")]
        counts[queued] = (modes.count(False), len(skipped))
    first_cycle_plain = counts[0][0]
    assert counts[0][1] >= 1 and first_cycle_plain <= 1 + 1 + 1  # settling, measured (and one in flight)
    assert counts[3][1] == 0 and counts[3][0] > first_cycle_plain  # re-measured


def test_a_long_fixed_batch_is_still_re_measured() -> None:
    """The skip looks at the time left, not at whether a batch is fixed: a batch far longer than an exploit
    period still measures plain decoding again before its end."""
    policy = worker_policy()
    modes = fixed_batch(policy, 3 * 1500, 0)
    decided = [d for d in policy.trace()["trace"] if d["reason"] == "drafting measured faster"]
    assert len(decided) >= 2 and modes.count(False) > 3
    period_rounds = int(policy._doubled_factor() * policy._probe_cost / 0.010)  # drafting rounds of 10 ms
    assert period_rounds > 10 and all(m for m in modes[-period_rounds:])


# c = 32 on the CPU (PP = 2, 2 micro-batches of 16 rows), shaped on one adaptive run of 2026-12-03: a drafting
# round costs 17 ms (5 of them the draft's) and commits 41 tokens in the first cycle's first block, 30 later
# (in that run: the rows' spread, once measured, scaled drafting's figure by 0.77); a plain round costs 12 ms
# settled, but a probe's round, right after rounds with drafts, showed only the last stage's 7 ms.
C32_SPEC: list[Round] = [(41, 17.0, 16, 5.0)] * 12 + [(30, 17.0, 16, 5.0)] * 12
C32_PLAIN: list[Round] = [(16, 12.0, 16, 0.0)]


def test_plain_decoding_is_not_chosen_on_a_probe_round_alone() -> None:
    """The probe's round loses to drafting's first window (2286 against 2412 tokens/s) and ends early, but the
    cycle's pooled figure (2088) is below it: a plain block proper measures plain decoding settled (1333),
    and drafting is kept. No stretch of plain decoding is longer than that block."""
    policy = SpecPolicy("adaptive", settle=1, warmup=6, in_flight=2)
    modes, rate = turns(policy, C32_SPEC, C32_PLAIN, 120, first_plain_ms=7.0)
    reasons = [d["reason"] for d in policy.trace()["trace"]]
    assert reasons[0] == "plain decoding faster on a probe's round: measuring a plain block to confirm"
    assert reasons[1] == "drafting measured faster"
    stretches = plain_stretches(modes)
    assert max(len(p) for p in stretches) <= 1 + policy.window + 2  # settling, the block, in flight
    _, always = turns(SpecPolicy("always"), C32_SPEC, C32_PLAIN, 120)
    assert rate >= 0.95 * always


def test_plain_decoding_that_slows_down_is_measured_again_at_once() -> None:
    """Plain decoding wins at first (6 ms rounds: 2667 against 2118 tokens/s), then its rounds slow to
    14 ms (1143): the policy does not wait for the end of its exploit period (tens of rounds) to measure
    again, and drafting runs within a few windows of the change."""
    policy = SpecPolicy("adaptive", settle=1, warmup=6, in_flight=2, exploit=64)
    plain = [(16, 6.0, 16, 0.0)]
    modes, _ = turns(policy, C32_SPEC, plain, 200, plain_after=(60, [(16, 14.0, 16, 0.0)]))
    reasons = [d["reason"] for d in policy.trace()["trace"]]
    assert "plain decoding measured faster" in reasons[:2]
    assert not any(modes[40:60])  # plain decoding runs, as chosen
    watched = [d for d in policy.trace()["trace"] if d["reason"].startswith("plain decoding's rounds run slower")]
    assert watched and watched[0]["round"] <= 60 + 4 * policy.window
    assert all(modes[60 + 6 * policy.window:])


def test_a_load_change_during_a_probe_resumes_drafting() -> None:
    """The load halves twice while a probe's plain round is in flight: the cycle starts again from drafting
    (the standing mode), not from the probe's plain block, and the policy drafts on."""
    policy = SpecPolicy("adaptive", settle=1, in_flight=2)
    now, decided = 0.0, []
    while len(decided) < 40:
        decided.append(policy.speculate())
        if not decided[-1]:
            break
        now += 0.013
        policy.record(True, 12, now, rows=4, draft_seconds=0.004, load=8)
    assert decided[-1] is False, "no probe was started"
    now += 0.013
    policy.record(True, 3, now, rows=1, draft_seconds=0.004, load=2)  # a round in flight, after rows finished
    assert policy.trace()["trace"][-1]["reason"] == "load 8 -> 2 running sequences: measuring again"
    for _ in range(policy.window + 1):  # a drafting window is measured first (the probe's round never lands)
        assert policy.speculate()
        now += 0.013
        policy.record(True, 3, now, rows=1, draft_seconds=0.004, load=2)


# c = 8 on the CPU (PP = 2, 2 micro-batches of 4 rows), 2026-12-03: one adaptive run's first drafting rounds,
# slowed by a stall (10-12 ms; rounds of the same call settled at ~6.5), the drafting rounds of a settled
# `always` run of that call, and that adaptive run's plain rounds (tokens, ms, rows, the draft's ms).
C8S_STALLED: list[Round] = [(11, 10.246, 4, 2.224), (8, 10.831, 4, 2.341), (14, 11.947, 4, 5.237), (13, 10.723, 4, 2.315),
                            (14, 11.122, 4, 3.213), (13, 7.289, 4, 2.052), (7, 12.108, 4, 2.336), (10, 11.65, 4, 2.237),
                            (13, 12.632, 4, 2.398), (11, 11.852, 4, 2.267)]
C8S_SETTLED: list[Round] = [(15, 6.359, 4, 1.918), (12, 6.167, 4, 1.885), (16, 6.478, 4, 2.014), (13, 6.306, 4, 1.91),
                            (14, 6.899, 4, 2.249), (16, 6.448, 4, 1.914), (16, 6.369, 4, 1.939), (12, 8.053, 4, 2.763),
                            (16, 7.989, 4, 2.091), (16, 6.261, 4, 1.881), (16, 6.14, 4, 1.796), (14, 6.619, 4, 2.389)]
C8S_PLAIN: list[Round] = [(4, 3.297, 4, 0.0), (4, 3.205, 4, 0.0), (4, 3.371, 4, 0.0), (4, 3.306, 4, 0.0),
                          (4, 3.484, 4, 0.0), (4, 3.631, 4, 0.0), (4, 3.244, 4, 0.0), (4, 3.205, 4, 0.0)]


def test_a_stall_in_the_first_drafting_window_does_not_send_the_run_to_plain_decoding() -> None:
    """The first window of drafting ran in a stall (856 tokens/s; the stall's rounds repeated so that they
    fill the window after the warm-up) and plain decoding then measured 1.40x faster: clear by one block of
    each. Before, plain decoding was chosen for an exploit period longer than the run (here: 0.58x always
    drafting; the recorded run decoded 159 of its 174 rounds plainly, where settled drafting was 1.4x
    faster). The first decision's switch waits for the bracketing drafting block now, which runs settled:
    drafting is kept."""
    spec = C8S_STALLED + C8S_STALLED[6:] + C8S_SETTLED * 12
    policy = SpecPolicy("adaptive", settle=1, warmup=6, in_flight=2)
    modes, rate = turns(policy, spec, C8S_PLAIN, 120, catch_up_ms=2.2)
    _, always = turns(SpecPolicy("always"), spec, C8S_PLAIN, 120, catch_up_ms=2.2)
    first = next(d for d in policy.trace()["trace"] if "measured faster" in d["reason"])
    assert first["reason"] == "drafting measured faster", policy.trace()["trace"]
    assert max(len(p) for p in plain_stretches(modes)) <= 1 + policy.window + 2  # settling, the block, in flight
    assert modes[40:].count(False) <= 2 and rate >= 0.96 * always
