"""The installed `pipespec` console script: layout / specs / verify, output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.contract.layout import plan_layout

BIN = Path(sys.executable).parent / "pipespec"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_layout_json_matches_the_planner_and_the_contract_keys():
    r = run("layout", "--num-layers", "10", "--pp", "4", "--aux-layers", "0,3,3,10,5", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert list(data) == ["num_layers", "aux_layers", "stages"]
    assert data == plan_layout(10, 4, [0, 3, 5, 10]).to_json_dict()
    assert [s["start_layer"] for s in data["stages"]] == [0, 2, 5, 8]  # default partition (2, 3, 3, 2)
    assert data["stages"][3]["collects"] == ["aux_hidden_states_0", "aux_hidden_states_1", "aux_hidden_states_2"]


def test_layout_explicit_partition_and_boundary_rule():
    r = run("layout", "--num-layers", "8", "--pp", "2", "--partition", "5,3", "--aux-layers", "2,5,8", "--json")
    assert json.loads(r.stdout)["stages"][0]["produces"] == [2, 5]
    r = run("layout", "--num-layers", "8", "--pp", "2", "--partition", "5,3", "--aux-layers", "2,5,8",
            "--boundary-rule", "reject-at-stage-end")
    assert r.returncode == 2 and "aux layer id 5 ends stage 0" in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-layers", "4", "--pp", "0"], "pipeline size 0 is invalid"),
        (["--num-layers", "4", "--pp", "5"], "larger than num_layers 4"),
        (["--num-layers", "8", "--pp", "2", "--partition", "3,3"], "sums to 6"),
        (["--num-layers", "8", "--pp", "2", "--aux-layers", "2,x"], "'x' is not an integer"),
        (["--num-layers", "eight", "--pp", "2"], "invalid int value"),
        (["--num-layers", "8", "--pp", "2", "--aux-layers", "9"], "aux layer id 9 is out of range"),
    ],
)
def test_layout_bad_input_exits_2_with_one_line(args, needle):
    r = run("layout", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("pipespec")]) == 1


def test_specs_lists_registry_with_sources():
    r = run("specs", "--json")
    rows = {tuple(x["architectures"]): x for x in json.loads(r.stdout)}
    assert rows[("MiMoForCausalLM",)]["supported"] is False
    assert rows[("LlamaForCausalLM",)]["source"].endswith("llama.toml")


def test_verify_supported_unsupported_and_boundary(tmp_path):
    ok = run("verify", "--architecture", "LlamaForCausalLM", "--num-layers", "80", "--pp", "4")
    assert ok.returncode == 0 and "aux ids [2, 40, 77]" in ok.stdout
    mimo = run("verify", "--architecture", "MiMoForCausalLM", "--num-layers", "36", "--pp", "2")
    assert mimo.returncode == 1 and "`MiMoForCausalLM` does not support eagle3 with pipeline parallelism" in mimo.stderr
    kimi = run("verify", "--architecture", "KimiK3ForConditionalGeneration", "--num-layers", "8", "--pp", "2", "--aux-layers", "2,4,7")
    assert kimi.returncode == 2 and "ends stage 0" in kimi.stderr
    cls = run("verify", "--class", "transformers.models.qwen2.modeling_qwen2:Qwen2Model", "--num-layers", "24", "--pp", "3")
    assert cls.returncode == 0, cls.stderr
    bad = run("verify", "--class", "transformers.models.qwen2.modeling_qwen2:Nope", "--num-layers", "4", "--pp", "1")
    assert bad.returncode == 2 and "has no class 'Nope'" in bad.stderr


def test_verify_sees_specs_from_the_env_path(tmp_path):
    (tmp_path / "toy.toml").write_text('[adapter]\nname = "toy"\narchitectures = ["ToyForCausalLM"]\n'
                                      'decoder_class = "toy.modeling:ToyModel"\n')
    r = run("verify", "--architecture", "ToyForCausalLM", "--num-layers", "6", "--pp", "2",
            env={"PIPESPEC_ADAPTERS_PATH": str(tmp_path)})
    assert r.returncode == 0 and "spec only" in r.stdout
