"""pack → relay → collect over a chain of in-process stages equals the single-stage reference.

The toy decoder's layer j adds 2**j to every element, so the tensor of aux id L is identifiable:
it equals base + (2**L - 1) — any wrong, shifted or missing id shows up as a different value.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import plan_layout
from pipespec.contract.mixin import AuxHiddenStatesMixin, hop_keys, relay_aux_hidden_states


class AddLayer(nn.Module):
    def __init__(self, j: int) -> None:
        super().__init__()
        self.delta = float(2**j)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.delta


class ToyStack(AuxHiddenStatesMixin, nn.Module):
    """A hand-written stage-aware decoder stack following the mixin contract."""

    def __init__(self, n: int, hidden: int = 3) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=n, hidden_size=hidden)
        self.layers = nn.ModuleList(AddLayer(j) for j in range(n))

    def forward(self, x: torch.Tensor | None, intermediate_tensors: IntermediateTensors | None = None):
        if self.is_first_stage:
            hidden = x
        else:
            assert intermediate_tensors is not None
            hidden = intermediate_tensors["hidden_states"]
        aux = self.collect_remote_aux_hidden_states(intermediate_tensors) if self.is_last_stage else []
        local: list[torch.Tensor] = []
        if self.aux_capture_input:
            self.capture_aux_hidden_state(local, hidden)
        for idx in range(self.start_layer, self.end_layer):
            hidden = self.layers[idx](hidden)
            if idx in self.aux_capture_after_layers:
                self.capture_aux_hidden_state(local, hidden)
        if not self.is_last_stage:
            return self.make_stage_output(hidden, local, intermediate_tensors)
        return hidden, aux + local


def run_chain(n, counts, ids, x):
    pp = len(counts)
    stages = []
    for rank in range(pp):
        m = ToyStack(n)
        m.set_pipeline_stage(rank, pp, counts)
        m.set_aux_hidden_state_layers(ids)
        stages.append(m)
    received = None
    for rank, m in enumerate(stages):
        if rank > 0:
            buf = m.make_empty_intermediate_tensors(x.shape[:-1], x.dtype, x.device)
            sent_keys = set(hop_keys(stages[rank - 1].pipespec_stage, has_residual=False))
            assert set(buf.keys()) == sent_keys == set(received.keys()), "reserved receive keys != keys sent"
            for k in buf:
                buf[k].copy_(received[k])
            received = buf
        out = m(x if rank == 0 else None, received)
        if rank < pp - 1:
            received = out
            assert stages[rank].aux_hidden_state_relay_keys == stages[rank].pipespec_stage.relays
    return out


@st.composite
def chains(draw):
    pp = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(1, 4), min_size=pp, max_size=pp))
    n = sum(counts)
    bounds = [sum(counts[:i]) for i in range(pp + 1)]
    ids = draw(st.lists(st.one_of(st.integers(0, n), st.sampled_from(bounds)), min_size=1, max_size=6))
    return n, counts, ids


@given(chains())
def test_chain_matches_single_stage_reference_in_id_order(case):
    n, counts, ids = case
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    hidden, aux = run_chain(n, counts, ids, x)
    ref_hidden, ref_aux = run_chain(n, [n], ids, x)
    assert torch.equal(hidden, ref_hidden)
    expected = [x + (2**i - 1) for i in sorted(set(ids))]
    assert len(aux) == len(expected) == len(ref_aux)
    for got, ref, want in zip(aux, ref_aux, expected):
        assert torch.equal(got, want) and torch.equal(ref, want)


@given(chains())
def test_relay_keys_empty_for_two_or_fewer_stages(case):
    n, counts, ids = case
    plan = plan_layout(n, len(counts), ids, partition=counts)
    if len(counts) <= 2:
        assert all(s.relays == () for s in plan.stages)


def test_missing_key_error_names_key_and_keys_present():
    m = ToyStack(4)
    m.set_pipeline_stage(1, 2)
    m.set_aux_hidden_state_layers([1, 3])
    received = IntermediateTensors({"hidden_states": torch.zeros(1, 3)})
    with pytest.raises(RuntimeError, match=r"missing aux hidden state 'aux_hidden_states_0'.*keys present: \['hidden_states'\]"):
        m.collect_remote_aux_hidden_states(received)


def test_relay_missing_key_is_an_error_not_a_shorter_list():
    out = IntermediateTensors({"hidden_states": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="cannot relay aux hidden state 'aux_hidden_states_1'"):
        relay_aux_hidden_states({"aux_hidden_states_0": torch.zeros(1)}, out, ["aux_hidden_states_0", "aux_hidden_states_1"])


def test_pack_rejects_wrong_number_of_states():
    m = ToyStack(4)
    m.set_aux_hidden_state_layers([1, 2])
    with pytest.raises(RuntimeError, match=r"captured 1 aux hidden states but produces ids \[1, 2\]"):
        m.pack_local_aux_hidden_states([torch.zeros(1)])


def test_two_models_in_one_process_keep_separate_plans():
    a, b = ToyStack(8), ToyStack(8)
    a.set_pipeline_stage(0, 2)
    b.set_pipeline_stage(1, 2)
    a.set_aux_hidden_state_layers([2])
    b.set_aux_hidden_state_layers([2, 4, 7])
    assert (a.start_layer, a.end_layer, a.aux_hidden_state_layers) == (0, 4, (2,))
    assert (b.start_layer, b.end_layer, b.aux_hidden_state_layers) == (4, 8, (2, 4, 7))
    assert b.aux_capture_after_layers == frozenset({6})


def test_intermediate_tensors_merge_and_equality():
    a = IntermediateTensors({"hidden_states": torch.ones(2)})
    b = a | {"aux_hidden_states_0": torch.zeros(2)}
    assert sorted(b) == ["aux_hidden_states_0", "hidden_states"] and len(a) == 1
    assert b == IntermediateTensors({"hidden_states": torch.ones(2), "aux_hidden_states_0": torch.zeros(2)})
    assert b != a
    assert "values differ" in IntermediateTensors({"hidden_states": torch.zeros(2)}).mismatches(a)[0]
    with pytest.raises(KeyError, match="keys present"):
        a["residual"]


def test_overlap_sink_sees_each_state_under_its_key_when_captured():
    m = ToyStack(6)
    m.set_pipeline_stage(1, 2, [2, 4])
    m.set_aux_hidden_state_layers([1, 3, 6])
    seen = []
    m.aux_overlap_sink = lambda key, t: seen.append((key, t.clone()))
    x = torch.zeros(1, 3)
    received = IntermediateTensors({"hidden_states": x, "aux_hidden_states_0": x})
    hidden, aux = m(None, received)
    assert [k for k, _ in seen] == ["aux_hidden_states_1", "aux_hidden_states_2"]
    assert torch.equal(seen[0][1], x + (2**3 - 2**2)) and torch.equal(seen[1][1], hidden)
