"""The aux-state oracle in real SGLang on CPU: with pipespec's plugin, PP = 2 (and 3) returns the same tokens and
hands the draft the same aux states as PP = 1, and PP = 1 equals transformers' float32 hidden states.

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

#: family -> (SGLang's --return-aux-hidden-state-layer-ids, or "" for the default; the pipespec ids they are;
#: the pipeline sizes checked against PP = 1). Llama at PP = 3: one layer a stage, ids 1 and 2 both end a
#: stage, id 0 crosses two hops.
FAMILIES = {
    "llama": ("", [0, 1, 2], (2, 3)),
    "qwen3_moe": ("0,1", [1, 2], (2,)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = write_tiny(name, root / "model")
    sglang_ids, ids, sizes = FAMILIES[name]
    runs = {}
    for pp in (1, *sizes):
        runs[pp] = run_engine(model, pp, root / f"pp{pp}", aux_ids=sglang_ids)
        assert runs[pp].returncode == 0, runs[pp].stderr[-3000:]
    return {"name": name, "model": model, "ids": ids, "runs": runs}


def test_pp1_equals_transformers(family: dict[str, object]) -> None:
    """At PP = 1 the tokens are transformers' greedy ones and the aux states its float32 hidden states."""
    pp1 = family["runs"][1]
    tokens, reference = hf_reference(Path(str(family["model"])), list(family["ids"]), pp1.output_ids)
    assert pp1.output_ids == tokens
    assert pp1.hidden_states is not None and pp1.hidden_states.shape == reference.shape
    torch.testing.assert_close(pp1.hidden_states, reference, atol=1e-5, rtol=1e-5)
    # What SGLang returns is what its logits processor received (the recorder reads the draft's input).
    assert pp1.recorded is not None
    torch.testing.assert_close(pp1.recorded, pp1.hidden_states, atol=0.0, rtol=0.0)


def test_pipeline_with_plugin_equals_pp1(family: dict[str, object]) -> None:
    """At PP = 2 (and 3) the last rank hands the logits processor every aux state, in id order, equal to PP = 1's,
    and the tokens are PP = 1's."""
    runs = family["runs"]
    for pp, run in runs.items():
        assert run.output_ids == runs[1].output_ids, f"PP={pp}"
        assert run.recorded is not None and run.recorded.shape == runs[1].recorded.shape, f"PP={pp}"
        torch.testing.assert_close(run.recorded, runs[1].recorded, atol=1e-5, rtol=1e-5, msg=f"PP={pp}")
