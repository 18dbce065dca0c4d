"""Overlap transport over real gloo processes: what each stage receives equals relay mode's, exactly.

Each stage process builds the same seeded model, runs every forward twice — once through the relay
transport (``HopSender``/``HopReceiver``) and once through ``OverlapTransport`` — and compares what it
received and what it computed. Models: a real ``pipespec.adapt(LlamaModel)`` (HF-generated forward that
appends captures to the collected list), a vLLM-style toy with a separate residual (captures through
``capture_aux_hidden_state``), and a toy that reports no capture at all (the late-send fallback).
The stage functions live at module level so the stage processes can import them by name.
"""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch
from torch import nn

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import plan_layout
from pipespec.contract.mixin import AuxHiddenStatesMixin, hop_keys
from pipespec.pp.launch import StageContext, StageFailedError, run_stages
from pipespec.pp.overlap import OverlapTransport, plan_overlap_hop
from pipespec.pp.transport import HopReceiver, HopSender

HIDDEN = 16


# ----------------------------------------------------------------------------------- pure wire order
def test_boundary_id_is_rebuilt_from_hidden_states_not_sent_twice() -> None:
    hop = plan_overlap_hop(plan_layout(8, 2, aux_layers=[2, 4, 5]).stage(0), has_residual=False)
    assert hop.keys == ("hidden_states", "aux_hidden_states_0", "aux_hidden_states_1")
    assert (hop.aux, hop.aliased, hop.base, hop.relayed) == (("aux_hidden_states_0",), "aux_hidden_states_1", ("hidden_states",), ())


def test_with_a_residual_the_boundary_id_is_sent_since_it_is_hidden_plus_residual() -> None:
    hop = plan_overlap_hop(plan_layout(8, 2, aux_layers=[2, 4, 5]).stage(0), has_residual=True)
    assert hop.aux == ("aux_hidden_states_0", "aux_hidden_states_1") and hop.aliased is None
    assert hop.base == ("hidden_states", "residual")


def test_middle_stage_sends_relayed_keys_first_then_its_own_in_slot_order() -> None:
    plan = plan_layout(7, 3, aux_layers=[0, 1, 3, 5, 7], partition=[1, 4, 2])
    hop = plan_overlap_hop(plan.stage(1), has_residual=False)
    assert hop.relayed == ("aux_hidden_states_0", "aux_hidden_states_1")
    # aux 1 was aliased on hop 0 -> 1 but must travel explicitly on hop 1 -> 2; aux 3 (id 5) is aliased here.
    assert hop.aux == ("aux_hidden_states_0", "aux_hidden_states_1", "aux_hidden_states_2")
    assert hop.aliased == "aux_hidden_states_3"
    assert plan_overlap_hop(plan.stage(1), False, alias_boundary=False).aux == hop.aux + ("aux_hidden_states_3",)


def test_the_last_stage_has_no_outgoing_hop() -> None:
    with pytest.raises(ValueError, match="last stage"):
        plan_overlap_hop(plan_layout(4, 2).stage(1), has_residual=False)


# ----------------------------------------------------------------------------------- models
def _llama(num_layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    from pipespec.integrations.transformers.adapt import adapt

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = adapt(LlamaModel)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # big enough that every layer visibly changes the stream
    return model


class ResidualToy(AuxHiddenStatesMixin, nn.Module):
    """vLLM-style stack: a separate residual, captures through ``capture_aux_hidden_state``."""

    pipespec_has_residual = True

    def __init__(self, n: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=n, hidden_size=HIDDEN)
        torch.manual_seed(1)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(n))

    def forward(self, x: torch.Tensor | None, intermediate_tensors: IntermediateTensors | None = None) -> Any:
        if self.is_first_stage:
            hidden, residual = x, None
        else:
            assert intermediate_tensors is not None
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        own: list[torch.Tensor] = []
        if self.aux_capture_input:
            self.capture_aux_hidden_state(own, hidden if residual is None else hidden + residual)
        for idx in range(self.start_layer, self.end_layer):
            residual = hidden if residual is None else hidden + residual
            hidden = torch.tanh(self.layers[idx](residual))
            if idx in self.aux_capture_after_layers:
                self.capture_aux_hidden_state(own, hidden + residual)
        if not self.is_last_stage:
            return self.make_stage_output(hidden, own, intermediate_tensors, residual=residual)
        return hidden, self.collect_remote_aux_hidden_states(intermediate_tensors) + own


class SilentToy(AuxHiddenStatesMixin, nn.Module):
    """Captures into its own plain list and never reports them; ``clone_boundary`` breaks aliasing."""

    def __init__(self, n: int, clone_boundary: bool = False) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=n, hidden_size=HIDDEN)
        torch.manual_seed(2)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(n))
        self.clone_boundary = clone_boundary

    def forward(self, x: torch.Tensor | None, intermediate_tensors: IntermediateTensors | None = None) -> Any:
        hidden = x if self.is_first_stage else intermediate_tensors["hidden_states"]  # type: ignore[index]
        own: list[torch.Tensor] = []
        if self.aux_capture_input:
            own.append(hidden)
        for idx in range(self.start_layer, self.end_layer):
            hidden = torch.tanh(self.layers[idx](hidden))
            if idx in self.aux_capture_after_layers:
                own.append(hidden.clone() if self.clone_boundary and idx + 1 == self.end_layer else hidden)
        if not self.is_last_stage:
            return self.make_stage_output(hidden, own, intermediate_tensors)
        return hidden, self.collect_remote_aux_hidden_states(intermediate_tensors) + own


def _build(kind: str, n: int) -> tuple[nn.Module, bool]:
    if kind == "llama":
        return _llama(n), False
    if kind == "residual":
        return ResidualToy(n), True
    return SilentToy(n, clone_boundary=kind == "silent-clone"), False


def _input(kind: str, shape: tuple[int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    if kind == "llama":
        return torch.randint(0, 50, shape, generator=gen)
    return torch.randn(*shape, HIDDEN, generator=gen)


def _forward(kind: str, model: nn.Module, x: torch.Tensor | None, received: IntermediateTensors | None) -> Any:
    if kind != "llama":
        return model(x, received)
    t = (x if x is not None else received["hidden_states"]).shape[1]  # type: ignore[index]
    positions = torch.arange(t).unsqueeze(0)
    return model(input_ids=x, intermediate_tensors=received, position_ids=positions, use_cache=False)


def _last(kind: str, out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(final hidden, aux list) of a last-stage output."""
    if kind != "llama":
        return out
    if isinstance(out, tuple):
        return out[0].last_hidden_state, out[1]
    return out.last_hidden_state, []


# ----------------------------------------------------------------------------------- stage functions
def _compare_stage(ctx: StageContext, cases: list[dict[str, Any]]) -> list[str]:
    """Run each case's forwards through relay, then overlap; return every mismatch found (empty = pass)."""
    problems: list[str] = []
    for case in cases:
        kind, n, partition, ids = case["kind"], case["n"], case.get("partition"), case["ids"]
        model, residual = _build(kind, n)
        model.set_pipeline_stage(ctx.rank, ctx.world_size, partition)
        model.set_aux_hidden_state_layers(ids)
        plan = model.pipespec_layout
        shapes = case["shapes"]
        big = (max(s[0] for s in shapes), max(s[1] for s in shapes))
        sender = HopSender(ctx, hop_keys(plan.stage(ctx.rank), residual), HIDDEN, torch.float32, ctx.rank + 1, big) \
            if not ctx.is_last else None
        receiver = HopReceiver(ctx, hop_keys(plan.stage(ctx.rank - 1), residual), HIDDEN, torch.float32, ctx.rank - 1, big) \
            if not ctx.is_first else None
        overlap = OverlapTransport(ctx, plan, HIDDEN, torch.float32, has_residual=residual, max_leading_shape=(1, 1))
        label = f"{kind} P={ctx.world_size} partition={list(plan.partition)} ids={list(plan.aux_layers)} stage {ctx.rank}"
        for shape in shapes:
            x = _input(kind, shape) if ctx.is_first else None
            with torch.no_grad():
                # relay
                got_relay = receiver.recv(shape) if receiver else None
                got_relay = IntermediateTensors({k: v.clone() for k, v in got_relay.items()}) if got_relay else None
                out_relay = _forward(kind, model, x, got_relay)
                if sender:
                    sender.send(out_relay)
                # overlap
                overlap.attach(model)
                counts: list[int] = []
                start = overlap.messages

                def count(*_: Any, counts: list[int] = counts, hop: OverlapTransport = overlap, start: int = start) -> None:
                    counts.append(hop.messages - start)

                hooks = [model.layers[i].register_forward_pre_hook(count) for i in range(model.start_layer, model.end_layer)]
                got_overlap = overlap.recv(shape) if not ctx.is_first else None
                after_recv = overlap.messages - start
                out_overlap = _forward(kind, model, x, got_overlap)
                after_forward = overlap.messages - start
                for h in hooks:
                    h.remove()
                if not ctx.is_last:
                    overlap.send(out_overlap)
                overlap.detach(model)
            if got_relay is not None:
                assert got_overlap is not None
                bad = got_overlap.mismatches(got_relay, rtol=0, atol=0, check_dtype=True)
                if bad:
                    problems.append(f"{label} {shape}: received {bad}")
                if after_recv != len(overlap.stage.relays):
                    problems.append(f"{label}: sent {after_recv} messages during recv, relays {overlap.stage.relays}")
            if ctx.is_last:
                hidden_r, aux_r = _last(kind, out_relay)
                hidden_o, aux_o = _last(kind, out_overlap)
                if not torch.equal(hidden_r, hidden_o) or len(aux_r) != len(aux_o) or not all(
                    torch.equal(a, b) for a, b in zip(aux_r, aux_o)
                ):
                    problems.append(f"{label} {shape}: last-stage outputs differ")
            elif kind != "silent":
                # Sent as captured: before layer idx runs, every state captured after an earlier layer is
                # already on its way (the aliased boundary key never travels on its own).
                stage, hop = overlap.stage, overlap.out_hop
                assert hop is not None
                expected, sent = [], len(stage.relays) + int(stage.capture_input)
                for idx in range(stage.start_layer, stage.end_layer):
                    expected.append(sent)
                    if idx in stage.capture_after_layers and stage.own_keys[stage.produces.index(idx + 1)] != hop.aliased:
                        sent += 1
                if counts != expected or after_forward != len(hop.aux):
                    problems.append(f"{label} {shape}: messages before each layer {counts} (expected {expected}), "
                                    f"after the forward {after_forward} (expected {len(hop.aux)})")
            elif after_forward != len(overlap.stage.relays):
                problems.append(f"{label}: a silent forward cannot have sent its own states early ({after_forward})")
    return problems


SHAPES = [(1, 5), (1, 1), (2, 3), (1, 9)]


@pytest.mark.timeout(240)
def test_two_stages_receive_exactly_what_relay_delivers() -> None:
    cases = [
        {"kind": "llama", "n": 8, "ids": [2, 4, 5], "shapes": SHAPES},  # EAGLE3 defaults: id 4 = the boundary
        {"kind": "llama", "n": 5, "partition": [4, 1], "ids": [0, 1, 4, 5], "shapes": SHAPES},
        {"kind": "llama", "n": 4, "ids": [], "shapes": SHAPES[:2]},  # no aux states: only hidden travels
        {"kind": "residual", "n": 6, "partition": [2, 4], "ids": [0, 2, 3, 6], "shapes": SHAPES},
        {"kind": "silent", "n": 4, "ids": [1, 2, 3], "shapes": SHAPES[:2]},
    ]
    results = run_stages(_compare_stage, cases, 2, timeout_s=60)
    assert results == [[], []], results


@pytest.mark.timeout(240)
def test_three_stages_uneven_with_ids_on_every_boundary_receive_exactly_what_relay_delivers() -> None:
    cases = [
        {"kind": "llama", "n": 7, "partition": [1, 4, 2], "ids": [0, 1, 3, 5, 7], "shapes": SHAPES},
        {"kind": "llama", "n": 6, "partition": [2, 2, 2], "ids": [2], "shapes": SHAPES},  # stage 1 only relays
        {"kind": "llama", "n": 9, "partition": [4, 3, 2], "ids": [2, 4, 6], "shapes": SHAPES},
        {"kind": "residual", "n": 6, "partition": [1, 3, 2], "ids": [1, 2, 4, 5], "shapes": SHAPES},
        {"kind": "silent", "n": 6, "partition": [3, 1, 2], "ids": [0, 3, 4, 6], "shapes": SHAPES[:2]},
    ]
    results = run_stages(_compare_stage, cases, 3, timeout_s=60)
    assert results == [[], [], []], results


def _alias_stage(ctx: StageContext, alias: bool) -> str:
    model = SilentToy(4, clone_boundary=True)
    model.set_pipeline_stage(ctx.rank, 2)
    model.set_aux_hidden_state_layers([1, 2])  # id 2 ends stage 0, captured as a copy
    overlap = OverlapTransport(ctx, model.pipespec_layout, HIDDEN, torch.float32, alias_boundary=alias)
    if ctx.is_first:
        overlap.send(model(_input("silent", (1, 3))))
        return "sent"
    got = overlap.recv((1, 3))
    return "ok" if torch.equal(got["aux_hidden_states_1"], got["hidden_states"]) else "different"


@pytest.mark.timeout(180)
def test_a_boundary_state_that_is_not_the_output_tensor_is_refused_unless_aliasing_is_off() -> None:
    refused = r"stage 0 failed: RuntimeError: overlap transport: 'aux_hidden_states_1'.*alias_boundary=False"
    with pytest.raises(StageFailedError, match=refused):
        run_stages(_alias_stage, True, 2, timeout_s=20)
    assert run_stages(_alias_stage, False, 2, timeout_s=20) == ["sent", "ok"]


def _silent_peer_stage(ctx: StageContext, _: None) -> None:
    plan = plan_layout(4, 2, aux_layers=[1, 3])
    overlap = OverlapTransport(ctx, plan, HIDDEN, torch.float32)
    if ctx.rank == 1:
        overlap.recv((1, 2))
    else:
        time.sleep(30)


@pytest.mark.timeout(120)
def test_an_overlap_receive_that_never_completes_times_out_naming_the_key_and_peer() -> None:
    started = time.monotonic()
    lost = r"stage 1 failed: PeerLostError: receiving aux_hidden_states_0 \(1, 2\) from stage 0 \(overlap\)"
    with pytest.raises(StageFailedError, match=lost):
        run_stages(_silent_peer_stage, None, 2, timeout_s=3)
    assert time.monotonic() - started < 25


def test_attach_refuses_a_model_configured_for_another_stage() -> None:
    ctx = StageContext(rank=0, world_size=2, device=torch.device("cpu"), backend="gloo",
                       timeout=__import__("datetime").timedelta(seconds=1), launcher="pipespec")
    model = SilentToy(4)
    model.set_pipeline_stage(1, 2)
    overlap = OverlapTransport(ctx, plan_layout(4, 2), HIDDEN, torch.float32)
    with pytest.raises(ValueError, match="this transport is stage 0"):
        overlap.attach(model)
