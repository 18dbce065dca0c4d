"""Adapter specs: parsing, validation errors naming file/key/value, registry precedence and conflicts."""

from __future__ import annotations

import pytest

from pipespec.contract.registry import Registry, builtin_adapters_dir
from pipespec.contract.spec import load_spec
from pipespec.errors import SpecError

GOOD = '[adapter]\nname = "toy"\narchitectures = ["ToyForCausalLM"]\ndecoder_class = "toy.modeling:ToyModel"\n'


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_builtin_specs_load_and_cover_the_required_families():
    reg = Registry([("builtin", builtin_adapters_dir())])
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert reg.lookup(arch).supported
    assert not reg.lookup("MiMoForCausalLM").supported
    assert reg.lookup("KimiK3ForConditionalGeneration").boundary_rule == "reject-at-stage-end"
    assert reg.lookup("KimiLinearForCausalLM").decoder_class == "vllm.models.kimi_k3.nvidia.model:KimiLinearModel"
    assert reg.lookup("llama").name == "llama"  # by model type


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[adapter\nname = 1", r"bad\.toml: TOML syntax error: .*line 1"),
        (GOOD + "colour = 'red'\n", r"unknown key adapter\.colour"),
        (GOOD + "[model]\nresidual = 'yes'\n", r"model\.residual = 'yes' is invalid: expected true or false"),
        (GOOD + "[model]\nlayers_attr = 'layers; import os'\n", r"model\.layers_attr = 'layers; import os' is invalid"),
        (GOOD + "[model]\nnorm_attr = 'class'\n", r"not a keyword"),
        (GOOD + "[aux]\ndefault_ids = [2, -1]\n", r"aux\.default_ids = -1 is invalid"),
        (GOOD + "[aux]\nboundary_rule = 'sometimes'\n", r"use one of allow, reject-at-stage-end"),
        (GOOD + "[extras]\nx = 1\n", r"unknown table \[extras\]"),
        ('[adapter]\nname = "toy"\n', r"missing required key adapter\.decoder_class"),
        (GOOD.replace("toy.modeling:ToyModel", "toy.modeling.ToyModel"), r"must be 'package\.module:ClassName'"),
        (GOOD + "supported = false\n", r"needs adapter\.reason"),
        (GOOD + "[model]\ncapture = 'hidden + residual'\n", r"needs model\.residual = true"),
    ],
)
def test_bad_specs_are_refused_with_file_key_value(tmp_path, text, message):
    with pytest.raises(SpecError, match=message) as err:
        load_spec(write(tmp_path, "bad.toml", text))
    assert "bad.toml" in str(err.value)


def test_two_files_of_one_source_claiming_one_architecture_conflict(tmp_path):
    write(tmp_path, "a.toml", GOOD)
    write(tmp_path, "b.toml", GOOD.replace('name = "toy"', 'name = "toy2"').replace("ToyModel", "Toy2Model"))
    with pytest.raises(SpecError, match=r"b\.toml and .*a\.toml both claim arch 'ToyForCausalLM'"):
        Registry([("path", tmp_path)])


def test_user_path_overrides_builtin(tmp_path):
    write(tmp_path, "llama.toml", '[adapter]\nname = "my_llama"\narchitectures = ["LlamaForCausalLM"]\n'
          'decoder_class = "transformers.models.llama.modeling_llama:LlamaModel"\n[aux]\ndefault_ids = [1, 3]\n')
    reg = Registry([("builtin", builtin_adapters_dir()), ("path", tmp_path)])
    spec = reg.lookup("LlamaForCausalLM")
    assert spec.name == "my_llama" and spec.default_aux_ids(32) == (1, 3)
    assert reg.lookup("Qwen2ForCausalLM").name == "qwen2"
    assert "my_llama" in [e.spec.name for e in reg.entries()] and "llama" not in [e.spec.name for e in reg.entries()]


def test_env_path_must_be_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESPEC_ADAPTERS_PATH", str(tmp_path / "nope"))
    with pytest.raises(SpecError, match="is not a directory"):
        Registry()
