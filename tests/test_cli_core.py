"""The installed `pipespec` console script: layout / specs / verify, help, the torchrun entry point's --pp, exit codes."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.cli import COMMANDS
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
        # a value that starts with a dash is a value, refused for what it is (not "expected one argument")
        (["--num-layers", "8", "--pp", "2", "--aux-layers", "-1,5"], "aux layer id -1 is out of range"),
        (["--num-layers", "8", "--pp", "2", "--partition", "-1,9"], "partition [-1, 9] contains -1"),
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
    assert r.returncode == 0 and r.stdout.rstrip().endswith(f"boundary rule allow (spec {tmp_path / 'toy.toml'})")


def test_verify_by_architecture_names_the_spec_that_answers():
    r = run("verify", "--architecture", "Qwen2ForCausalLM", "--num-layers", "24", "--pp", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("Qwen2ForCausalLM: supported for eagle3 with PP=3, partition [8, 8, 8], aux ids [2, 12, 21], "
                        "boundary rule allow (spec qwen2.toml)\n")


def test_specs_table_fits_100_columns_and_json_keeps_every_field(tmp_path):
    deep = tmp_path.joinpath(*(["a_rather_long_directory_name"] * 4))
    deep.mkdir(parents=True)
    reason = "its forward drops every aux state it is handed, " * 4
    (deep / "toy.toml").write_text(
        '[adapter]\nname = "toy"\narchitectures = ["ToyForCausalLM", "ToyForConditionalGeneration"]\n'
        f'decoder_class = "toy.models.modeling_toy:ToyModel"\nsupported = false\nreason = "{reason.strip()}"\n')
    env = {"PIPESPEC_ADAPTERS_PATH": str(deep)}
    table = run("specs", env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, [line for line in lines if len(line) > 100]
    toy = next(i for i, line in enumerate(lines) if line.startswith("ToyForCausalLM "))
    assert lines[toy].split()[:4] == ["ToyForCausalLM", "ToyModel", "no", "path"]
    assert lines[toy].endswith("toy.toml") and len(lines[toy]) == 100  # the long path shortened from the left
    assert lines[toy + 1].strip() == "ToyForConditionalGeneration"
    assert " ".join(lines[toy + 2:toy + 5]).split()[:4] == ["not", "supported:", "its", "forward"]
    rows = {tuple(x["architectures"]): x for x in json.loads(run("specs", "--json", env=env).stdout)}
    toy_row = rows[("ToyForCausalLM", "ToyForConditionalGeneration")]
    assert toy_row["decoder_class"] == "toy.models.modeling_toy:ToyModel"
    assert toy_row["source"] == str(deep / "toy.toml") and toy_row["reason"] == reason.strip()


def test_every_option_has_help_that_cites_no_file_a_pip_user_lacks():
    from pipespec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing, citing = [], []
    for name, command in sub.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                missing.append(flag)
            elif re.search(r"DESIGN\.md|docs/\S+\.md", action.help):
                citing.append(flag)
    assert missing == [] and citing == []
    assert len(sub.choices) == len(COMMANDS)  # every command was built (none skipped for a missing module)


def test_zoo_prints_no_transformers_deprecation_warning():
    r = run("zoo", "--model-types", "llama", "--pp", "1,2")
    assert r.returncode == 0, r.stderr
    assert "llama       verified" in r.stdout
    assert "deprecated" not in r.stderr, r.stderr  # transformers' past_key_values warning (issue 33)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from pipespec.engine.tiny_checkpoints import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("torchrun") / "target", "llama", num_layers=4, seed=5)


def test_generate_says_its_convention_line_once_per_process(tiny_target, capsys, monkeypatch):
    """A benchmark runs `generate` through the CLI's entry point many times in one process: one line, not one a run."""
    from pipespec.cli import generate, main

    monkeypatch.setattr(generate, "_ANNOUNCED", set())  # what earlier tests of this process announced
    flags = ["generate", "--target", str(tiny_target), "--prompt-ids", "3,1", "--max-new-tokens", "2",
             "--num-spec-tokens", "0", "--json"]
    assert main(flags) == 0 and main(flags) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2  # both runs printed their result
    assert err.splitlines().count("pipespec: plain pipeline decoding (--num-spec-tokens 0): no draft, no aux states") == 1


def torchrun(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN.parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "pipespec.engine",
                           *flags], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(300)
def test_torchrun_without_pp_runs_one_stage_per_process(tiny_target):
    proc = torchrun("--target", str(tiny_target), "--prompt-ids", "3,1,4", "--max-new-tokens", "3",
                    "--num-spec-tokens", "0", "--json", "--timeout", "60")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["pp"] == 2 and [s["rank"] for s in out["stages"]] == [0, 1] and len(out["output_ids"]) == 3


@pytest.mark.timeout(300)
def test_torchrun_with_a_pp_that_is_not_the_world_size_says_so_once(tiny_target):
    proc = torchrun("--target", str(tiny_target), "--pp", "3", "--prompt-ids", "3,1,4", "--num-spec-tokens", "0")
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("pipespec.engine: error:")]
    assert ours == ["pipespec.engine: error: stage 0: UsageError: --pp 3 does not match the 2 processes torchrun "
                    "started (--nproc-per-node times --nnodes): drop --pp (it defaults to that number) or start one "
                    "process per stage"]
