"""pipespec's mixin with vLLM's own ``IntermediateTensors`` between stages.

vLLM's class is not a Mapping (``__getitem__`` but no ``__contains__``/``__iter__``, so ``key in it``
never returns, and no ``.get`` or ``|``): collect, relay, shape checks and receive buffers must read its
``.tensors``. A three-stage chain handing vLLM's objects along must give the single-stage result.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import pytest
import torch
from torch import nn
from vllm.sequence import IntermediateTensors as VllmIntermediateTensors

from pipespec.contract.mixin import (
    AuxHiddenStatesMixin,
    relay_aux_hidden_states,
    reserve_aux_intermediate_tensor_slots,
)

pytestmark = pytest.mark.timeout(60)


class AddLayer(nn.Module):
    def __init__(self, j: int) -> None:
        super().__init__()
        self.j = j

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 2**self.j


class Stack(AuxHiddenStatesMixin, nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=n, hidden_size=3)
        self.layers = nn.ModuleList(AddLayer(j) for j in range(n))

    def forward(self, x: torch.Tensor | None, intermediate_tensors: VllmIntermediateTensors | None = None):
        hidden = x if self.is_first_stage else intermediate_tensors["hidden_states"]  # type: ignore[index]
        aux = self.collect_remote_aux_hidden_states(intermediate_tensors) if self.is_last_stage else []
        local: list[torch.Tensor] = []
        if self.aux_capture_input:
            self.capture_aux_hidden_state(local, hidden)
        for idx in range(self.start_layer, self.end_layer):
            hidden = self.layers[idx](hidden)
            if idx in self.aux_capture_after_layers:
                self.capture_aux_hidden_state(local, hidden)
        if not self.is_last_stage:
            out = self.make_stage_output(hidden, local, intermediate_tensors)
            return VllmIntermediateTensors(dict(out.tensors))  # what a vLLM stage hands on
        return hidden, aux + local


def test_vllm_intermediate_tensors_is_not_a_mapping() -> None:
    """The premise: vLLM's class has no Mapping protocol (a regression here would make the fix moot)."""
    t = VllmIntermediateTensors({"hidden_states": torch.zeros(1)})
    assert not isinstance(t, Mapping) and not hasattr(t, "get") and not hasattr(t, "__contains__")


def test_three_stage_chain_over_vllm_intermediate_tensors_matches_one_stage() -> None:
    n, counts, ids = 6, [2, 2, 2], (0, 2, 3, 6)
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    stages = []
    for rank in range(3):
        stage = Stack(n)
        stage.set_pipeline_stage(rank, 3, counts)
        stage.set_aux_hidden_state_layers(ids)
        stages.append(stage)
    received = None
    for rank, stage in enumerate(stages):
        if rank > 0:  # the receive buffer is vLLM's class too, filled like vLLM's PP recv does
            buf = stage.make_empty_intermediate_tensors(x.shape[:-1], x.dtype, x.device)
            vbuf = VllmIntermediateTensors({k: torch.empty_like(v) for k, v in buf.tensors.items()})
            assert sorted(vbuf.tensors) == sorted(received.tensors)
            for key, value in received.tensors.items():
                vbuf[key].copy_(value)
            received = vbuf
        out = stage(x if rank == 0 else None, received)
        received = out if rank < 2 else received
    hidden, aux = out
    single = Stack(n)
    single.set_pipeline_stage(0, 1, [n])
    single.set_aux_hidden_state_layers(ids)
    ref_hidden, ref_aux = single(x, None)
    assert torch.equal(hidden, ref_hidden)
    assert [a.tolist() for a in aux] == [a.tolist() for a in ref_aux] == [(x + 2**i - 1).tolist() for i in ids]


def test_relay_and_reserve_keep_vllm_type_and_name_missing_keys() -> None:
    stage = Stack(4)
    stage.set_pipeline_stage(1, 2, [2, 2])
    stage.set_aux_hidden_state_layers((1,))
    sent = VllmIntermediateTensors({"hidden_states": torch.ones(2, 3)})
    reserved = reserve_aux_intermediate_tensor_slots(sent, stage.pipespec_stage)
    assert isinstance(reserved, VllmIntermediateTensors)
    assert sorted(reserved.tensors) == ["aux_hidden_states_0", "hidden_states"]
    relayed = relay_aux_hidden_states(reserved, VllmIntermediateTensors({"hidden_states": torch.zeros(2, 3)}),
                                      ["aux_hidden_states_0"])
    assert isinstance(relayed, VllmIntermediateTensors) and sorted(relayed.tensors) == sorted(reserved.tensors)
    with pytest.raises(RuntimeError, match="missing aux hidden state 'aux_hidden_states_0'.*keys present: \\['hidden_states'\\]"):
        stage.collect_remote_aux_hidden_states(sent)
