"""Packed hop transport, the step broadcast and the launcher, over real gloo processes.

The stage functions live at module level so the stage processes can import them by name.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import plan_layout
from pipespec.contract.mixin import hop_keys
from pipespec.engine import step as stepmsg
from pipespec.pp.launch import PeerLostError, StageContext, StageFailedError, describe_exit, run_stages
from pipespec.pp.transport import HopLayout, HopReceiver, HopSender, StepBroadcaster

H = 5


def _value(rank: int, key_index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that identifies its sender, key and element position."""
    n = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)
    return n + 1000.0 * key_index + 100000.0 * rank


def _slot(key: str) -> int:
    """0 for hidden_states, 1 + slot for aux_hidden_states_{slot}."""
    return 0 if key == "hidden_states" else 1 + int(key.rsplit("_", 1)[1])


def test_hop_layout_packs_keys_back_to_back_in_plan_order() -> None:
    """Pack then unpack is the identity, and key i sits at offset i*B*T*H of one flat buffer."""
    plan = plan_layout(8, 3, aux_layers=[0, 3, 6, 8])
    keys = hop_keys(plan.stage(1), has_residual=True)
    assert keys == ("hidden_states", "residual", "aux_hidden_states_0", "aux_hidden_states_1", "aux_hidden_states_2")
    layout = HopLayout(keys, H)
    tensors = {k: _value(0, i, (2, 3, H)) for i, k in enumerate(keys)}
    flat = torch.empty(layout.numel((2, 3)))
    layout.pack_into(flat, tensors, (2, 3))
    for i, key in enumerate(keys):
        start = layout.offset(key, (2, 3))
        assert start == i * 2 * 3 * H
        assert torch.equal(flat[start : start + 2 * 3 * H].view(2, 3, H), tensors[key])
    assert layout.unpack(flat, (2, 3)) == IntermediateTensors(tensors)


def test_hop_layout_names_a_missing_key() -> None:
    layout = HopLayout(("hidden_states", "aux_hidden_states_0"), H)
    with pytest.raises(RuntimeError, match="aux_hidden_states_0.*keys \\['hidden_states'\\]"):
        layout.pack_into(torch.empty(layout.numel((1, 1))), {"hidden_states": torch.zeros(1, 1, H)}, (1, 1))


def test_step_message_round_trips_and_checks_the_step() -> None:
    k = 3
    updates = [
        stepmsg.SeqUpdate(ran=True, done=False, accepted=2, tokens=[7, 8, 9], kept=3, drafts=[1, 2, 3], request=4, generation=1),
        stepmsg.SeqUpdate(),
        stepmsg.SeqUpdate(ran=True, done=True, accepted=0, tokens=[4], kept=1, drafts=[], request=0, generation=0),
    ]
    message = stepmsg.encode(5, 1, updates, k)
    assert message.numel() == stepmsg.message_size(3, k) == 3 + 3 * (6 + 2 * k)
    decoded = stepmsg.decode(message, 5, 1, 3, k)
    assert decoded[0] == updates[0]
    assert decoded[1] == stepmsg.SeqUpdate()
    assert decoded[2] == updates[2]
    with pytest.raises(RuntimeError, match="out of step"):
        stepmsg.decode(message, 6, 1, 3, k)
    with pytest.raises(RuntimeError, match="out of step"):
        stepmsg.decode(message, 5, 0, 3, k)


# ----------------------------------------------------------------------------- real processes
def _relay_stage(ctx: StageContext, shapes: list[tuple[int, int]]) -> list[float]:
    """Stage 0 sends, the middle stage relays (receive → send), the last stage checks every tensor."""
    plan = plan_layout(6, ctx.world_size, aux_layers=[0, 2, 4, 6])
    checks = []
    sender = receiver = None
    if not ctx.is_last:
        sender = HopSender(ctx, hop_keys(plan.stage(ctx.rank), False), H, torch.float32, ctx.rank + 1)
    if not ctx.is_first:
        receiver = HopReceiver(ctx, hop_keys(plan.stage(ctx.rank - 1), False), H, torch.float32, ctx.rank - 1)
    bcast = StepBroadcaster(ctx, 4, ctx.world_size - 1)
    for step, shape in enumerate(shapes):
        if ctx.is_first:
            keys = hop_keys(plan.stage(0), False)
            out = IntermediateTensors({k: _value(0, _slot(k), (*shape, H)) for k in keys})
        else:
            assert receiver is not None
            got = receiver.recv(shape)
            prev_keys = hop_keys(plan.stage(ctx.rank - 1), False)
            assert tuple(got.keys()) == prev_keys
            for key in prev_keys[1:]:
                # Every aux key was produced by some upstream stage r; its tensor must be exactly r's.
                owner = next(r for r in range(ctx.rank) if key in plan.stage(r).own_keys)
                checks.append(float((got[key] - _value(owner, _slot(key), (*shape, H))).abs().max()))
            own = plan.stage(ctx.rank).own_keys
            out = got | {k: _value(ctx.rank, _slot(k), (*shape, H)) for k in own}
            out["hidden_states"] = got["hidden_states"] + 1.0
        if sender is not None:
            sender.send(out)
        else:
            checks.append(float((out["hidden_states"] - (_value(0, 0, (*shape, H)) + ctx.rank)).abs().max()))
        message = torch.tensor([step, shape[0], shape[1], -1]) if ctx.is_last else None
        echoed = bcast.broadcast(message)
        checks.append(float((echoed - torch.tensor([step, shape[0], shape[1], -1])).abs().max()))
    return checks


@pytest.mark.timeout(120)
def test_three_stages_relay_aux_states_in_one_message_per_hop() -> None:
    """Aux states from stage 0 and 1 arrive at stage 2 intact, through varying (B, T) shapes."""
    results = run_stages(_relay_stage, [(1, 7), (1, 1), (2, 4), (1, 9)], 3, timeout_s=60)
    assert len(results) == 3
    assert all(c == 0.0 for r in results for c in r), results


def _silent_sender_stage(ctx: StageContext, _: None) -> None:
    if ctx.rank == 1:
        HopReceiver(ctx, ("hidden_states",), H, torch.float32, 0).recv((1, 1))
    else:
        time.sleep(30)


@pytest.mark.timeout(120)
def test_a_receive_that_never_completes_times_out_naming_the_peer() -> None:
    started = time.monotonic()
    with pytest.raises(StageFailedError, match=r"stage 1 failed: PeerLostError: receiving 1 tensors \(1, 1\) from stage 0"):
        run_stages(_silent_sender_stage, None, 2, timeout_s=3)
    assert time.monotonic() - started < 25


def _crashing_stage(ctx: StageContext, how: str) -> None:
    if ctx.rank == 1:
        if how == "raise":
            raise ValueError("boom in stage one")
        os._exit(3)
    HopReceiver(ctx, ("hidden_states",), H, torch.float32, 1).recv((1, 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "expected"), [("raise", "stage 1 failed: ValueError: boom in stage one"),
                                              ("exit", "stage 1 exited with code 3")])
def test_a_failing_stage_is_named_and_the_others_are_stopped(how: str, expected: str) -> None:
    """The root cause wins over the stage that only lost its peer."""
    pids: list[int] = []
    with pytest.raises(StageFailedError, match=expected) as info:
        run_stages(_crashing_stage, how, 3, timeout_s=30, on_start=pids.extend)
    assert info.value.rank == 1
    assert "stopped stages 0, 2" in str(info.value)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_describe_exit_names_signals() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(2) == "exited with code 2"


def test_peer_lost_error_is_a_pipespec_error() -> None:
    assert PeerLostError("x").exit_code == 1


def test_stage_threads_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipespec.engine.stage.settings import stage_threads
    from pipespec.errors import UsageError

    monkeypatch.delenv("PIPESPEC_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert stage_threads(1) == max(1, os.cpu_count() or 1)
    assert stage_threads(10_000) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert stage_threads(2) == 2
    monkeypatch.setenv("PIPESPEC_THREADS", "3")
    assert stage_threads(2) == 3
    monkeypatch.setenv("PIPESPEC_THREADS", "zero")
    with pytest.raises(UsageError, match="PIPESPEC_THREADS='zero' is not an integer"):
        stage_threads(2)


def _slow_loader_stage(ctx: StageContext, delay: float) -> str:
    """Stage 0 'loads' for ``delay`` s; then everyone meets at the post-loading barrier and does a step."""
    from pipespec.engine.stage.loading import wait_for_all_stages_loaded

    if ctx.rank == 0:
        time.sleep(delay)
    wait_for_all_stages_loaded(ctx)
    StepBroadcaster(ctx, 1, ctx.world_size - 1).broadcast(torch.ones(1, dtype=torch.int64) if ctx.is_last else None)
    return "ok"


@pytest.mark.timeout(120)
def test_slow_loading_is_bounded_by_the_load_timeout_not_the_step_timeout() -> None:
    """A stage loading for longer than --timeout is waited for (up to --load-timeout); without the
    longer load timeout the same wait fails fast, naming what was awaited."""
    assert run_stages(_slow_loader_stage, 4.0, 2, timeout_s=1.5, load_timeout_s=60) == ["ok", "ok"]
    with pytest.raises(StageFailedError, match="stage 1 failed: PeerLostError: step broadcast from stage 1"):
        run_stages(_slow_loader_stage, 8.0, 2, timeout_s=1.5)


def test_step_messages_travel_on_gloo_unless_the_environment_keeps_the_stage_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipespec.errors import UsageError
    from pipespec.pp.transport import STEP_BACKEND_ENV, step_backend

    monkeypatch.delenv(STEP_BACKEND_ENV, raising=False)
    assert step_backend("nccl") == "gloo"  # host messages: no NCCL call, no device copy per round
    monkeypatch.setenv(STEP_BACKEND_ENV, "device")
    assert step_backend("nccl") == "nccl" and step_backend("gloo") == "gloo"
    monkeypatch.setenv(STEP_BACKEND_ENV, "tcp")
    with pytest.raises(UsageError, match="PIPESPEC_STEP_BACKEND='tcp'"):
        step_backend("nccl")
