"""The aux-state oracle in real SGLang on CPU: with pipespec's plugin, every pipeline returns transformers' greedy
tokens and hands the draft transformers' float32 hidden states, and PP = 2 (and 3) hands it what PP = 1 does.

Tiny random 3-layer checkpoints: one family with SGLang's list capture and its own decoder (Llama), a dense
Qwen (Qwen3, its own decoder forward in qwen3.py over Qwen2's model class), and one MoE whose decoder forward is
inherited from another file (Qwen3-MoE over Qwen2-MoE). Llama and Qwen3 run the default EAGLE3 ids (pipespec ids
0, 1, 2: id 0 and the stage boundaries of PP = 2 and 3); Qwen3-MoE runs SGLang ids 0, 1 (pipespec 1, 2: the
boundary first). SGLang's ids are non-negative (no id 0 on the command line), and Qwen2-MoE's own setter indexes
``self.layers[id + 1]``, so SGLang id N - 1 (pipespec N) fails there with an IndexError before any forward, with
or without pipespec. One engine per (family, PP), shared by the asserts of the family's tests. PP = 1 equals
transformers for Llama and Qwen3-MoE, so Qwen3 runs PP = 2 only, compared with transformers directly.
"""

from __future__ import annotations

import pytest
import torch
from harness import hf_reference, run_engine, write_tiny

pytestmark = pytest.mark.timeout(1200)

#: family -> (SGLang's --return-aux-hidden-state-layer-ids, or "" for the default; the pipespec ids they are;
#: the pipeline sizes run). Llama at PP = 3: one layer a stage, ids 1 and 2 both end a stage, id 0 crosses two
#: hops.
FAMILIES = {
    "llama": ("", [0, 1, 2], (1, 2, 3)),
    "qwen3": ("", [0, 1, 2], (2,)),
    "qwen3_moe": ("0,1", [1, 2], (1, 2)),
}
WITH_PP1 = sorted(name for name, (_, _, sizes) in FAMILIES.items() if 1 in sizes)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = write_tiny(name, root / "model")
    sglang_ids, ids, sizes = FAMILIES[name]
    runs = {}
    for pp in sizes:
        runs[pp] = run_engine(model, pp, root / f"pp{pp}", aux_ids=sglang_ids)
        assert runs[pp].returncode == 0, runs[pp].stderr[-3000:]
    tokens, reference = hf_reference(model, ids, runs[sizes[0]].output_ids)
    return {"name": name, "model": model, "ids": ids, "runs": runs, "tokens": tokens, "reference": reference}


def test_every_run_equals_transformers(family: dict[str, object]) -> None:
    """At every pipeline size the tokens are transformers' greedy ones and the aux states the logits processor
    receives are its float32 hidden states at the pipespec ids, in id order."""
    reference = family["reference"]
    assert isinstance(reference, torch.Tensor)
    for pp, run in family["runs"].items():
        assert run.output_ids == family["tokens"], f"PP={pp}"
        assert run.recorded is not None and run.recorded.shape == reference.shape, f"PP={pp}"
        torch.testing.assert_close(run.recorded, reference, atol=1e-5, rtol=1e-5, msg=f"PP={pp}")


@pytest.mark.parametrize("family", WITH_PP1, indirect=True)
def test_pp1_returns_what_the_logits_processor_received(family: dict[str, object]) -> None:
    """At PP = 1 SGLang returns the aux states: transformers' hidden states, and exactly what the logits
    processor (the draft's input) received."""
    pp1 = family["runs"][1]
    assert pp1.hidden_states is not None
    torch.testing.assert_close(pp1.hidden_states, family["reference"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pp1.recorded, pp1.hidden_states, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("family", WITH_PP1, indirect=True)
def test_pipeline_with_plugin_equals_pp1(family: dict[str, object]) -> None:
    """At PP = 2 (and 3) the last rank hands the logits processor every aux state, in id order, equal to PP = 1's,
    and the tokens are PP = 1's."""
    runs = family["runs"]
    for pp, run in runs.items():
        assert run.output_ids == runs[1].output_ids, f"PP={pp}"
        assert run.recorded is not None and run.recorded.shape == runs[1].recorded.shape, f"PP={pp}"
        torch.testing.assert_close(run.recorded, runs[1].recorded, atol=1e-5, rtol=1e-5, msg=f"PP={pp}")
