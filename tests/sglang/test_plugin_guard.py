"""The plugin's verdicts at engine load, in real SGLang: without it SGLang's guard refuses aux states under PP;
with it a class the codemod declines is refused in one line before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_engine, write_tiny

pytestmark = pytest.mark.timeout(600)


def test_without_plugin_sglang_refuses_aux_states_over_pp(tmp_path: Path) -> None:
    model = write_tiny("llama", tmp_path / "model")
    run = run_engine(model, 2, tmp_path / "run", plugin=False)
    assert run.returncode == 1
    assert "--enable-return-aux-hidden-states only supports pp_size == 1" in run.stderr.strip().splitlines()[-1]


def test_a_misspelt_switch_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """SGLang logs and swallows a plugin's exception; a typo in PIPESPEC_SGLANG must not silently mean off."""
    model = write_tiny("llama", tmp_path / "model")
    run = run_engine(model, 2, tmp_path / "run", plugin="of")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == "UsageError: PIPESPEC_SGLANG='of': use 1 (on) or 0 (off)"


def test_declined_class_is_refused_in_one_line_before_weights_load(tmp_path: Path) -> None:
    """Mixtral's SGLang decoder captures no aux states: nothing to relay, so the plugin refuses it. The
    checkpoint has a config and no weights: a refusal after loading would fail on the weights instead."""
    model = tmp_path / "mixtral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256, "torch_dtype": "float32"}))
    run = run_engine(model, 2, tmp_path / "run")
    assert run.returncode == 1
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("UnsupportedModelError: pipespec: --enable-return-aux-hidden-states with --pp-size 2: "
                           "MixtralForCausalLM does not support EAGLE3 with pipeline parallelism"), line
    assert "declined" in line and "MixtralModel" in line and "line " in line
