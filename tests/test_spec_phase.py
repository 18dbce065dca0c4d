"""The speculation policy's phases: what each one promises, over random rounds.

Rounds of random cost, acceptance, load and prefill are fed back through the policy as the engine does
(the mode of a round is what ``speculate()`` said when it was launched, ``in_flight`` rounds earlier); after
every call the phase the policy is in must agree with what it does.
"""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from pipespec.engine.spec_phase import Mode, Phase
from pipespec.engine.spec_policy import SpecPolicy

# Stretches of rounds at one load and one cost: (rounds, running rows, drafting round ms, drafting tokens per
# row, plain round ms); within a stretch each round's cost and acceptance jitter (``seed``), 1 in 20 prefills.
Stretch = tuple[int, int, float, int, float]
stretches = st.lists(st.tuples(st.integers(8, 80), st.sampled_from([1, 2, 4, 8, 16]), st.floats(2.0, 20.0),
                               st.integers(1, 5), st.floats(2.0, 20.0)), min_size=1, max_size=4)


@given(stretches=stretches, seed=st.integers(0, 2**16), window=st.integers(1, 5), settle=st.integers(0, 2),
       probe_rounds=st.integers(1, 3), in_flight=st.integers(1, 3), warmup=st.integers(0, 6))
def test_each_phase_does_what_it_says(stretches: list[Stretch], seed: int, window: int, settle: int,
                                      probe_rounds: int, in_flight: int, warmup: int) -> None:
    rng = random.Random(seed)
    policy = SpecPolicy("adaptive", window=window, settle=settle, probe_rounds=probe_rounds, in_flight=in_flight,
                        warmup=warmup, exploit=1.0, max_exploit=4.0)
    assert policy.phase is Phase.STARTING and policy.speculate()
    queue: deque[bool] = deque([True] * in_flight)
    now, launched_in_probe, recorded = 0.0, 0, 0
    for length, rows, spec_ms, per_row, plain_ms in stretches:
        for _ in range(length):
            drafted = queue.popleft()
            ms = (spec_ms if drafted else plain_ms) * rng.uniform(0.7, 1.5)
            now += ms / 1e3
            tokens = sum(max(1, per_row + rng.randint(-1, 1)) for _ in range(rows)) if drafted else rows
            policy.record(drafted, tokens, now, prefill=rng.random() < 0.05, rows=rows,
                          draft_seconds=ms / 4e3 if drafted else 0.0, load=rows)
            recorded += 1
            phase = policy.phase
            assert phase not in (Phase.STARTING, Phase.ALWAYS)
            if phase.probing:
                assert policy.mode is Mode.PLAIN  # a probe measures plain decoding
            else:
                launched_in_probe = 0
            if phase is Phase.CHECKING:
                assert policy.mode is Mode.SPECULATE  # a load check measures drafting alone
            drafts = policy.speculate()
            if phase is Phase.PROBE_LAUNCHING:
                assert not drafts
                launched_in_probe += 1
                assert launched_in_probe <= probe_rounds
                # All of its plain rounds launched: drafting resumes at once, before they land.
                assert (policy.phase is Phase.PROBE_LANDING) == (launched_in_probe == probe_rounds)
            elif phase is Phase.PROBE_LANDING:
                assert drafts and policy.phase is Phase.PROBE_LANDING
            else:
                assert drafts == (policy.mode is Mode.SPECULATE) and policy.phase is phase
            queue.append(drafts)
    trace = policy.trace()
    assert trace["spec_rounds"] + trace["plain_rounds"] == recorded
    assert trace["decisions"] >= len(trace["trace"])


def test_always_stays_in_its_phase() -> None:
    policy = SpecPolicy("always")
    for t in range(50):
        assert policy.phase is Phase.ALWAYS and policy.speculate()
        policy.record(t % 2 == 0, 1, float(t), rows=1, load=1 + t % 9)
    assert policy.trace()["decisions"] == 0
