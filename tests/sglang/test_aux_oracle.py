"""The aux-state oracle in real SGLang on CPU: with pipespec's plugin, PP = 2 returns the same tokens and hands
the draft the same aux states as PP = 1, and PP = 1 equals transformers' float32 hidden states.

Tiny random 3-layer checkpoints, one family with SGLang's list capture and its own decoder (Llama), one MoE
whose decoder forward is inherited from another file (Qwen3-MoE over Qwen2-MoE). Llama runs the default
EAGLE3 ids (pipespec ids 0, 1, 2: id 0 and, at PP = 2, the stage boundary 1); Qwen3-MoE runs SGLang ids
0, 1 (pipespec 1, 2: the boundary first). SGLang's ids are non-negative (no id 0 on the command line), and
Qwen2-MoE's own setter indexes ``self.layers[id + 1]``, so SGLang id N - 1 (pipespec N) fails there with an
IndexError before any forward, with or without pipespec. One engine per (family, PP), shared by the asserts
of the family's tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import hf_reference, run_engine, write_tiny

pytestmark = pytest.mark.timeout(1200)

#: family -> (SGLang's --return-aux-hidden-state-layer-ids, or "" for the default; the pipespec ids they are)
FAMILIES = {
    "llama": ("", [0, 1, 2]),
    "qwen3_moe": ("0,1", [1, 2]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = write_tiny(name, root / "model")
    sglang_ids, ids = FAMILIES[name]
    pp1 = run_engine(model, 1, root / "pp1", aux_ids=sglang_ids)
    assert pp1.returncode == 0, pp1.stderr[-3000:]
    pp2 = run_engine(model, 2, root / "pp2", aux_ids=sglang_ids)
    assert pp2.returncode == 0, pp2.stderr[-3000:]
    return {"name": name, "model": model, "ids": ids, "pp1": pp1, "pp2": pp2}


def test_pp1_equals_transformers(family: dict[str, object]) -> None:
    """At PP = 1 the tokens are transformers' greedy ones and the aux states its float32 hidden states."""
    pp1 = family["pp1"]
    tokens, reference = hf_reference(Path(str(family["model"])), list(family["ids"]), pp1.output_ids)
    assert pp1.output_ids == tokens
    assert pp1.hidden_states is not None and pp1.hidden_states.shape == reference.shape
    torch.testing.assert_close(pp1.hidden_states, reference, atol=1e-5, rtol=1e-5)
    # What SGLang returns is what its logits processor received (the recorder reads the draft's input).
    assert pp1.recorded is not None
    torch.testing.assert_close(pp1.recorded, pp1.hidden_states, atol=0.0, rtol=0.0)


def test_pp2_with_plugin_equals_pp1(family: dict[str, object]) -> None:
    """At PP = 2 the last rank hands the logits processor every aux state, in id order, equal to PP = 1's."""
    pp1, pp2 = family["pp1"], family["pp2"]
    assert pp2.output_ids == pp1.output_ids
    assert pp2.recorded is not None and pp2.recorded.shape == pp1.recorded.shape
    torch.testing.assert_close(pp2.recorded, pp1.recorded, atol=1e-5, rtol=1e-5)
