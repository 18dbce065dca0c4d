"""``pipespec verify --engine sglang`` against the installed SGLang: verdicts without weights, DESIGN.md's JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import standin_env

pytestmark = pytest.mark.timeout(300)
KEYS = {"architecture", "class", "decision", "reason", "spec"}


def verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipespec.cli", "verify", "--engine", "sglang", *args],
                          env=standin_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(("architecture", "files"), [("LlamaForCausalLM", "llama.py"),
                                                     ("Qwen3MoeForCausalLM", "qwen2_moe.py + qwen3_moe.py"),
                                                     ("DeepseekV2ForCausalLM", "deepseek_v2.py")])
def test_adaptable_architecture_answers_adapt(architecture: str, files: str) -> None:
    done = verify("--architecture", architecture, "--pp", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(answer) == KEYS
    assert answer["architecture"] == architecture and answer["decision"] == "adapt"
    assert answer["class"].endswith(f":{architecture}")
    assert answer["spec"] == f"sglang dialect (adapt_sglang): {files}"


def test_declined_architecture_is_refused_with_exit_2() -> None:
    done = verify("--architecture", "MixtralForCausalLM", "--pp", "2", "--json")
    assert done.returncode == 2
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["decision"] == "refuse" and "MixtralModel" in answer["reason"]


def test_unknown_architecture_is_refused_with_the_way_out() -> None:
    done = verify("--architecture", "NoSuchForCausalLM", "--pp", "2")
    assert done.returncode == 2
    assert "NoSuchForCausalLM is not an architecture of SGLang 0.5.23" in done.stdout


def test_class_flag_is_a_usage_error() -> None:
    done = verify("--class", "sglang.srt.models.llama:LlamaForCausalLM", "--pp", "2")
    assert done.returncode == 2 and "give --architecture" in done.stderr.strip().splitlines()[-1]
