"""Micro-batches in flight (``--micro-batches``): the schedule's bookkeeping, and real gloo pipelines whose
outputs are token-for-token those of one batch in flight (and of transformers' greedy ``generate``).

The scheduler tests drive ``pipespec.engine.microbatch.Scheduler`` the way every stage does, with a
simulated last stage, and check its invariants (no slot reused before its in-flight message is
drained, stale entries ignored, every request ends exactly once, no livelock). The process tests
group several cases into each launch: prompts of different lengths and budgets, an EOS that some
sequences reach, a queue behind ``--max-num-seqs``, requests cancelled while their round is in flight,
and micro-batches that are empty because there are more stages than sequences.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from pipespec.cli import main
from pipespec.engine import step as stepmsg
from pipespec.engine.job import build_requests
from pipespec.engine.microbatch import (
    MIN_TOKENS_PER_FORWARD,
    Scheduler,
    default_micro_batches,
    micro_batch_rule,
)
from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target
from pipespec.errors import UsageError


# ------------------------------------------------------------------------------------- the scheduler
def _done_update(launch: Any, done: bool) -> stepmsg.SeqUpdate:
    return stepmsg.SeqUpdate(ran=True, done=done, tokens=[1], kept=1, request=launch.request, generation=launch.generation)


def _message(sched: Scheduler, launches: list[Any], done: set[int]) -> list[stepmsg.SeqUpdate]:
    updates = [stepmsg.SeqUpdate() for _ in range(sched.slots_per_micro_batch)]
    for launch in launches:
        updates[launch.slot] = _done_update(launch, launch.request in done)
    return updates


def test_sequences_are_spread_over_micro_batches_in_request_order() -> None:
    sched = Scheduler(5, 2)
    assert sched.slots_per_micro_batch == 3
    first, second = sched.next_micro_batch(), sched.next_micro_batch()
    assert (first.index, second.index) == (0, 1)
    assert sched.admit(first) == [0, 1, 2]
    assert sched.admit(second) == [3, 4]
    assert [(x.slot, x.request, x.generation) for x in sched.launch(first)] == [(0, 0, 0), (1, 1, 0), (2, 2, 0)]
    assert sched.next_micro_batch() is first  # round-robin


@pytest.mark.parametrize(("pp", "requests", "cap", "tokens_per_row", "device", "expected"), [
    (4, 2, None, 4, "cpu", 1),  # 1 row x 4 tokens per micro-batch: below the threshold
    (2, 8, None, 4, "cpu", 2),  # c = 8, k = 3: 16 tokens per micro-batch forward (measured 1.12-1.16x quiet)
    (2, 8, None, 1, "cpu", 1),  # c = 8, plain decoding: 4 (measured 0.86-0.95x quiet)
    (2, 32, None, 4, "cpu", 2),  # c = 32, k = 3: 64
    (2, 32, None, 1, "cpu", 2),  # c = 32, plain decoding: 16
    (4, 128, 64, 4, "cpu", 4),  # capped at 64 running: 16 rows x 4 per micro-batch
    (4, 24, 12, 4, "cpu", 1),  # capped at 12 running: 3 rows x 4
    (4, 16, None, 1, "cpu", 1),  # 4 rows x 1
    (2, 8, None, 4, "cuda", 1),
    (2, 32, None, 4, "cuda", 1),  # 64 tokens: measured 14-23 % slower on 2x H200
    (2, 128, None, 4, "cuda", 2),  # 256 tokens: measured 1.44-2.02x
    (2, 128, None, 1, "cuda", 1),  # plain decoding at c = 128: 64 tokens
    (2, 128, None, 4, "xpu", 2),  # no threshold of its own: CUDA's
    (2, 32, None, 4, "xpu", 1),
    (3, 2, None, 400, "cuda", 2),  # never more micro-batches than sequences
    (1, 500, None, 4, "cuda", 1),  # one stage
])
def test_the_default_micro_batch_count_follows_tokens_per_forward(
    pp: int, requests: int, cap: int | None, tokens_per_row: int, device: str, expected: int
) -> None:
    count, why = micro_batch_rule(pp, requests, cap, tokens_per_row=tokens_per_row, device_type=device)
    assert count == expected == default_micro_batches(pp, requests, cap, tokens_per_row=tokens_per_row, device_type=device)
    assert ("one micro-batch" in why) == (expected == 1)
    if pp > 1 and expected == 1 and requests > 1:
        assert f"< {MIN_TOKENS_PER_FORWARD.get(device, MIN_TOKENS_PER_FORWARD['cuda'])}" in why


def test_a_slot_is_reused_only_after_its_in_flight_message_is_drained() -> None:
    """Request 0 is cancelled while its prefill is in flight; request 1 waits behind --max-num-seqs 1."""
    sched = Scheduler(2, 1, max_num_seqs=1, cancel_after=[1, None])
    mb = sched.next_micro_batch()
    assert sched.admit(mb) == [0]
    launches = sched.launch(mb)
    assert sched.cancel_due(mb, launches) == [0]
    slot = mb.slots[0]
    assert slot.request is None and slot.generation == 1 and slot.in_flight == (0, 0)
    assert not slot.free
    assert sched.admit(mb) == []  # the cancelled round's message is still in flight: no reuse yet
    assert sched.next_micro_batch() is mb
    assert sched.consume(mb, _message(sched, launches, done=set())) == []  # stale: ignored
    assert sched.stale == 1 and slot.free
    assert sched.admit(mb) == [1]
    assert [(x.request, x.generation) for x in sched.launch(mb)] == [(1, 1)]
    assert sched.status == ["cancelled", "running"]


def test_cancel_on_demand_frees_a_waiting_request_at_once_and_a_running_one_after_its_round() -> None:
    sched = Scheduler(3, 1, max_num_seqs=1)
    mb = sched.next_micro_batch()
    sched.admit(mb)
    launches = sched.launch(mb)
    assert sched.cancel(2) and list(sched.waiting) == [1]  # never started: just leaves the queue
    assert sched.cancel(0) and not sched.cancel(0)
    assert sched.admit(mb) == []  # request 0's round is still in flight
    sched.next_micro_batch()
    assert sched.consume(mb, _message(sched, launches, done={0})) == [] and sched.stale == 1
    assert sched.admit(mb) == [1]
    assert sched.status == ["cancelled", "running", "cancelled"]


def test_a_message_that_disagrees_with_the_schedule_fails_loudly() -> None:
    def launched() -> tuple[Scheduler, Any, list[stepmsg.SeqUpdate]]:
        sched = Scheduler(2, 1)
        mb = sched.next_micro_batch()
        sched.admit(mb)
        return sched, mb, _message(sched, sched.launch(mb), done=set())

    sched, mb, wrong = launched()
    wrong[1].generation = 7
    with pytest.raises(RuntimeError, match="slot 1: launched request 1 at generation 0, the message reports request 1 at generation 7"):
        sched.consume(mb, wrong)
    sched, mb, missing = launched()
    missing[0] = stepmsg.SeqUpdate()
    with pytest.raises(RuntimeError, match="slot 0: launched request 0 .* reports no forward"):
        sched.consume(mb, missing)
    sched, mb, extra = launched()
    sched.consume(mb, extra)
    with pytest.raises(RuntimeError, match="micro-batch 0 has no round in flight"):
        sched.consume(mb, extra)


def test_an_empty_micro_batch_launches_nothing_and_expects_no_message() -> None:
    sched = Scheduler(1, 3)
    turns = [sched.next_micro_batch() for _ in range(3)]
    sched.admit(turns[0])
    assert sched.launch(turns[0])
    for mb in turns[1:]:
        assert sched.admit(mb) == [] and sched.launch(mb) == [] and not mb.awaiting
    assert not sched.done()


def test_bad_settings_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--micro-batches must be >= 1"):
        Scheduler(2, 0)
    with pytest.raises(UsageError, match="cancel_after must be >= 1"):
        Scheduler(2, 1, cancel_after=[None, 0])
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1], "cancel_after": 0}) + "\n")
    with pytest.raises(UsageError, match=r"p.jsonl:1: cancel_after must be an integer >= 1"):
        build_requests(str(tmp_path), prompts_file=str(path))
    path.write_text(json.dumps({"prompt_ids": [1], "cancel_after": 2}) + "\n")
    assert build_requests(str(tmp_path), prompts_file=str(path))[0].cancel_after == 2


@given(
    finish=st.lists(st.integers(1, 6), min_size=1, max_size=9),
    cancels=st.lists(st.one_of(st.none(), st.integers(1, 6)), min_size=9, max_size=9),
    micro_batches=st.integers(1, 4),
    cap=st.one_of(st.none(), st.integers(1, 5)),
)
def test_simulated_schedules_keep_their_invariants(
    finish: list[int], cancels: list[int | None], micro_batches: int, cap: int | None
) -> None:
    """A simulated last stage finishes request r after ``finish[r]`` forwards; some requests are cancelled."""
    n = len(finish)
    cancel_after = cancels[:n]
    sched = Scheduler(n, micro_batches, max_num_seqs=cap, cancel_after=cancel_after)
    in_flight: dict[int, list[Any]] = {}  # micro-batch -> the launches of its pending round
    applied: dict[int, int] = {r: 0 for r in range(n)}
    for _ in range(10_000):
        if sched.done():
            break
        mb = sched.next_micro_batch()
        if mb.awaiting:
            launches = in_flight.pop(mb.index)
            done = {x.request for x in launches if sched.forwards[x.request] >= finish[x.request]}
            for request, update in sched.consume(mb, _message(sched, launches, done)):
                assert update.request == request and sched.status[request] in ("running", "finished")
                applied[request] += 1
        draining = {s.index for s in mb.slots if s.in_flight is not None}
        for request in sched.admit(mb):
            slot = next(s for s in mb.slots if s.request == request)
            assert slot.index not in draining, "a slot was reused before its in-flight message was drained"
        assert sched.running <= sched.capacity
        launches = sched.launch(mb)
        if launches:
            in_flight[mb.index] = launches
        sched.cancel_due(mb, launches)
    else:
        pytest.fail("the schedule never finished")
    expected_cancelled = [c is not None and c <= f for c, f in zip(cancel_after, finish)]
    assert sched.status == ["cancelled" if c else "finished" for c in expected_cancelled]
    for r in range(n):
        ran = min(finish[r], cancel_after[r] or finish[r])
        assert sched.forwards[r] == ran
        assert applied[r] == (ran - 1 if expected_cancelled[r] else ran)
    assert sched.stale == sum(expected_cancelled)


# -------------------------------------------------------------------------------- real pipelines
PROMPTS = [  # (prompt ids, max_new_tokens, cancel_after)
    ([5, 17, 3, 42, 8], 10, None),
    ([7], 14, None),
    ([40, 2, 2, 31, 9, 11, 47, 3, 1], 6, None),
    ([5, 17, 3, 42, 8], 10, 3),  # the first prompt again, cancelled while its 3rd forward is in flight
    ([60, 61], 12, None),
    ([9, 9, 1], 8, 1),  # cancelled while its prefill is in flight: no output at all
    ([33, 12, 70, 4], 5, None),
]


pytestmark = pytest.mark.usefixtures("one_thread_per_stage")


@cache
def _hf(path: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _oracle(path: str, prompt: tuple[int, ...], budget: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=budget, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-layer Llama whose EOS is a token that greedy decoding reaches mid-way for some prompts only."""
    root = tmp_path_factory.mktemp("microbatch")
    free = write_tiny_target(root / "free", "llama", num_layers=4, seed=31)
    outputs = [_oracle(str(free), tuple(p), m) for p, m, _ in PROMPTS]
    counts: dict[int, int] = {}
    for out in outputs:
        for tok in set(out[2:]):
            counts[tok] = counts.get(tok, 0) + 1
    # A token some (not all) sequences reach after their second token: they stop early, the others run on.
    eos = max((t for t, c in counts.items() if c < len(outputs) - 1), key=lambda t: (counts[t], -t))
    target = Path(shutil.copytree(free, root / "target"))
    for name in ("config.json", "generation_config.json"):
        data = json.loads((target / name).read_text())
        data["eos_token_id"] = eos
        (target / name).write_text(json.dumps(data))
    _hf.cache_clear()
    draft = write_tiny_draft(root / "draft", AutoConfig.from_pretrained(target), format="B", seed=32)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt_ids": p, "max_new_tokens": m, **({"cancel_after": c} if c else {})}) + "\n" for p, m, c in PROMPTS
    ))
    few = root / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": m}) + "\n" for p, m, _ in PROMPTS[:2]))
    return {"target": target, "draft": draft, "prompts": prompts, "few": few}


def _generate(capsys: pytest.CaptureFixture[str], model: dict[str, Path], prompts: str, *extra: str) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["generate", "--target", str(model["target"]), "--draft", str(model["draft"]), "--prompts-file",
                 str(model[prompts]), "--num-spec-tokens", "3", "--json", "--trace", "--spec-policy", "always", "--timeout", "60", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _per_sequence(result: dict[str, Any]) -> list[Any]:
    return [(o["output_ids"], o["acceptance_lengths"], o["draft_trace"], o["finish_reason"]) for o in result["outputs"]]


@pytest.mark.timeout(600)
def test_micro_batches_are_token_exact_with_one_batch_in_flight(model: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """P = 2, 3, 4 with P micro-batches (P = 3 also behind --max-num-seqs 4) == P = 2 with one == P = 1,
    and P = 1's tokens are transformers' greedy generate (EOS included), cancelled requests a prefix; the
    same with ``--cuda-graphs on`` at P = 2 and 3."""
    base = _generate(capsys, model, "prompts", "--pp", "1")
    assert base["micro_batches"] == 1
    eos = base["eos_token_ids"]
    reasons = set()
    for out, (prompt, budget, cancel) in zip(base["outputs"], PROMPTS):
        expected = _oracle(str(model["target"]), tuple(prompt), budget)
        if cancel is None:
            assert out["output_ids"] == expected
            reasons.add(out["finish_reason"])
            assert out["finish_reason"] == ("stop" if expected[-1] in eos else "length")
        else:
            # Only what the first cancel_after - 1 forwards produced (the prefill gives one token).
            assert out["finish_reason"] == "cancelled"
            assert len(out["acceptance_lengths"]) == max(cancel - 2, 0)
            assert out["output_ids"] == expected[: (1 + sum(out["acceptance_lengths"])) if cancel > 1 else 0]
    assert reasons == {"stop", "length"}, "the EOS must stop some sequences early and not others"
    twin, cancelled = base["outputs"][0], base["outputs"][3]
    assert cancelled["acceptance_lengths"] == twin["acceptance_lengths"][:1]
    assert base["stale_entries_ignored"] == 2

    one = _generate(capsys, model, "prompts", "--pp", "2", "--micro-batches", "1")
    assert one["micro_batches"] == 1 and _per_sequence(one) == _per_sequence(base)
    for extra, micro_batches, slots in (
        (["--pp", "2", "--micro-batches", "2"], 2, 4),
        (["--pp", "3", "--partition", "1,2,1", "--max-num-seqs", "4", "--micro-batches", "3"], 3, 2),
        (["--pp", "4", "--micro-batches", "4"], 4, 2),
        # Fixed KV buffers and draft storage (CUDA graphs, emulated on CPU) through EOS, cancellations and
        # requests admitted into freed slots.
        (["--pp", "2", "--cuda-graphs", "on", "--micro-batches", "2"], 2, 4),
        (["--pp", "3", "--partition", "1,2,1", "--max-num-seqs", "4", "--cuda-graphs", "on", "--micro-batches", "3"], 3, 2),
    ):
        result = _generate(capsys, model, "prompts", *extra)
        assert (result["micro_batches"], result["slots_per_micro_batch"]) == (micro_batches, slots), extra
        assert _per_sequence(result) == _per_sequence(base), extra
        assert result["stale_entries_ignored"] == 2
        assert result["rounds"] > one["rounds"]  # the same forwards, spread over more (smaller) rounds


@pytest.mark.timeout(300)
def test_more_stages_and_micro_batches_than_sequences_does_not_deadlock(
    model: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two sequences, four stages, four micro-batches: two micro-batches never hold a sequence."""
    result = _generate(capsys, model, "few", "--pp", "4", "--micro-batches", "4")
    assert result["micro_batches"] == 4 and result["slots_per_micro_batch"] == 1
    for out, (prompt, budget, _) in zip(result["outputs"], PROMPTS[:2]):
        assert out["output_ids"] == _oracle(str(model["target"]), tuple(prompt), budget)
