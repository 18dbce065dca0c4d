"""The vllm dialect (``adapt_vllm_native``): vLLM's own EAGLE3-over-PP contract, on real vLLM 0.32 files.

Golden fixtures are byte-exact copies of vLLM 0.32's model files (tests/fixtures/vllm_native/) with
their committed outputs; the rest are before/after strings of each loop form, each decline reason, the
usage errors and the CLI's refusals (exit 2, nothing written). The import of the outputs inside real
vLLM is tests/vllm/test_codegen_import.py.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipespec import __version__
from pipespec.codemods.adapt_vllm_native import GENERATOR, GENERATOR_VERSION, adapt_vllm_module
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
# byte-exact copies of vLLM files, one folder per release (dropping a release deletes its folder), each
# adapted file's committed output in <release>/expected/
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_native"
ADAPTER_GEN = str(Path(sys.executable).parent / "adapter-gen")
# release/file -> (path in vLLM, decoder, status, holders, decoder attribute): what each fixture covers
GOLDEN = {
    "0.32.0/gemma2": ("model_executor/models/gemma2.py", "Gemma2Model", "adapted", ("Gemma2ForCausalLM",), "model"),  # islice loop made enumerate
    "0.32.0/qwen3_moe": ("model_executor/models/qwen3_moe.py", "Qwen3MoeModel", "adapted", ("Qwen3MoeForCausalLM",), "model"),  # PP=1-only capture rewritten
    "0.32.0/gpt2": ("model_executor/models/gpt2.py", "GPT2Model", "adapted", ("GPT2LMHeadModel",), "transformer"),  # no residual, .transformer, .wte
    "0.32.0/solar": ("model_executor/models/solar.py", "SolarModel", "adapted", ("SolarForCausalLM",), "model"),  # range loop, first-rank-only embedding
    "0.32.0/qwen3_vl_moe": ("model_executor/models/qwen3_vl_moe.py", "Qwen3MoeLLMModel", "adapted", ("Qwen3MoeLLMForCausalLM",), "model"),  # islice(enumerate(...))
    "0.32.0/step1": ("model_executor/models/step1.py", "StepDecoderModel", "adapted", ("Step1ForCausalLM",), "model"),  # enumerate over a slice
    "0.32.0/llama": ("model_executor/models/llama.py", "LlamaModel", "unchanged", ("LlamaForCausalLM",), "model"),  # already PP-correct: byte-identical
    # the model's own id start_layer capture (a clone) kept on the first rank, its residual picked by config
    "0.34.0/cohere2_moe": ("model_executor/models/cohere2_moe.py", "Cohere2MoeModel", "adapted", ("Cohere2MoeForCausalLM",), "model"),
    # the residual folded into the one tensor sent on (residual + all_reduce(hidden_states))
    "0.34.0/deepseek_v32_amd_model": ("models/deepseek_v32/amd/model.py", "DeepseekV32Model", "adapted", ("DeepseekV32ForCausalLM",), "model"),
    "0.34.0/deepseek_v32_nvidia_model": ("models/deepseek_v32/nvidia/model.py", "DeepseekV32Model", "adapted", ("DeepseekV32ForCausalLM",), "model"),
    # `(kernel or layer)(...)` in the attention-residual branch: one loop per config branch again
    "0.34.0/kimi_k3_amd_linear": ("models/kimi_k3/amd/linear.py", "KimiLinearModel", "adapted", ("KimiLinearForCausalLM",), "model"),
    # normalized_states: the next layer's norm computed early, dropped at every hand-off
    "0.34.0/beam_amd_model": ("models/beam/amd/model.py", "BeamModel", "adapted", ("BeamForCausalLM",), "model"),
    "0.34.0/beam_nvidia_model": ("models/beam/nvidia/model.py", "BeamModel", "adapted", ("BeamForCausalLM",), "model"),
    # already PP-correct: layers looped through a local name inside if / try
    "0.34.0/minimax_m3_amd_model": ("models/minimax_m3/amd/model.py", "MiniMaxM3Model", "unchanged",
                                    ("MiniMaxM3SparseForCausalLM",), "model"),
    # already PP-correct with the flag inherited from LlamaModel (a loop over a conditional expression on AMD)
    "0.34.0/muse_spark_amd_model": ("models/muse_spark/amd/model.py", "MuseSparkModel", "unchanged", ("MuseSparkForCausalLM",), "model"),
    "0.34.0/muse_spark_nvidia_model": ("models/muse_spark/nvidia/model.py", "MuseSparkModel", "unchanged", ("MuseSparkForCausalLM",), "model"),
    "0.33.0/muse_spark_amd_model": ("models/muse_spark/amd/model.py", "MuseSpark1xModel", "unchanged", ("MuseSpark1xForCausalLM",), "model"),
    "0.34.0/llama": ("model_executor/models/llama.py", "LlamaModel", "unchanged", ("LlamaForCausalLM",), "model"),
    # the residual folded in after the loop, then a sequence-parallel gather applied to each capture too
    "0.34.0/step5_nvidia_model": ("models/step5/nvidia/model.py", "Step5Model", "adapted", ("Step5ForCausalLM",), "model"),
    # one loop per config branch, the specialized-decode one inside a `try`, both falling through
    "0.33.0/minimax_m3_amd_model": ("models/minimax_m3/amd/model.py", "MiniMaxM3Model", "adapted",
                                    ("MiniMaxM3SparseForCausalLM",), "model"),
}
pytestmark = pytest.mark.timeout(120)


def label(key: str) -> str:
    release, _ = key.split("/")
    return f"vllm/{GOLDEN[key][0]} (vllm {release})"


def fixture_reader(release: str):  # type: ignore[no-untyped-def]
    """What a fixture imports from a sibling fixture of its release (qwen3_vl_moe's decoder subclasses
    qwen3_moe's; MuseSpark's subclasses llama's LlamaModel)."""

    def read(dotted: str) -> str | None:
        path = FIXTURES / release / f"{dotted.rsplit('.', 1)[-1]}.py"
        return path.read_text() if path.is_file() else None

    return read


def fixture_module(dotted: str) -> str | None:
    return fixture_reader("0.32.0")(dotted)


def golden(key: str) -> tuple[str, Path]:
    """(the fixture's source, where its committed output is: the source itself when unchanged)."""
    release, name = key.split("/")
    source = FIXTURES / release / f"{name}.py"
    return source.read_text(), source if GOLDEN[key][2] == "unchanged" else FIXTURES / release / "expected" / f"{name}.py"


def adapt(code: str, **kwargs: object):  # type: ignore[no-untyped-def]
    return adapt_vllm_module(textwrap.dedent(code), label="toy.py", **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- golden files
@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_fixture_output_is_the_committed_file(key: str) -> None:
    """Each real vLLM file adapts to its committed output byte for byte, with the outcome it covers; a
    file already PP-correct comes back byte-identical."""
    source, expected = golden(key)
    result = adapt_vllm_module(source, label=label(key), read_module=fixture_reader(key.split("/")[0]))
    assert result.code == expected.read_text()
    (outcome,) = result.decoders
    assert (outcome.class_name, outcome.status, outcome.causal_lm, outcome.decoder_attr) == GOLDEN[key][1:]
    if outcome.status == "unchanged":
        assert result.code == source


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_output_is_a_fixed_point(key: str) -> None:
    """T(T(x)) == T(x): every output comes back byte-identical and "unchanged"."""
    adapted = golden(key)[1].read_text()
    again = adapt_vllm_module(adapted, label=label(key), read_module=fixture_reader(key.split("/")[0]))
    assert again.code == adapted and [d.status for d in again.decoders] == ["unchanged"]


def test_generated_code_follows_llamas_contract_and_imports_no_pipespec() -> None:
    out = (FIXTURES / "0.32.0" / "expected" / "qwen3_moe.py").read_text()
    assert "pipespec" not in "".join(line for line in out.splitlines(True) if "import" in line)
    for piece in ("remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)",
                  "if get_pp_group().is_first_rank:\n            self._maybe_add_hidden_state(\n"
                  "                aux_hidden_states, self.start_layer, hidden_states, residual",
                  "aux_hidden_states, layer_idx + 1, hidden_states, residual",
                  "**self.pack_local_aux_hidden_states(aux_hidden_states),",
                  "aux_hidden_states = remote_aux + aux_hidden_states\n        if len(aux_hidden_states) > 0:\n"
                  "            return hidden_states, aux_hidden_states\n        return hidden_states",
                  "class Qwen3MoeModel(nn.Module, EagleModelMixin):\n    supports_aux_hidden_states_over_pp = True\n"
                  f'    pipespec_generated_by = "{GENERATOR} v{GENERATOR_VERSION} from vllm/model_executor/models/qwen3_moe.py"'):
        assert piece in out, piece
    assert "self._maybe_add_hidden_state(\n            [], self.start_layer" not in out  # the PP=1-only capture is gone


def test_generated_header_names_the_generator_version_not_pipespecs() -> None:
    """A pipespec release that does not change the output leaves every generated file (and golden) as it
    is: the header and the marker name the codemod's own generator version only."""
    for key in GOLDEN:
        if GOLDEN[key][2] != "adapted":
            continue
        out = golden(key)[1].read_text()
        stamped = [line for line in out.splitlines() if "Generated by pipespec" in line or "pipespec_generated_by" in line]
        assert len(stamped) == 2, key
        assert all(f"{GENERATOR} v{GENERATOR_VERSION}" in line and __version__ not in line for line in stamped), stamped


def test_decoder_under_another_attribute_gets_what_vllm_looks_for() -> None:
    """GPT-2 keeps its decoder at .transformer and its embedding at .wte: the drafter's .model.embed_tokens
    and the protocol's layer lookups are provided as properties/methods, registering no module twice."""
    out = (FIXTURES / "0.32.0" / "expected" / "gpt2.py").read_text()
    assert "    @property\n    def embed_tokens(self) -> nn.Module:" in out and "        return self.wte\n" in out
    assert "    @property\n    def model(self) -> nn.Module:" in out and "        return self.transformer\n" in out
    assert "        self.transformer._set_aux_hidden_state_layers(layers)\n" in out
    assert "        num_layers = len(self.transformer.h)\n" in out
    assert "class GPT2ForSequenceClassification(nn.Module, SupportsCrossEncoding):" in out  # not a causal LM


def test_first_rank_only_embedding_is_also_built_where_a_drafter_needs_it() -> None:
    out = (FIXTURES / "0.32.0" / "expected" / "solar.py").read_text()
    assert ") or spec_decode_needs_target_embed(vllm_config):\n            self.embed_tokens = VocabParallelEmbedding(" in out
    assert "    spec_decode_needs_target_embed,\n" in out  # added to the file's own `from .utils import (...)`


# ---------------------------------------------------------------------------------- before / after
HEAD = """\
    from itertools import islice

    import torch
    from torch import nn

    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    from .interfaces import SupportsPP


    class ToyModel(nn.Module):
        def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
            if get_pp_group().is_first_rank:
                hidden_states = self.embed_tokens(input_ids)
                residual = None
            else:
                hidden_states = intermediate_tensors["hidden_states"]
                residual = intermediate_tensors["residual"]
"""
LAYERS = """
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.start_layer, self.end_layer, self.layers = make_layers(4, lambda prefix: ToyLayer(prefix), prefix)


    class ToyLayer(nn.Module):
        def forward(self, positions, hidden_states, residual):
            if residual is None:  # the fused add-norm form: the stream is hidden_states + residual
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
"""
TAIL = """\
            if not get_pp_group().is_last_rank:
                return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states
""" + LAYERS + """

    class ToyForCausalLM(nn.Module, SupportsPP):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)
"""


def test_plain_islice_loop_before_after() -> None:
    """The whole rewrite of the simplest decoder, as vLLM's llama.py has it."""
    before = HEAD + """\
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                hidden_states, residual = layer(positions, hidden_states, residual)
""" + TAIL
    after = '''\
    # Generated by pipespec (adapt_vllm_native v2) from toy.py.
    # Adapted to vLLM's EAGLE3-over-PP contract (EagleModelMixin, SupportsEagle3):
    # ToyModel, ToyForCausalLM.
    # Do not edit those classes by hand; regenerate them with
    #     adapter-gen toy.py --dialect vllm

    from itertools import islice

    import torch
    from torch import nn

    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    from .interfaces import EagleModelMixin, SupportsEagle3, SupportsPP


    class ToyModel(nn.Module, EagleModelMixin):
        supports_aux_hidden_states_over_pp = True
        pipespec_generated_by = "adapt_vllm_native v2 from toy.py"

        def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
            if get_pp_group().is_first_rank:
                hidden_states = self.embed_tokens(input_ids)
                residual = None
            else:
                hidden_states = intermediate_tensors["hidden_states"]
                residual = intermediate_tensors["residual"]

            remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)

            aux_hidden_states: list[torch.Tensor] = []
            if get_pp_group().is_first_rank:
                self._maybe_add_hidden_state(
                    aux_hidden_states, self.start_layer, hidden_states, residual
                )
            for idx, layer in enumerate(
                islice(self.layers, self.start_layer, self.end_layer),
                start=self.start_layer,
            ):
                hidden_states, residual = layer(positions, hidden_states, residual)
                self._maybe_add_hidden_state(
                    aux_hidden_states, idx + 1, hidden_states, residual
                )
            if not get_pp_group().is_last_rank:
                return IntermediateTensors(
                    {
                        "hidden_states": hidden_states,
                        "residual": residual,
                        **self.pack_local_aux_hidden_states(aux_hidden_states),
                    }
                )
            hidden_states, _ = self.norm(hidden_states, residual)
            aux_hidden_states = remote_aux + aux_hidden_states
            if len(aux_hidden_states) > 0:
                return hidden_states, aux_hidden_states
            return hidden_states
''' + LAYERS + '''

    class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)
'''
    result = adapt(before)
    assert result.code == textwrap.dedent(after)
    assert [(d.status, d.causal_lm, d.decoder_attr) for d in result.decoders] == [("adapted", ("ToyForCausalLM",), "model")]


@pytest.mark.parametrize(
    ("loop", "header", "capture"),
    [
        ("for layer in self.layers[self.start_layer : self.end_layer]:\n    hidden_states, residual = layer(hidden_states, residual)",
         "for idx, layer in enumerate(self.layers[self.start_layer : self.end_layer], start=self.start_layer):",
         "_maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)"),
        ("for i, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):\n"
         "    hidden_states, residual = layer(hidden_states, residual, i)",
         "for i, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):",
         "_maybe_add_hidden_state(aux_hidden_states, self.start_layer + i + 1, hidden_states, residual)"),
        ("for i, layer in islice(enumerate(self.layers), self.start_layer, self.end_layer):\n"
         "    hidden_states, residual = layer(hidden_states, residual)",
         "for i, layer in islice(enumerate(self.layers), self.start_layer, self.end_layer):",
         "_maybe_add_hidden_state(aux_hidden_states, i + 1, hidden_states, residual)"),
        ("for i in range(self.start_layer, self.end_layer):\n    layer = self.layers[i]\n"
         "    hidden_states, residual = layer(hidden_states, residual)",
         "for i in range(self.start_layer, self.end_layer):",
         "_maybe_add_hidden_state(aux_hidden_states, i + 1, hidden_states, residual)"),
        ("for i in range(self.start_layer, self.end_layer):\n    hidden_states, residual = self.layers[i](hidden_states, residual)",
         "for i in range(self.start_layer, self.end_layer):",
         "_maybe_add_hidden_state(aux_hidden_states, i + 1, hidden_states, residual)"),
    ],
    ids=["slice", "enumerate-from-0", "islice-enumerate", "range-layer-assign", "range-index-call"],
)
def test_each_loop_form_captures_with_the_global_layer_index(loop: str, header: str, capture: str) -> None:
    """The aux id after a layer is its global index + 1 on every stage, whatever the loop counts."""
    before = HEAD + textwrap.indent(loop, " " * 12) + "\n" + TAIL
    code = adapt(before).code
    assert squeeze(header) in squeeze(code) and squeeze(capture) in squeeze(code)
    assert adapt_vllm_module(code, label="toy.py").code == code


def squeeze(code: str) -> str:
    """Code without whitespace or magic trailing commas: the same text whether wrapped or not."""
    return "".join(code.split()).replace(",)", ")")


def test_no_residual_model_passes_none() -> None:
    before = HEAD.replace('                residual = intermediate_tensors["residual"]\n', "").replace(
        "                residual = None\n", "") + """\
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                hidden_states = layer(positions, hidden_states)
""" + TAIL.replace(', "residual": residual', "").replace("hidden_states, _ = self.norm(hidden_states, residual)",
                                                         "hidden_states = self.norm(hidden_states)")
    code = adapt(before).code
    assert squeeze("self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, None)") in squeeze(code)
    assert squeeze("self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, None)") in squeeze(code)


def test_pp1_only_capture_and_direct_setter_are_rewritten() -> None:
    """A decoder that captured at PP=1 only (aux list, membership checks) gets the contract's capture, and a
    setter that writes aux_hidden_state_layers directly goes through _set_aux_hidden_state_layers (which
    caches the stage's slot base)."""
    before = HEAD.replace("class ToyModel(nn.Module):", "class ToyModel(nn.Module, EagleModelMixin):") + """\
            aux_hidden_states = []
            for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
                if idx in self.aux_hidden_state_layers:
                    aux_hidden_states.append(hidden_states + residual)
                hidden_states, residual = layer(positions, hidden_states, residual)
            if not get_pp_group().is_last_rank:
                return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
            hidden_states, _ = self.norm(hidden_states, residual)
            # Return auxiliary hidden states if collected
            if len(aux_hidden_states) > 0:
                return hidden_states, aux_hidden_states
            return hidden_states
""" + LAYERS + """

    class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)

        def set_aux_hidden_state_layers(self, layers):
            self.model.aux_hidden_state_layers = layers
"""
    code = adapt(before.replace("from .interfaces import SupportsPP", "from .interfaces import EagleModelMixin, SupportsEagle3, SupportsPP")).code
    assert "if idx in self.aux_hidden_state_layers" not in code and "aux_hidden_states = []" not in code
    assert "Return auxiliary hidden states" not in code
    assert code.count("if len(aux_hidden_states) > 0:") == 1
    assert "        self.model._set_aux_hidden_state_layers(layers)\n" in code
    assert "class ToyModel(nn.Module, EagleModelMixin):\n    supports_aux_hidden_states_over_pp = True" in code


# ---------------------------------------------------------------------------------- declines
DECLINES = {
    "carried-state": (
        "for layer in self.layers[self.start_layer : self.end_layer]:\n"
        "    hidden_states, pending = layer(positions, hidden_states, pending=pending)",
        "line 21: the layer call assigns `hidden_states, pending`: `pending` is carried from layer to layer but "
        "the next stage receives only `hidden_states` and `residual`"),
    "continue": (
        "for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
        "    if layer is None:\n        continue\n    hidden_states, residual = layer(hidden_states, residual)",
        "line 22: the layer loop uses `continue`: a layer skipped or left early would skip its capture"),
    "nested-loop": (
        "for _ in range(2):\n    for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
        "        hidden_states, residual = layer(hidden_states, residual)",
        "line 21: the layer loop `for ... in islice(self.layers, self.start_layer, self.end_layer)` runs inside "
        "`for ... in range(2)`: every layer runs once per outer iteration"),
    "loop-in-if": (
        "if self.fast:\n    for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
        "        hidden_states, residual = layer(hidden_states, residual)",
        "line 21: the layer loop `for ... in islice(self.layers, self.start_layer, self.end_layer)` is nested "
        "inside another statement"),
    "two-running-loops": (
        "for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
        "    hidden_states, residual = layer(hidden_states, residual)\n"
        "for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
        "    hidden_states, residual = layer(hidden_states, residual)",
        "line 22: forward has 2 loops that run this stage's layers (lines 20, 22)"),
    "gathered-capture": (
        "aux_hidden_states = []\n"
        "for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):\n"
        "    if idx in self.aux_hidden_state_layers:\n"
        "        aux_hidden_states.append(tensor_model_parallel_all_gather(hidden_states + residual, 0))\n"
        "    hidden_states, residual = layer(hidden_states, residual)",
        "line 22: `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(tensor_model_parallel_"),
}


@pytest.mark.parametrize("case", sorted(DECLINES))
def test_decline_names_the_construct_and_its_line(case: str) -> None:
    loop, reason = DECLINES[case]
    result = adapt(HEAD + textwrap.indent(loop, " " * 12) + "\n" + TAIL)
    (outcome,) = result.decoders
    assert outcome.status == "declined" and outcome.reason.startswith(reason), outcome.reason
    assert result.code == textwrap.dedent(HEAD + textwrap.indent(loop, " " * 12) + "\n" + TAIL)


def test_reshaped_hand_off_is_declined_with_the_branch() -> None:
    """hy_v4's iHC branch sends `hidden_states.flatten(1)`: a capture there would not be what is sent."""
    tail = TAIL.replace('            if not get_pp_group().is_last_rank:\n',
                        '            if not get_pp_group().is_last_rank:\n                if self.enable_ihc:\n'
                        '                    return IntermediateTensors({"hidden_states": hidden_states.flatten(1)})\n')
    loop = "            for layer in islice(self.layers, self.start_layer, self.end_layer):\n" \
           "                hidden_states, residual = layer(positions, hidden_states, residual)\n"
    (outcome,) = adapt(HEAD + loop + tail).decoders
    assert outcome.status == "declined"
    assert outcome.reason.startswith('line 24: a non-last-rank return sends `hidden_states.flatten(1)` as "hidden_states"')


def test_explicit_opt_out_is_declined_with_what_is_really_there() -> None:
    """MiMo sets the flag False itself over a forward that captures nothing: say exactly that."""
    code = (ROOT / ".venv-vllm/lib/python3.11/site-packages/vllm/model_executor/models/mimo.py")
    source = code.read_text() if code.exists() else textwrap.dedent("""\
        class MiMoModel(Qwen2Model):
            supports_aux_hidden_states_over_pp = False

            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
                for layer in islice(self.layers, self.start_layer, self.end_layer):
                    hidden_states, residual = layer(positions, hidden_states, residual)
                if not get_pp_group().is_last_rank:
                    return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
                return hidden_states + residual
        """)
    result = adapt_vllm_module(source, label="mimo.py")
    (outcome,) = result.decoders
    assert outcome.status == "declined" and result.code == source
    assert "MiMoModel opts out by hand: `supports_aux_hidden_states_over_pp = False`, over a forward that captures " \
           "no aux states (it overrides Qwen2Model.forward)" in outcome.reason
    assert outcome.reason.startswith("line ")


def test_spec_embed_rule_is_checked_against_the_source() -> None:
    source = (FIXTURES / "0.32.0" / "gpt2.py").read_text()
    spec = AdapterSpec(name="gpt2", decoder_class="vllm.model_executor.models.gpt2:GPT2Model", dialect="vllm",
                       layers_attr="h", embed_attr="wte", embed_decoder_attr="transformer")
    assert [d.status for d in adapt_vllm_module(source, label="gpt2.py", spec=spec).decoders] == ["adapted"]
    wrong = AdapterSpec(name="gpt2", decoder_class="vllm.model_executor.models.gpt2:GPT2Model", dialect="vllm",
                        layers_attr="h", embed_attr="wte", embed_decoder_attr="model")
    (outcome,) = adapt_vllm_module(source, label="gpt2.py", spec=wrong).decoders
    assert outcome.status == "declined" and "says embed.decoder_attr = 'model' but GPT2LMHeadModel holds GPT2Model " \
                                            "as self.transformer: fix the spec" in outcome.reason


def test_absolute_imports_for_out_of_tree_modules() -> None:
    source = (FIXTURES / "0.32.0" / "gemma2.py").read_text()
    code = adapt_vllm_module(source, label="gemma2.py", absolute_imports=True).code
    assert "from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3, SupportsLoRA, SupportsPP" \
        not in code  # the file's own `.interfaces` import line is extended, not duplicated
    assert "from .interfaces import EagleModelMixin, SupportsEagle3, SupportsLoRA, SupportsPP" in code
    bare = textwrap.dedent(HEAD + "            for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
                           "                hidden_states, residual = layer(hidden_states, residual)\n" + TAIL)
    bare = bare.replace("from .interfaces import SupportsPP\n", "from vllm.model_executor.models.interfaces import SupportsPP\n")
    out = adapt_vllm_module(bare, label="toy.py", absolute_imports=True).code
    assert squeeze("from vllm.model_executor.models.interfaces import (EagleModelMixin, SupportsEagle3, SupportsPP)") \
        in squeeze(out)
    plain = bare.replace("from vllm.model_executor.models.interfaces import SupportsPP\n", "")
    assert "from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3\n" in adapt_vllm_module(
        plain.replace("(nn.Module, SupportsPP)", "(nn.Module)"), label="toy.py", absolute_imports=True).code


# ---------------------------------------------------------------------------------- usage errors
def test_file_without_a_pp_decoder_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"^plain\.py: no PP decoder here .*classes here: Foo\)"):
        adapt_vllm_module("class Foo:\n    def forward(self, x):\n        return x\n", label="plain.py")


def test_unknown_class_lists_the_classes_present() -> None:
    code = textwrap.dedent(HEAD + "            for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
                           "                hidden_states, residual = layer(hidden_states, residual)\n" + TAIL)
    with pytest.raises(UsageError, match=r"no top-level class 'Nope' \(classes here: ToyModel, ToyLayer, ToyForCausalLM\)"):
        adapt_vllm_module(code, label="toy.py", classes=["Nope"])
    assert [d.class_name for d in adapt_vllm_module(code, label="toy.py", classes=["ToyForCausalLM"]).decoders] == ["ToyModel"]


# ---------------------------------------------------------------------------------- CLI
def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([ADAPTER_GEN, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def one_error_line(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adapter-gen: error: ") and fragment in lines[0], proc.stderr


def test_cli_adapts_every_decoder_in_place_then_checks_clean(tmp_path: Path) -> None:
    src = tmp_path / "gemma2.py"
    shutil.copy(FIXTURES / "0.32.0" / "gemma2.py", src)
    assert run(str(src), "--check").returncode == 1  # detected as vllm, not adapted yet
    proc = run(str(src), "--in-place")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stderr and "Gemma2Model, vllm dialect" in proc.stderr
    assert "class Gemma2Model(nn.Module, EagleModelMixin):" in src.read_text()
    assert run(str(src), "--check").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma2.py"]


@pytest.mark.parametrize(
    ("write", "args", "fragment"),
    [
        ("class Foo:\n    pass\n", [], "no PP decoder here"),
        (None, ["--class", "Nope"], "no top-level class 'Nope' (classes here: Gemma2MLP"),
    ],
    ids=["no-pp-decoder", "unknown-class"],
)
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path: Path, write: str | None, args: list[str], fragment: str) -> None:
    src = tmp_path / "model.py"
    if write is None:
        shutil.copy(FIXTURES / "0.32.0" / "gemma2.py", src)
    else:
        src.write_text(write)
    before = src.read_bytes()
    out = tmp_path / "out.py"
    one_error_line(run(str(src), "--dialect", "vllm", *args, "--out", str(out)), fragment)
    assert not out.exists() and src.read_bytes() == before


def test_cli_refuses_a_vllm_older_than_the_contract(tmp_path: Path) -> None:
    """A file inside a vLLM tree whose interfaces.py lacks EagleModelMixin.pack_local_aux_hidden_states."""
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.31.0'\n")
    (models / "interfaces.py").write_text("class EagleModelMixin:\n    def _maybe_add_hidden_state(self):\n        pass\n")
    shutil.copy(FIXTURES / "0.32.0" / "gemma2.py", models / "gemma2.py")
    before = (models / "gemma2.py").read_bytes()
    one_error_line(run(str(models / "gemma2.py"), "--in-place"),
                   "vLLM 0.31.0 at ")
    proc = run(str(models / "gemma2.py"), "--in-place")
    assert "has no EagleModelMixin.pack_local_aux_hidden_states in interfaces.py" in proc.stderr
    assert "upgrade vLLM to 0.32 or later" in proc.stderr
    assert (models / "gemma2.py").read_bytes() == before


def test_spec_embed_table_loads_and_is_validated() -> None:
    from pipespec.contract.spec import spec_from_mapping
    from pipespec.errors import SpecError

    base = {"adapter": {"name": "gpt2", "decoder_class": "vllm.model_executor.models.gpt2:GPT2Model", "dialect": "vllm"}}
    spec = spec_from_mapping({**base, "embed": {"decoder_attr": "transformer", "embed_attr": "wte"}}, "gpt2.toml")
    assert (spec.embed_decoder_attr, spec.embed_attr) == ("transformer", "wte")
    with pytest.raises(SpecError, match=r"gpt2\.toml: embed\.embed_attr = 'wte' contradicts the other embed_attr = 'embed_tokens'"):
        spec_from_mapping({**base, "model": {"embed_attr": "embed_tokens"}, "embed": {"embed_attr": "wte"}}, "gpt2.toml")
    with pytest.raises(SpecError, match=r"embed\.decoder_attr = 'a.b' is invalid: must be a Python identifier"):
        spec_from_mapping({**base, "embed": {"decoder_attr": "a.b"}}, "gpt2.toml")
    with pytest.raises(SpecError, match=r"adapter\.dialect = 'vllm2' is invalid: use one of hf, vllm, pipespec"):
        spec_from_mapping({"adapter": {**base["adapter"], "dialect": "vllm2"}}, "gpt2.toml")


def test_models_own_capture_before_each_layer_is_kept_and_made_per_stage() -> None:
    """DeepSeek-V2's shape: its capture before layer idx (id idx, gathering shards) stays; id start_layer
    becomes the first rank's, and the end_layer capture (after the non-last return) moves before it and
    computes its value the way the in-loop capture does."""
    capture = ("if idx in self.aux_hidden_state_layers:\n    value = hidden_states + residual\n"
               "    if value.shape[0] != positions.shape[0]:\n        value = gather(value)\n"
               "    aux_hidden_states.append(value)\n")
    loop = ("aux_hidden_states = []\n"
            "for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):\n"
            + textwrap.indent(capture, "    ") + "    hidden_states, residual = layer(hidden_states, residual)\n")
    tail = TAIL.replace("            hidden_states, _ = self.norm(hidden_states, residual)\n",
                        "            if self.end_layer in self.aux_hidden_state_layers:\n"
                        "                aux_hidden_states.append(hidden_states + residual)\n"
                        "            hidden_states, _ = self.norm(hidden_states, residual)\n"
                        "            if len(aux_hidden_states) > 0:\n                return hidden_states, aux_hidden_states\n")
    result = adapt(HEAD + textwrap.indent(loop, " " * 12) + tail)
    assert [d.status for d in result.decoders] == ["adapted"], result.decoders
    code = result.code
    assert ("            if idx in self.aux_hidden_state_layers and (\n"
            "                idx != self.start_layer or get_pp_group().is_first_rank\n            ):\n") in code
    # id start_layer on the first rank is captured before any layer made a residual: `hidden + residual`
    # would add None there (DeepSeek-V2's TypeError); what is kept is right whatever residual is
    safe = "value = (hidden_states if residual is None else hidden_states + residual)\n"
    assert "value = hidden_states + residual" not in code and code.count(safe) == 2
    expr = safe.split(" = ", 1)[1]
    assert eval(expr, {}, {"hidden_states": 3, "residual": None}) == 3  # noqa: S307 - our own generated expression
    assert eval(expr, {}, {"hidden_states": 3, "residual": 4}) == 7  # noqa: S307
    end = code.index("        if self.end_layer in self.aux_hidden_state_layers:\n            " + safe)
    assert end < code.index("        if not get_pp_group().is_last_rank:")
    assert code.count("self.end_layer in self.aux_hidden_state_layers") == 1
    assert "_maybe_add_hidden_state" not in code  # the model's own capture is the only one
    assert adapt_vllm_module(code, label="toy.py").code == code


def test_models_own_value_after_each_layer_is_kept() -> None:
    """DeepSeek-V4's shape: `if (idx + 1) in self.aux_hidden_state_layers:` with a model-defined value
    after the layer stays as written; collect / pack / concatenation go around it, as in vLLM's own
    PP-correct DeepSeek-V4 (which captures no id start_layer)."""
    loop = ("aux_hidden_states: list[torch.Tensor] = []\n"
            "for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):\n"
            "    hidden_states, residual, mix = layer(hidden_states, residual, mix)\n"
            "    if (idx + 1) in self.aux_hidden_state_layers:\n"
            "        aux_hidden_states.append(reconstruct(hidden_states, residual, mix).mean(dim=1))\n")
    code = adapt(HEAD + textwrap.indent(loop, " " * 12) + TAIL).code
    assert ("                aux_hidden_states.append(reconstruct(hidden_states, residual, mix).mean(dim=1))\n") in code
    assert "_maybe_add_hidden_state" not in code and "remote_aux = self.collect_remote_aux_hidden_states" in code
    assert "**self.pack_local_aux_hidden_states(aux_hidden_states)," in code
    assert "aux_hidden_states = remote_aux + aux_hidden_states" in code


# ---------------------------------------------------------------------------------- stale residual
POST_NORM_LAYER = '''
    class ToyLayer(nn.Module):
        def forward(self, positions, hidden_states, residual):
            # post-norm / parallel block (Exaone4, Cohere): the incoming residual is not read
            residual = hidden_states
            hidden_states = residual + self.mlp(self.input_layernorm(hidden_states))
            return hidden_states, residual
'''
_LOOP = ("            for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
         "                hidden_states, residual = layer(positions, hidden_states, residual)\n")


def _toy_with_layer(layer: str) -> str:
    tail = TAIL.replace(LAYERS[LAYERS.index("\n\n    class ToyLayer"):], layer)
    assert tail != TAIL
    return HEAD + _LOOP + tail


def test_a_layer_that_rebinds_its_residual_is_captured_without_it() -> None:
    """Exaone4 / HyperCLOVAX / PhiMoE / Cohere: the layer starts with `residual = hidden_states`, so the
    residual it returns is stale and the stream at a layer boundary is the hidden states alone (the zoo
    measured aux ids off by up to 7.0 when it was added)."""
    code = adapt(_toy_with_layer(POST_NORM_LAYER)).code
    assert code.count("aux_hidden_states, idx + 1, hidden_states, None\n") == 1
    assert "aux_hidden_states, self.start_layer, hidden_states, None\n" in code
    assert '"residual": residual,' in code or '"residual": residual, **' in code  # what is sent stays as it was
    fused = adapt(HEAD + _LOOP + TAIL).code  # the fused add-norm layer reads it: the residual is added
    assert "aux_hidden_states, idx + 1, hidden_states, residual\n" in fused


def test_layer_class_through_init_default_and_base_class() -> None:
    """The layer class is found through an `__init__` parameter's default and a layer subclass without
    its own forward (its base's forward decides)."""
    layer = POST_NORM_LAYER.replace("class ToyLayer(nn.Module):", "class BaseLayer(nn.Module):") + \
        "\n\n    class ToyLayer(BaseLayer):\n        pass\n"
    source = _toy_with_layer(layer).replace(
        'def __init__(self, *, vllm_config, prefix=""):\n            super().__init__()\n'
        '            self.start_layer, self.end_layer, self.layers = make_layers(4, lambda prefix: ToyLayer(prefix), prefix)',
        'def __init__(self, *, vllm_config, prefix="", layer_type=ToyLayer):\n            super().__init__()\n'
        '            self.start_layer, self.end_layer, self.layers = make_layers(4, lambda prefix: layer_type(prefix), prefix)')
    assert "layer_type=ToyLayer" in source
    assert "idx + 1, hidden_states, None\n" in adapt(source).code


def test_layer_class_in_an_imported_module_is_read_through_read_module() -> None:
    """A layer class imported from a sibling is read there; without a reader the decoder is declined, not
    guessed."""
    source = _toy_with_layer("\n").replace("    from .interfaces import SupportsPP\n",
                                           "    from .interfaces import SupportsPP\n    from .toy_layers import ToyLayer\n")
    sibling = "from torch import nn\n\n" + textwrap.dedent(POST_NORM_LAYER)
    read = {".toy_layers": sibling}.get  # a relative import reaches a reader with its dots
    assert "idx + 1, hidden_states, None\n" in adapt(source, read_module=read).code
    (outcome,) = adapt(source, read_module=lambda dotted: None).decoders
    assert outcome.status == "declined"
    assert outcome.reason.startswith("line 22: the layer classes of self.layers cannot be found from the source "
                                     "(built by `make_layers(4, lambda prefix: ToyLayer(prefix), prefix)`)")


def test_layer_classes_that_disagree_are_told_apart_per_layer() -> None:
    """Molmo's shape: the config picks a pre-norm layer (reads the residual) or a norm-after one (rebinds
    it). Each capture after a layer asks which class just ran; where a class that reads the residual
    derives from one that rebinds it, isinstance cannot tell them apart and the decoder is declined."""
    both = POST_NORM_LAYER.replace("class ToyLayer", "class NormAfterLayer") + \
        LAYERS[LAYERS.index("\n\n    class ToyLayer"):]
    source = _toy_with_layer(both).replace(
        "            self.start_layer, self.end_layer, self.layers = make_layers(",
        "            layer_cls = NormAfterLayer if self.norm_after else ToyLayer\n"
        "            self.start_layer, self.end_layer, self.layers = make_layers(").replace(
        "lambda prefix: ToyLayer(prefix)", "lambda prefix: layer_cls(prefix)")
    result = adapt(source)
    (outcome,) = result.decoders
    assert outcome.status == "adapted", outcome.reason
    assert ("            self._maybe_add_hidden_state(\n                aux_hidden_states,\n                idx + 1,\n"
            "                hidden_states,\n                None if isinstance(layer, NormAfterLayer) else residual,\n"
            "            )\n") in result.code
    assert "aux_hidden_states, self.start_layer, hidden_states, residual\n" in result.code
    assert adapt_vllm_module(result.code, label="toy.py").code == result.code
    derived = source.replace("class ToyLayer(nn.Module):", "class ToyLayer(NormAfterLayer):")
    (outcome,) = adapt(derived).decoders
    assert outcome.status == "declined" and "the layer classes disagree on the residual: ToyLayer read it, " \
        "NormAfterLayer rebind it before reading it" in outcome.reason


def test_a_residual_returned_as_none_is_sent_as_zeros_only_where_the_next_layer_rebinds_it() -> None:
    """MiniCPM's layers `return hidden_states, None` and Molmo's norm-after layers set `residual = None`:
    vLLM's runners copy every value handed off into a tensor buffer and fail on None. Zeros are sent in its
    place only where the next stage's first layer rebinds the residual it is given (every class does; or one
    class chosen once for the stack, asked of the layer that ran last); a stale tensor residual (a layer
    that returns the one it rebound) and a stack whose class is picked per layer keep the hand-off as it was."""
    none_layer = POST_NORM_LAYER.replace("return hidden_states, residual", "return hidden_states, None")
    code = adapt(_toy_with_layer(none_layer)).code
    assert ('                    "residual": torch.zeros_like(hidden_states)\n'
            "                    if residual is None\n                    else residual,\n") in code
    assert adapt_vllm_module(code, label="toy.py").code == code
    assert "zeros_like" not in adapt(_toy_with_layer(POST_NORM_LAYER)).code  # a tensor is sent: unchanged
    after = none_layer.replace("class ToyLayer", "class NormAfterLayer").replace(
        "return hidden_states, None", "residual = None\n            return hidden_states, residual")
    both = after + LAYERS[LAYERS.index("\n\n    class ToyLayer"):]
    chosen_once = _toy_with_layer(both).replace(
        "            self.start_layer, self.end_layer, self.layers = make_layers(",
        "            layer_cls = NormAfterLayer if self.norm_after else ToyLayer\n"
        "            self.start_layer, self.end_layer, self.layers = make_layers(").replace(
        "lambda prefix: ToyLayer(prefix)", "lambda prefix: layer_cls(prefix)")
    code = adapt(chosen_once).code
    assert ('                    "residual": torch.zeros_like(hidden_states)\n'
            "                    if residual is None and isinstance(layer, NormAfterLayer)\n"
            "                    else residual,\n") in code
    assert adapt_vllm_module(code, label="toy.py").code == code
    per_layer = _toy_with_layer(both).replace(
        "lambda prefix: ToyLayer(prefix)", 'lambda prefix: NormAfterLayer(prefix) if "1" in prefix else ToyLayer(prefix)')
    result = adapt(per_layer)
    assert [d.status for d in result.decoders] == ["adapted"]
    assert "isinstance(layer, NormAfterLayer)" in result.code and "zeros_like" not in result.code


@pytest.mark.parametrize("release", ("0.32.0", "0.33.0", "0.34.0"))
def test_minicpm_and_molmo_send_zeros_for_their_none_residual_in_each_release(release: str) -> None:
    """The released MiniCPM (every layer rebinds the residual and returns None) and Molmo (the config picks
    the norm-after layer once for the stack) hand off zeros in place of None; Llama's hand-off is untouched."""
    from pipespec.integrations.vllm.sources import source_tree

    models = source_tree(release) / "model_executor" / "models"
    sources = {n: models.joinpath(f"{n}.py").read_text(encoding="utf-8") for n in ("minicpm", "molmo", "llama")}
    for name, sent in (("minicpm", "torch.zeros_like(hidden_states)\n                    if residual is None\n"),
                       ("molmo", "if residual is None\n                    and isinstance(layer, MolmoDecoderNormAfterLayer)\n")):
        code = adapt_vllm_module(sources[name], label=f"{name}.py",
                                 read_module=lambda dotted: None).code
        assert sent in code, name
        assert adapt_vllm_module(code, label=f"{name}.py", read_module=lambda dotted: None).code == code
    assert "zeros_like" not in adapt_vllm_module(sources["llama"], label="llama.py", read_module=lambda dotted: None).code


# ---------------------------------------------------------------------------------- holders
def test_decoder_built_through_an_init_parameter_default_gets_eagle3_on_its_holder() -> None:
    """InternLM2ForCausalLM builds `self.model = model_type(...)` with `model_type=InternLM2Model`."""
    source = (HEAD + _LOOP + TAIL).replace(
        'class ToyForCausalLM(nn.Module, SupportsPP):\n        def __init__(self, *, vllm_config, prefix=""):\n'
        '            super().__init__()\n            self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)',
        'class ToyForCausalLM(nn.Module, SupportsPP):\n        def __init__(self, *, vllm_config, prefix="", model_type=ToyModel):\n'
        '            super().__init__()\n            self.model = model_type(vllm_config=vllm_config, prefix=prefix)')
    assert "model_type=ToyModel" in source
    result = adapt(source)
    assert [(d.causal_lm, d.decoder_attr) for d in result.decoders] == [(("ToyForCausalLM",), "model")]
    assert "class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):" in result.code


def test_decoder_under_a_wrapper_is_reached_through_it() -> None:
    """OPT: OPTForCausalLM.model is an OPTModel whose .decoder is the PP decoder. The causal LM gets
    SupportsEagle3 and the two methods through `model.decoder`; the wrapper gets `embed_tokens` as a
    property (vLLM's drafter reads target.model.embed_tokens), so no module is registered twice."""
    source = (HEAD + _LOOP + TAIL).replace(
        'class ToyForCausalLM(nn.Module, SupportsPP):\n        def __init__(self, *, vllm_config, prefix=""):\n'
        '            super().__init__()\n            self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)',
        'class ToyWrapper(nn.Module):\n        def __init__(self, *, vllm_config, prefix=""):\n'
        '            super().__init__()\n            self.decoder = ToyModel(vllm_config=vllm_config, prefix=prefix)\n\n'
        '        def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):\n'
        '            return self.decoder(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)\n\n\n'
        '    class ToyForCausalLM(nn.Module, SupportsPP):\n        def __init__(self, *, vllm_config, prefix=""):\n'
        '            super().__init__()\n            self.model = ToyWrapper(vllm_config=vllm_config, prefix=prefix)')
    source = source.replace("                hidden_states = self.embed_tokens(input_ids)\n",
                            "                hidden_states = self.embed_tokens(input_ids)\n", 1)
    result = adapt(source.replace('super().__init__()\n            self.start_layer',
                                  'super().__init__()\n            self.embed_tokens = VocabParallelEmbedding(8, 4)\n'
                                  '            self.start_layer'))
    (outcome,) = result.decoders
    assert (outcome.status, outcome.causal_lm, outcome.decoder_attr) == ("adapted", ("ToyForCausalLM",), "model.decoder")
    code = result.code
    assert "class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):" in code
    assert "        self.model.decoder._set_aux_hidden_state_layers(layers)\n" in code
    assert "        num_layers = len(self.model.decoder.layers)\n" in code
    wrapper = code[code.index("class ToyWrapper"):code.index("class ToyForCausalLM")]
    assert "    @property\n    def embed_tokens(self) -> nn.Module:\n" in wrapper
    assert "        return self.decoder.embed_tokens\n" in wrapper
    assert adapt_vllm_module(code, label="toy.py").code == code


def test_layer_classes_from_a_module_level_table() -> None:
    """Jamba / Nemotron-H: `get_layer` picks `ALL_DECODER_LAYER_TYPES[config.kind[i]]` (a module-level
    dict of classes), possibly through `decoder_layer_types or ALL_DECODER_LAYER_TYPES`; every class
    in the table is read."""
    table = POST_NORM_LAYER.replace("class ToyLayer", "class OtherLayer") + \
        LAYERS[LAYERS.index("\n\n    class ToyLayer"):].replace("class ToyLayer", "class ToyLayer") + \
        '\n\n    ALL_DECODER_LAYER_TYPES = {"a": ToyLayer, "b": OtherLayer}\n'
    init = ("            layer_types = decoder_layer_types or ALL_DECODER_LAYER_TYPES\n\n"
            "            def get_layer(prefix):\n"
            "                if prefix not in self.kinds:\n                    raise ValueError(prefix)\n"
            "                layer_class = layer_types[self.kinds[prefix]]\n"
            "                return layer_class(prefix)\n\n"
            "            self.start_layer, self.end_layer, self.layers = make_layers(4, get_layer, prefix)")
    source = _toy_with_layer(table).replace(
        'def __init__(self, *, vllm_config, prefix=""):\n            super().__init__()\n'
        '            self.start_layer, self.end_layer, self.layers = make_layers(4, lambda prefix: ToyLayer(prefix), prefix)',
        'def __init__(self, *, vllm_config, prefix="", decoder_layer_types=None):\n            super().__init__()\n' + init)
    assert "get_layer" in source
    result = adapt(source)  # ToyLayer reads the residual, OtherLayer rebinds it: told apart per layer
    assert result.decoders[0].status == "adapted", result.decoders[0].reason
    assert "None if isinstance(layer, OtherLayer) else residual,\n" in result.code
    same = source.replace('{"a": ToyLayer, "b": OtherLayer}', '{"a": ToyLayer, "b": ToyLayer}')
    assert "idx + 1, hidden_states, residual\n" in adapt(same).code


def test_multimodal_class_holding_the_causal_lm_as_language_model_gets_eagle3() -> None:
    """MOSS-Audio: vLLM's registry builds MossAudioModel, whose `language_model` is the causal LM holding
    the decoder. It gets `SupportsEagle3` only: vLLM's protocol defaults reach the decoder through
    `get_language_model().model`, and its drafter takes the embedding from `get_language_model()`."""
    outer = ('\n\n    class ToyAudioModel(nn.Module, SupportsMultiModal, SupportsPP):\n'
             '        def __init__(self, *, vllm_config, prefix=""):\n            super().__init__()\n'
             '            with self._mark_language_model(vllm_config):\n'
             '                self.language_model = ToyForCausalLM(vllm_config=vllm_config, prefix=prefix)\n\n'
             '        def compute_logits(self, hidden_states):\n'
             '            return self.language_model.compute_logits(hidden_states)\n')
    source = (HEAD + _LOOP + TAIL + outer).replace("import SupportsPP", "import SupportsMultiModal, SupportsPP")
    result = adapt(source)
    (outcome,) = result.decoders
    assert (outcome.status, outcome.causal_lm) == ("adapted", ("ToyForCausalLM", "ToyAudioModel"))
    code = result.code
    assert "class ToyAudioModel(nn.Module, SupportsMultiModal, SupportsPP, SupportsEagle3):" in code
    audio = code[code.index("class ToyAudioModel"):]
    assert "set_aux_hidden_state_layers" not in audio and "def model(" not in audio
    assert adapt_vllm_module(code, label="toy.py").code == code
    plain = adapt(source.replace(", SupportsMultiModal, SupportsPP):", ", SupportsPP):"))  # not multimodal: not a holder
    assert plain.decoders[0].causal_lm == ("ToyForCausalLM",)


GEMMA4_LIKE = """\
    from itertools import islice

    import torch
    from torch import nn

    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    from .interfaces import SupportsPP


    class ToyModel(nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.fast_prefill_enabled = vllm_config.cache_config.kv_sharing_fast_prefill
            self.start_layer, self.end_layer, self.layers = make_layers(4, lambda prefix: ToyLayer(prefix), prefix)

        def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
            if self.fast_prefill_enabled:
                hidden_states = self.fast_prefill_forward(input_ids, positions)
                return self.norm(hidden_states)
            if get_pp_group().is_first_rank:
                hidden_states = self.embed_tokens(input_ids)
            else:
                hidden_states = intermediate_tensors["hidden_states"]
            residual = None
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                hidden_states, residual = layer(positions, hidden_states, residual)
            if not get_pp_group().is_last_rank:
                tensors: dict[str, torch.Tensor] = {"hidden_states": hidden_states}
                return IntermediateTensors(tensors)
            return self.norm(hidden_states)


    class ToyLayer(nn.Module):
        def forward(self, positions, hidden_states, residual):
            residual = hidden_states
            hidden_states = self.mlp(hidden_states) + residual
            return hidden_states, None


    class ToyForCausalLM(nn.Module, SupportsPP):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)
"""


def test_fast_prefill_return_and_unsent_stale_residual_are_understood() -> None:
    """Gemma4: a return before the loop under `self.<flag>` set from `kv_sharing_fast_prefill` is left as
    it is (vLLM refuses that option with every EAGLE-family method, so no drafter runs that path); the
    layer call binds a `residual` the next stage is not sent, but every layer rebinds it before reading it,
    so the stream is the hidden states alone; `IntermediateTensors(tensors)` with an annotated dict."""
    result = adapt(GEMMA4_LIKE)
    (outcome,) = result.decoders
    assert outcome.status == "adapted", outcome.reason
    code = result.code
    assert ("        if self.fast_prefill_enabled:\n"
            "            hidden_states = self.fast_prefill_forward(input_ids, positions)\n"
            "            return self.norm(hidden_states)\n") in code
    assert "aux_hidden_states, self.start_layer, hidden_states, None\n" in code
    assert "aux_hidden_states, idx + 1, hidden_states, None\n" in code
    assert "return IntermediateTensors({**tensors, **self.pack_local_aux_hidden_states(aux_hidden_states)})" in code
    assert adapt_vllm_module(code, label="toy.py").code == code


@pytest.mark.parametrize(("change", "fragment"), [
    (("vllm_config.cache_config.kv_sharing_fast_prefill", "vllm_config.fast"),
     "forward returns before its layer loop (`return self.norm(hidden_states)` in `self.fast_prefill_enabled`)"),
    (("            residual = hidden_states\n            hidden_states = self.mlp(hidden_states) + residual\n",
      "            hidden_states = self.mlp(hidden_states) + residual\n            residual = hidden_states\n"),
     "`residual` is carried from layer to layer but the next stage receives only `hidden_states`"),
])
def test_fast_prefill_and_unsent_residual_declines_stay_where_they_are_real(change: tuple[str, str], fragment: str) -> None:
    """Another flag is not the no-drafter option; a layer that reads the residual carries state unsent."""
    source = GEMMA4_LIKE.replace(*change)
    assert source != GEMMA4_LIKE
    (outcome,) = adapt(source).decoders
    assert outcome.status == "declined" and fragment in outcome.reason, outcome.reason


def test_a_loop_that_only_visits_the_layers_is_left_beside_the_layer_loop() -> None:
    """DeepSeek-V4.1: a loop before the layer loop only prepares each layer's engram embeddings (no layer
    call); it stays as it is and the loop that runs the layers is the one rewritten."""
    prepare = ("            if engram_hashes is not None:\n"
               "                for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
               "                    layer.engram.prepare_embeddings(engram_hashes)\n")
    result = adapt(HEAD.replace("    def forward(self, input_ids,", "    def forward(self, engram_hashes, input_ids,")
                   + prepare + _LOOP + TAIL)
    (outcome,) = result.decoders
    assert outcome.status == "adapted", outcome.reason
    assert prepare.replace("    " * 3, "    " * 2, 1).replace("\n        ", "\n    ") in result.code  # unchanged
    assert result.code.count("layer.engram.prepare_embeddings(engram_hashes)") == 1
    assert "aux_hidden_states, idx + 1, hidden_states, residual\n" in result.code


# ---------------------------------------------------------------------------------- one loop per branch
BRANCHES = HEAD + """\
            aux_hidden_states = self._maybe_add_hidden_state([], self.start_layer, hidden_states, residual)

            if self.plain:
                for idx, layer in enumerate(self.layers[self.start_layer : self.end_layer], start=self.start_layer):
                    hidden_states, residual = layer(positions, hidden_states, residual)
                    self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
                if not get_pp_group().is_last_rank:
                    return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
                if aux_hidden_states:
                    return hidden_states, aux_hidden_states
                return hidden_states

            bank = self.new_bank(hidden_states, residual)
            residual = bank
            delta = None
            for idx, layer in enumerate(self.layers[self.start_layer : self.end_layer], start=self.start_layer):
                hidden_states, residual, delta = layer(positions, hidden_states, residual, delta)
                if (idx + 1) in self.aux_hidden_state_layers:
                    self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states + delta, None)
            if not get_pp_group().is_last_rank:
                hidden_states = hidden_states + delta
                return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
            hidden_states = self.mix(hidden_states, residual, delta)
            if aux_hidden_states:
                return hidden_states, aux_hidden_states
            return hidden_states
""" + TAIL[TAIL.index(LAYERS):]


def test_one_loop_per_config_branch_each_rewritten_with_its_own_returns() -> None:
    """Kimi-K3's AMD KimiLinearModel: a plain-residual loop in `if`, with its own returns, and an
    attention-residual loop after it. One collect and one first-rank id start_layer capture before the
    branches (replacing the model's every-rank one); the plain loop gets the contract's capture, the other
    keeps the model's own value; each branch's non-last return packs, each last return concatenates."""
    result = adapt(BRANCHES)
    (outcome,) = result.decoders
    assert outcome.status == "adapted", outcome.reason
    code = result.code
    prelude = ("        remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)\n\n"
               "        aux_hidden_states: list[torch.Tensor] = []\n"
               "        if get_pp_group().is_first_rank:\n"
               "            self._maybe_add_hidden_state(\n"
               "                aux_hidden_states, self.start_layer, hidden_states, residual\n"
               "            )\n\n"
               "        if self.plain:\n")
    assert prelude in code
    assert code.count("collect_remote_aux_hidden_states") == 1
    assert "self._maybe_add_hidden_state([], self.start_layer" not in code
    assert code.count("aux_hidden_states, idx + 1, hidden_states, residual\n") == 1  # the plain branch's, 16 deep
    assert "                self._maybe_add_hidden_state(\n                    aux_hidden_states, idx + 1," in code
    assert "aux_hidden_states, idx + 1, hidden_states + delta, None" in code  # the model's own, kept
    assert code.count("**self.pack_local_aux_hidden_states(aux_hidden_states)") == 2
    assert code.count("aux_hidden_states = remote_aux + aux_hidden_states\n") == 2
    assert "if aux_hidden_states:" not in code
    assert code.index("            aux_hidden_states = remote_aux") < code.index("        bank = self.new_bank")
    again = adapt_vllm_module(code, label="toy.py")
    assert again.code == code and [d.status for d in again.decoders] == ["unchanged"]


def _assert_declined_unchanged(base: str, change: tuple[str, str], fragment: str) -> None:
    """``base`` with ``change`` made is declined with ``fragment`` in the reason, and left as it is."""
    source = base.replace(*change)
    assert source != base
    result = adapt(source)
    (outcome,) = result.decoders
    assert outcome.status == "declined" and fragment in outcome.reason, outcome.reason
    assert result.code == textwrap.dedent(source)


@pytest.mark.parametrize(("change", "fragment"), [
    (("            bank = self.new_bank(hidden_states, residual)\n",
      "            hidden_states = self.scale(hidden_states)\n"),
     "`hidden_states = self.scale(hidden_states)` rebinds `hidden_states` between the branch's start and its "
     "layer loop"),
    (("                if aux_hidden_states:\n                    return hidden_states, aux_hidden_states\n"
      "                return hidden_states\n", ""),
     "forward has 2 loops that run this stage's layers (lines 23, 32) and they are not one per config branch"),
    (("            aux_hidden_states = self._maybe_add_hidden_state([], self.start_layer, hidden_states, residual)\n",
      "            aux_hidden_states = []\n"),
     "the branches' layer loops disagree about id start_layer"),
])
def test_branches_that_cannot_share_one_prelude_are_declined(change: tuple[str, str], fragment: str) -> None:
    """A branch that changes the stream before its loop (the shared id start_layer capture would miss it);
    a branch that falls through into the other loop (one path runs both); a kept own capture (no id
    start_layer) beside a contract capture (id start_layer) with no capture of the model's to follow."""
    _assert_declined_unchanged(BRANCHES, change, fragment)


def _installed_vllm_file(rel: str) -> str:
    """A model file of the installed vLLM, read as text (vLLM is not imported); skips where none is installed."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # without vLLM: tests/vllm, a namespace package, or nothing
    roots = [Path(p) for p in (spec.submodule_search_locations or []) if (Path(p) / "model_executor").is_dir()] if spec else []
    if not roots:
        pytest.skip("vLLM is not installed here (run from .venv-vllm)")
    return (roots[0] / rel).read_text(encoding="utf-8")


def _adapted_installed(rel: str, decoder: str, causal_lm: str) -> tuple[str, Any]:
    """The installed vLLM's ``rel`` and its adaptation, checked to adapt ``decoder`` (held by ``causal_lm``)."""
    source = _installed_vllm_file(rel)
    result = adapt_vllm_module(source, label=rel)
    (outcome,) = result.decoders
    assert (outcome.class_name, outcome.status, outcome.causal_lm) == (decoder, "adapted", (causal_lm,))
    return source, result


def test_installed_kimi_k3_amd_linear_adapts_both_branches() -> None:
    """The installed vLLM's models/kimi_k3/amd/linear.py (two layer loops, one per attn_res_block_size
    branch): adapted, ids start_layer on the first rank only, both branches' returns handed on; a fixed point."""
    rel = "models/kimi_k3/amd/linear.py"
    _, result = _adapted_installed(rel, "KimiLinearModel", "KimiLinearForCausalLM")
    forward = result.code[result.code.index("    def forward(", result.code.index("class KimiLinearModel(")):]
    forward = forward[:forward.index("\n    def load_weights(")]
    assert forward.count("self.collect_remote_aux_hidden_states(intermediate_tensors)") == 1
    assert ("        if get_pp_group().is_first_rank:\n            self._maybe_add_hidden_state(\n"
            "                aux_hidden_states, self.start_layer, hidden_states, residual\n            )\n\n"
            "        if self.config.attn_res_block_size is None:\n") in forward
    assert forward.count("aux_hidden_states, layer_idx + 1, hidden_states, residual") == 1
    assert "hidden_states + prefix_delta,\n" in forward  # the attention-residual branch's own capture, kept
    assert forward.count("**self.pack_local_aux_hidden_states(aux_hidden_states),") == 2
    assert forward.count("aux_hidden_states = remote_aux + aux_hidden_states") == 2
    again = adapt_vllm_module(result.code, label=rel)
    assert again.code == result.code and [d.status for d in again.decoders] == ["unchanged"]


# ---------------------------------------------------------------------------------- layers run in helpers
HELPERS = HEAD.replace("    def forward(self, input_ids,", "    def forward(self, engram_hashes, input_ids,") + """\
            if engram_hashes is not None:
                for layer in islice(self.layers, self.start_layer, self.end_layer):
                    layer.engram.prepare_embeddings(engram_hashes)
            aux_by_layer: dict[int, torch.Tensor] = {}
            hidden_states, residual, mix = self._run_layers(
                range(self.start_layer, self.end_layer), hidden_states, residual, aux_by_layer
            )
            hidden_states = self._collapse(hidden_states, residual, mix, aux_by_layer)
            aux_hidden_states = [
                aux_by_layer[layer_id] for layer_id in self.aux_hidden_state_layers if layer_id in aux_by_layer
            ]
            if not get_pp_group().is_last_rank:
                return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
            hidden_states = self.norm(hidden_states)
            if len(aux_hidden_states) > 0:
                return hidden_states, aux_hidden_states
            return hidden_states

        def _run_layers(self, layer_ids, hidden_states, residual, aux_by_layer):
            mix = None
            for idx in layer_ids:
                hidden_states, residual, mix, previous = self.layers[idx](
                    hidden_states, residual, mix, capture=idx in self.aux_hidden_state_layers
                )
                if previous is not None:
                    aux_by_layer[idx] = previous
            return hidden_states, residual, mix

        def _collapse(self, hidden_states, residual, mix, aux_by_layer):
            hidden_states = post(hidden_states, residual, mix)
            if self.end_layer in self.aux_hidden_state_layers:
                aux_by_layer[self.end_layer] = hidden_states.mean(dim=1)
            return hidden_states
""" + TAIL[TAIL.index(LAYERS):]


def test_layers_run_in_helper_methods_with_the_models_own_keyed_capture() -> None:
    """DeepSeek-V4.1 NVIDIA: forward's only stage loop prepares engram embeddings; `_run_layers` runs the
    layers over the range forward passes and keeps each layer's own value as `aux_by_layer[idx]` (the
    state entering layer idx), `_collapse` keeps `[self.end_layer]`; forward lists them in the order of
    self.aux_hidden_state_layers. The helpers stay as written; collect before the table, pack, concatenate,
    and id start_layer (the previous stage's end_layer) dropped on later ranks."""
    result = adapt(HELPERS)
    (outcome,) = result.decoders
    assert outcome.status == "adapted", outcome.reason
    code = result.code
    assert ("        remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)\n"
            "        aux_by_layer: dict[int, torch.Tensor] = {}\n") in code
    assert ("        if not get_pp_group().is_first_rank:\n"
            "            # id start_layer is the previous stage's last (its end_layer), captured there\n"
            "            aux_by_layer.pop(self.start_layer, None)\n"
            "        aux_hidden_states = [\n") in code
    assert "**self.pack_local_aux_hidden_states(aux_hidden_states)," in code
    assert code.count("aux_hidden_states = remote_aux + aux_hidden_states\n") == 1
    helpers = textwrap.dedent(HELPERS)
    for method in ("_run_layers", "_collapse"):  # byte for byte as the model wrote them
        start = helpers.index(f"    def {method}(")
        assert helpers[start:helpers.index("\n\n", start)] in code
    assert "_maybe_add_hidden_state" not in code
    again = adapt_vllm_module(code, label="toy.py")
    assert again.code == code and [d.status for d in again.decoders] == ["unchanged"]
    after_layer = adapt(HELPERS.replace("aux_by_layer[idx] = previous", "aux_by_layer[idx + 1] = previous")).code
    assert ".pop(self.start_layer" not in after_layer  # keyed by the id after the layer: no id start_layer there
    assert "**self.pack_local_aux_hidden_states(aux_hidden_states)," in after_layer


@pytest.mark.parametrize(("change", "fragment"), [
    (("range(self.start_layer, self.end_layer), hidden_states", "range(0, self.end_layer - 1), hidden_states"),
     "runs the layers `range(0, self.end_layer - 1)`, not a range of this stage's"),
    (("aux_by_layer[self.end_layer] = hidden_states.mean(dim=1)", "aux_by_layer[self.end_layer - 1] = hidden_states"),
     "`_collapse` stores `aux_by_layer[self.end_layer - 1]`: a key other than a layer id of this stage"),
    (("            hidden_states = self._collapse(hidden_states, residual, mix, aux_by_layer)\n",
      "            hidden_states = self._collapse(hidden_states, residual, mix, aux_by_layer)\n"
      "            aux_by_layer[0] = hidden_states\n"),
     "writes `aux_by_layer` in forward itself"),
    (("aux_by_layer[layer_id] for layer_id in self.aux_hidden_state_layers", "aux_by_layer[layer_id] for layer_id in self.ids"),
     "does not read the helpers' captures in the order of self.aux_hidden_state_layers"),
    (("aux_by_layer[idx] = previous", "aux_by_layer[idx - 1] = previous"),
     "they run in helper methods (_run_layers), which keep their captures otherwise than the one helper form"),
])
def test_helper_forms_that_cannot_be_read_as_safe_are_declined(change: tuple[str, str], fragment: str) -> None:
    """A helper run over a range that is not this stage's, a key that is not a layer id of this stage, forward
    writing the table itself, a list not in the order of the ids, a key form the rewrite does not know."""
    _assert_declined_unchanged(HELPERS, change, fragment)


def test_installed_deepseek_v41_nvidia_keeps_its_helpers_and_hands_its_list_on() -> None:
    """The installed vLLM's models/deepseek_v41/nvidia/model.py: adapted; `_run_layers` / `_collapse` /
    `_run_replay_layers` byte-identical; collect, the later-rank drop of id start_layer, pack, concatenation."""
    rel = "models/deepseek_v41/nvidia/model.py"
    source, result = _adapted_installed(rel, "DeepseekV4Model", "DeepseekV41LLMForCausalLM")
    code = result.code
    for method in ("_run_layers", "_collapse", "_run_replay_layers"):
        start = source.index(f"    def {method}(")
        assert source[start:source.index("\n    def ", start + 10)] in code
    assert ("        remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)\n"
            "        aux_hidden_by_layer: dict[int, torch.Tensor] = {}\n") in code
    assert "            aux_hidden_by_layer.pop(self.start_layer, None)\n        aux_hidden_states = [\n" in code
    assert code.count("**self.pack_local_aux_hidden_states(aux_hidden_states),") == 1
    assert code.count("aux_hidden_states = remote_aux + aux_hidden_states\n") == 1
    again = adapt_vllm_module(code, label=rel)
    assert again.code == code and [d.status for d in again.decoders] == ["unchanged"]


@pytest.mark.parametrize("change", ["hidden_states = hidden_states * 2", "hidden_states += residual",
                                    "hidden_states: torch.Tensor = hidden_states.contiguous()"])
def test_a_stream_changed_between_the_loop_and_the_hand_off_is_declined(change: str) -> None:
    """Plain, augmented and annotated assignments alike: the next stage would receive something other than
    the last layer's output, which the capture recorded."""
    loop = "            for layer in islice(self.layers, self.start_layer, self.end_layer):\n" \
           "                hidden_states, residual = layer(positions, hidden_states, residual)\n" \
           f"            {change}\n"
    (outcome,) = adapt(HEAD + loop + TAIL).decoders
    assert outcome.status == "declined", outcome
    assert "changes the stream after the layer loop, before the non-last-rank return" in outcome.reason


# ------------------------------------------------ vLLM 0.33 / 0.34 forms (fixtures per release, above)
def _release_fixture(key: str, change: tuple[str, str] | None = None):  # type: ignore[no-untyped-def]
    """The outcome of the real file of ``key`` (``release/name``), with ``change`` (old, new) applied once."""
    release, name = key.split("/")
    source = (FIXTURES / release / f"{name}.py").read_text()
    if change is not None:
        assert source.count(change[0]) == 1, change[0]
        source = source.replace(*change)
    (outcome,) = adapt_vllm_module(source, label=label(key), read_module=fixture_reader(release)).decoders
    return outcome


@pytest.mark.parametrize("key", sorted(k for k, v in GOLDEN.items() if v[2] == "adapted"))
def test_each_adapted_golden_carries_the_contract_in_its_decoder(key: str) -> None:
    """The structure DESIGN.md's contract asks for, read from the golden's decoder (the 0.33/0.34 files cannot
    be imported here, so this and the golden are what checks them): the flag on the class; collect before the
    layer loop; every non-last return packs; every last return hands on remote + local; nothing from pipespec."""
    out = golden(key)[1].read_text()
    compile(out, key, "exec")
    assert not [line for line in out.splitlines() if "import" in line and "pipespec" in line]
    tree = ast.parse(out)
    (dec,) = [c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == GOLDEN[key][1]]
    assert any(isinstance(s, ast.Assign) and ast.unparse(s) == "supports_aux_hidden_states_over_pp = True" for s in dec.body)
    (forward,) = [f for f in dec.body if isinstance(f, ast.FunctionDef) and f.name == "forward"]
    text = ast.unparse(forward)
    collect = text.index("self.collect_remote_aux_hidden_states(intermediate_tensors)")
    assert collect < text.index("for ")
    nonlast = [r for r in ast.walk(forward) if isinstance(r, ast.Return) and "IntermediateTensors" in ast.unparse(r)]
    assert nonlast and all("**self.pack_local_aux_hidden_states(" in ast.unparse(r) for r in nonlast)
    assert text.count("= remote_aux + ") == len([r for r in ast.walk(forward) if isinstance(r, ast.Return)
                                                  and isinstance(r.value, ast.Tuple)])


def test_a_models_own_start_capture_stays_on_the_first_rank_and_its_residual_rule_by_config() -> None:
    """Cohere2-MoE: the model clones the embedding before capturing id start_layer (a fused RMSNorm updates
    it in place later) and passes `residual if self.uses_rms_norm else None` (LayerNorm layers rebind the
    residual): both kept, the first only on the first rank."""
    out = (FIXTURES / "0.34.0" / "expected" / "cohere2_moe.py").read_text()
    assert ("        if (\n            get_pp_group().is_first_rank\n"
            "            and self.start_layer in self.aux_hidden_state_layers\n        ):\n"
            "            start_hidden_states = hidden_states\n") in out
    assert "                layer_idx + 1,\n                hidden_states,\n                residual if self.uses_rms_norm else None,\n" in out
    moved = _release_fixture("0.34.0/cohere2_moe", ("        for layer_idx, layer in enumerate(\n",
                                                    "        hidden_states = hidden_states * 1\n        for layer_idx, layer in enumerate(\n"))
    assert moved.status == "declined" and "changes the stream between the model's own id start_layer capture" in moved.reason


def test_a_residual_folded_into_the_sent_tensor_is_part_of_the_stream() -> None:
    """DeepSeek-V3.2 (0.34) sends `residual + all_reduce(hidden_states)` as hidden_states and starts every
    stage from residual = None: the stream at a layer boundary is hidden + residual, captured as such."""
    out = (FIXTURES / "0.34.0" / "expected" / "deepseek_v32_amd_model.py").read_text()
    assert "aux_hidden_states, idx + 1, hidden_states, residual\n" in out
    assert "hidden_states = residual + tensor_model_parallel_all_reduce(hidden_states)\n" in out
    received = _release_fixture("0.34.0/deepseek_v32_amd_model", (
        "        # Later PP stages receive the TP-reduced residual stream, like an embedding.\n        residual = None\n",
        "        residual = intermediate_tensors.get(\"residual\") if intermediate_tensors else None\n"))
    assert received.status == "declined" and "`residual` is carried from layer to layer" in received.reason


@pytest.mark.parametrize(("change", "fragment"), [
    # the carried value is mixed into what is sent (not added as a residual is): real state, not a cache
    (("            return IntermediateTensors({\"hidden_states\": hidden_states})\n",
      "            hidden_states = hidden_states * normalized_states\n"
      "            return IntermediateTensors({\"hidden_states\": hidden_states})\n"),
     "`normalized_states` is carried from layer to layer"),
    # a later stage would start it from something else than the first stage does
    (("        normalized_states = None\n", "        normalized_states = hidden_states\n"),
     "`normalized_states` is carried from layer to layer"),
    # the layer reads it beyond `<its own value> if normalized_states is None else normalized_states`
    (("        x = self.self_attn(positions, x)\n",
      "        x = self.self_attn(positions, x)\n        hidden_states = hidden_states + normalized_states\n"),
     "`normalized_states` is carried from layer to layer"),
])
def test_a_value_dropped_at_every_hand_off_is_not_the_stream_but_real_carried_state_is(
        change: tuple[str, str], fragment: str) -> None:
    """Beam's normalized_states (the next layer's input norm, computed early; None makes a layer compute it)
    is dropped at every stage boundary by the model's own hand-off, and any layer boundary can be one: the
    stream is hidden_states alone (the golden). Mixed into the hand-off (other than added, as a residual is),
    not restarted from None, or read by a layer beyond "mine if None": state the stream does not hold."""
    outcome = _release_fixture("0.34.0/beam_amd_model", change)
    assert outcome.status == "declined" and fragment in outcome.reason, outcome


def test_a_sequence_parallel_gather_of_the_stream_is_applied_to_each_capture() -> None:
    """Step5 (NVIDIA) folds its residual in after the loop, then all-gathers the sequence-parallel token
    shards before the hand-off: each captured state (a shard too) gets the same gather. A gather in another
    form (more than the one assignment) is declined: a capture would keep a shard."""
    out = (FIXTURES / "0.34.0" / "expected" / "step5_nvidia_model.py").read_text()
    assert ("        if self.use_sequence_parallel:\n            hidden_states = sp_all_gather(hidden_states)[: positions.shape[0]]\n"
            "        if self.use_sequence_parallel:\n            aux_hidden_states = [\n"
            "                sp_all_gather(state)[: positions.shape[0]]\n                for state in aux_hidden_states\n"
            "            ]\n") in out
    outcome = _release_fixture("0.34.0/step5_nvidia_model", (
        "            hidden_states = sp_all_gather(hidden_states)[: positions.shape[0]]\n\n",
        "            hidden_states = sp_all_gather(hidden_states)[: positions.shape[0]]\n"
        "            hidden_states = hidden_states.contiguous()\n\n"))
    assert outcome.status == "declined"
    assert "under sequence parallelism the layers run on token shards" in outcome.reason


def test_one_loop_per_branch_inside_a_try_falling_through_to_one_hand_off() -> None:
    """MiniMax-M3 AMD (0.33): `if decode is None:` runs the plain loop, `else:` its specialized-decode loop in a
    `try`; both fall through to one hand-off. Each loop captures with the global index (enumerate counts from 0:
    `self.start_layer + idx + 1`), id start_layer once on the first rank, and the stale "not yet compatible"
    comment goes with the capture it described."""
    out = (FIXTURES / "0.33.0" / "expected" / "minimax_m3_amd_model.py").read_text()
    assert [line.strip() for line in out.splitlines()].count("self.start_layer + idx + 1,") == 2
    assert "EAGLE3 is not yet compatible with pipeline parallel" not in out
    assert "_maybe_add_hidden_state([], 0," not in out


def test_an_inherited_flag_is_read_from_the_base_classes_source() -> None:
    """MuseSpark subclasses LlamaModel (which sets the flag) and its own forward collects and packs: vLLM's
    runner reads the flag with getattr, so it is supported as it is. Where the base cannot be read, or sets
    no flag, the decline says which."""
    assert _release_fixture("0.34.0/muse_spark_nvidia_model").status == "unchanged"
    source = (FIXTURES / "0.34.0" / "muse_spark_nvidia_model.py").read_text()
    (unread,) = adapt_vllm_module(source, label=label("0.34.0/muse_spark_nvidia_model"),
                                  read_module=lambda dotted: None).decoders
    assert unread.status == "declined"
    assert ("does not set supports_aux_hidden_states_over_pp and its bases LlamaModel cannot be read from the source"
            in unread.reason)
    llama = (FIXTURES / "0.34.0" / "llama.py").read_text().replace(
        "    supports_aux_hidden_states_over_pp = True\n", "    supports_aux_hidden_states_over_pp = False\n")
    (off,) = adapt_vllm_module(source, label=label("0.34.0/muse_spark_nvidia_model"),
                               read_module={"vllm.model_executor.models.llama": llama}.get).decoders
    assert off.status == "declined" and "it inherits supports_aux_hidden_states_over_pp = False from LlamaModel" in off.reason


def test_layers_looped_through_a_local_name_or_a_conditional_expression_are_seen() -> None:
    """MiniMax-M3 AMD loops `layers = self.layers[s:e]` inside if/try, MuseSpark AMD over `self.layers[s:e]
    if mono_out is None else []`: both are PP decoders (judged unchanged above). A conditional loop that is
    not already correct is declined: on its other branch the layers run elsewhere."""
    source = (FIXTURES / "0.34.0" / "muse_spark_amd_model.py").read_text()
    changed = source.replace("        remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)\n", "")
    changed = changed.replace("        aux_hidden_states = remote_aux + aux_hidden_states\n", "")
    (outcome,) = adapt_vllm_module(changed, label=label("0.34.0/muse_spark_amd_model"),
                                   read_module=fixture_reader("0.34.0")).decoders
    assert outcome.status == "declined" and "the layer loop runs over a conditional expression" in outcome.reason


# ------------------------------------------------------------------- what vLLM's V2 runner reaches
RELEASES = ("0.32.0", "0.33.0", "0.34.0")


def _release_file(release: str, name: str) -> tuple[str, Any] | None:
    """A model file of a released vLLM (sources.source_tree, read as text) and its adaptation; None where
    the release has no such file (0.34 serves stablelm through its Transformers backend)."""
    from pipespec.codemods.vllm_native_modules import ModuleSources
    from pipespec.integrations.vllm.sources import source_tree

    path = source_tree(release) / "model_executor" / "models" / f"{name}.py"
    if not path.is_file():
        return None
    source = path.read_text(encoding="utf-8")
    return source, adapt_vllm_module(source, label=f"vllm/model_executor/models/{name}.py", read_module=ModuleSources(path))


def _class(code: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(code).body if isinstance(n, ast.ClassDef) and n.name == name)


def _property_returns(cls: ast.ClassDef) -> dict[str, str]:
    """Each ``@property`` of ``cls`` whose body is one return: name -> the returned expression."""
    return {f.name: ast.unparse(f.body[-1].value) for f in cls.body  # type: ignore[attr-defined]
            if isinstance(f, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in f.decorator_list)
            and isinstance(f.body[-1], ast.Return)}


def _checked_output(release: str, name: str) -> str | None:
    """The adapted file of ``name`` in ``release``: every decoder adapted, no pipespec import, a fixed point."""
    found = _release_file(release, name)
    if found is None:
        return None
    _, result = found
    assert [d.status for d in result.decoders] == ["adapted"] * len(result.decoders)
    code = result.code
    assert "import pipespec" not in code and "from pipespec" not in code
    assert adapt_vllm_module(code, label=f"vllm/model_executor/models/{name}.py").code == code
    return code


@pytest.mark.parametrize("release", RELEASES)
def test_the_surface_given_is_what_the_v2_runner_reads_in_each_release(release: str) -> None:
    """vLLM's runner helpers (eagle3_utils.py) read exactly RUNNER_READS on `_inner_decoder(model)`, and
    `_inner_decoder` is the same lookup in 0.32, 0.33 and 0.34 (get_language_model(), else language_model,
    else the model; then its `.model`): what vllm_native_runner_surface gives, and where."""
    from pipespec.codemods.vllm_native_runner_surface import RUNNER_READS
    from pipespec.integrations.vllm.sources import source_tree

    tree = ast.parse((source_tree(release) / "v1" / "worker" / "gpu" / "spec_decode" / "eagle" / "eagle3_utils.py")
                     .read_text(encoding="utf-8"))
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    read: set[str] = set()
    for name in ("verify_supports_aux_hidden_states_over_pp", "aux_hidden_state_relay_keys",
                 "reserve_aux_intermediate_tensor_slots"):
        for node in ast.walk(funcs[name]):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "inner":
                read.add(node.attr)
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr"
                    and ast.unparse(node.args[0]) == "inner" and isinstance(node.args[1], ast.Constant)):
                read.add(str(node.args[1].value))
    assert read == set(RUNNER_READS)
    lookup = ast.unparse(funcs["_inner_decoder"])
    assert "model.get_language_model()" in lookup and "model.language_model" in lookup
    assert "return getattr(parent_ref, 'model', None)" in lookup


@pytest.mark.parametrize("release", RELEASES)
def test_a_wrapper_between_the_causal_lm_and_the_decoder_carries_the_runner_surface(release: str) -> None:
    """OPT: OPTForCausalLM.model (what the runner reads) is OPTModel, a wrapper around the adapted
    OPTDecoder. The wrapper gets the flag on its class and the slot base, key prefix and config as properties
    reading the decoder's; the decoder itself is unchanged by it (it already keeps its config)."""
    code = _checked_output(release, "opt")
    assert code is not None
    wrapper = _class(code, "OPTModel")
    flags = [ast.unparse(s) for s in wrapper.body if isinstance(s, ast.Assign)]
    assert "supports_aux_hidden_states_over_pp = True" in flags
    assert _property_returns(wrapper) == {"embed_tokens": "self.decoder.embed_tokens",
                                          "AUX_HIDDEN_STATE_KEY": "self.decoder.AUX_HIDDEN_STATE_KEY",
                                          "_aux_slot_base_cached": "self.decoder._aux_slot_base_cached",
                                          "config": "self.decoder.config"}
    decoder_init = ast.unparse(next(f for f in _class(code, "OPTDecoder").body
                                    if isinstance(f, ast.FunctionDef) and f.name == "__init__"))
    assert decoder_init.count("self.config = config") == 1
    assert "def model(" not in ast.unparse(_class(code, "OPTDecoder"))


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(("name", "decoder"), [("dbrx", "DbrxModel"), ("stablelm", "StableLMEpochModel")])
def test_a_decoder_that_drops_its_config_keeps_it_for_the_receive_buffers(release: str, name: str, decoder: str) -> None:
    """DbrxModel and StableLMEpochModel read their config into a local and keep only parts of it, but
    reserve_aux_intermediate_tensor_slots reads `config.hidden_size` on the decoder: the adapted __init__
    keeps the config right after the line that binds it."""
    code = _checked_output(release, name)
    if code is None:
        pytest.skip(f"vLLM {release} has no model_executor/models/{name}.py")
    init = next(f for f in _class(code, decoder).body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    lines = [ast.unparse(s) for s in init.body]
    at = lines.index("self.config = config")
    assert lines[at - 1] == "config = vllm_config.model_config.hf_config"
    assert lines.count("self.config = config") == 1


def test_config_is_kept_only_where_the_class_and_its_bases_set_none() -> None:
    """A decoder taking `config` as a parameter keeps it after super().__init__(); one whose base is another
    model class (which may keep its own) and one that already keeps it are left as they are."""
    param = (HEAD + _LOOP + TAIL).replace('def __init__(self, *, vllm_config, prefix=""):\n            super().__init__()\n'
                                          '            self.start_layer',
                                          'def __init__(self, config, prefix=""):\n            super().__init__()\n'
                                          '            self.start_layer', 1)
    init = adapt(param).code.split("class ToyModel", 1)[1].split("    def __init__", 1)[1].split("class ToyLayer", 1)[0]
    assert "super().__init__()\n        self.config = config  # vLLM's V2 runner reads" in init
    based = param.replace("class ToyModel(nn.Module):", "class ToyModel(BaseModel):")
    assert "self.config = config" not in adapt(based).code
    kept = param.replace("super().__init__()\n            self.start_layer",
                         "super().__init__()\n            self.config = config\n            self.start_layer", 1)
    assert adapt(kept).code.count("self.config = config") == 1


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(("name", "decoder"), [("molmo", "MolmoModel"), ("molmo2", "Molmo2TextModel"),
                                               ("moondream3", "Moondream3TextModel")])
def test_a_decoder_that_is_the_multimodal_language_model_is_its_own_model(release: str, name: str, decoder: str) -> None:
    """Molmo, Molmo2 and Moondream3 build the decoder inside `_mark_language_model` (or return it from their
    own get_language_model): get_language_model() is the decoder, and the runner's `_inner_decoder` (and the
    EAGLE loader) read its `.model`. The adapted decoder gets a `model` property returning itself; decoders
    under a plain causal LM (dbrx, opt) get none."""
    code = _checked_output(release, name)
    assert code is not None
    assert _property_returns(_class(code, decoder))["model"] == "self"
    dbrx = _checked_output(release, "dbrx")
    assert dbrx is not None and "model" not in _property_returns(_class(dbrx, "DbrxModel"))
