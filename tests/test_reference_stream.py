"""``pipespec.integrations.vllm.reference_stream``: which layers read their residual (from their source), the
hooks that record a reference decoder's residual stream at aux ids, and the check of aux states against it.
Plain torch modules stand in for vLLM's layers (the module imports no vLLM); the vLLM zoo runs it on real ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipespec.integrations.vllm.reference_stream import (
    ATOL,
    AuxCheckError,
    compare_aux,
    layers_of,
    record_stream,
    uses_residual_input,
)


class ReadsResidual(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
        else:
            hidden_states = hidden_states + residual
            residual = hidden_states
        return 2 * hidden_states, residual


class IgnoresResidual(torch.nn.Module):  # PhiMoE / EXAONE-4 style: the stream is hidden_states alone
    def forward(self, hidden_states: torch.Tensor, residual: Any = None) -> tuple[torch.Tensor, Any]:
        residual = hidden_states
        return hidden_states + 1, residual


class TakesNoResidual(torch.nn.Module):  # StableLM style
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hidden_states * 3, None


def test_the_first_use_of_residual_decides() -> None:
    assert uses_residual_input(ReadsResidual)
    assert not uses_residual_input(IgnoresResidual)
    assert not uses_residual_input(TakesNoResidual)


class Decoder(torch.nn.Module):
    def __init__(self, kinds: list[type]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(kind() for kind in kinds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = (layer(hidden, residual) if not isinstance(layer, TakesNoResidual) else layer(hidden))
        return hidden + residual if isinstance(residual, torch.Tensor) else hidden


def test_the_recorded_stream_is_what_enters_each_layer_and_the_last_output() -> None:
    decoder = Decoder([ReadsResidual, ReadsResidual, IgnoresResidual])
    assert layers_of(decoder) is decoder.layers
    x = torch.arange(6.0).reshape(1, 2, 3)
    with record_stream(decoder, (0, 1, 2, 3)) as stream:
        decoder(x)
    # Layer 0 gets x and no residual; layer 1 gets (2x, x): stream 3x; layer 2 ignores its residual: 2 * 3x.
    torch.testing.assert_close(stream[0], x)
    torch.testing.assert_close(stream[1], 3 * x)
    torch.testing.assert_close(stream[2], 6 * x)
    torch.testing.assert_close(stream[3], 6 * x + 1)  # the last layer's output, its stale residual not added
    assert compare_aux([stream[1], stream[3]], stream, (1, 3), "PP=1") == 0.0


def test_a_mismatch_names_the_ids_and_by_how_much() -> None:
    want = {1: torch.zeros(1, 2, 3), 3: torch.zeros(1, 2, 3)}
    off = torch.zeros(1, 2, 3)
    off[0, 0, 0] = 10 * ATOL
    with pytest.raises(AuxCheckError, match=r"PP=1: aux id 3 differs from the residual stream \(worst: id 3 by 0\.0001"):
        compare_aux([want[1], off], want, (1, 3), "PP=1")
    with pytest.raises(AuxCheckError, match=r"1 aux states returned for ids \[1, 3\]"):
        compare_aux([want[1]], want, (1, 3), "PP=1")
    nan = torch.full((1, 2, 3), float("nan"))
    with pytest.raises(AuxCheckError, match="aux id 1 differs"):  # NaN is the worst, never a pass
        compare_aux([nan, want[3]], want, (1, 3), "PP=1")
