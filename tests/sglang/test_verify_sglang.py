"""``pipespec verify --engine sglang`` against the installed SGLang: verdicts without weights, DESIGN.md's JSON.

The verdicts are asked in this process (``verify_architecture``, what the CLI calls; SGLang is imported here
already); the CLI itself runs twice, for its JSON, exit codes and flag errors.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
from harness import standin_env

from pipespec.integrations.sglang.adapt_at_load import verify_architecture
from pipespec.integrations.verdict import Verdict

pytestmark = pytest.mark.timeout(300)
KEYS = {"architecture", "class", "decision", "reason", "spec"}


def verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipespec.cli", "verify", "--engine", "sglang", *args],
                          env=standin_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(("architecture", "files"), [("LlamaForCausalLM", "llama.py"), ("Qwen3ForCausalLM", "qwen3.py"),
                                                     ("Qwen3MoeForCausalLM", "qwen2_moe.py + qwen3_moe.py"),
                                                     ("DeepseekV2ForCausalLM", "deepseek_v2.py"),
                                                     ("Qwen2_5_VLForConditionalGeneration", "qwen2.py + qwen2_5_vl.py")])
def test_adaptable_architecture_answers_adapt(architecture: str, files: str) -> None:
    decision = verify_architecture(architecture, 2)
    assert decision.decision is Verdict.ADAPT, decision.reason
    assert decision.cls.endswith(f":{architecture}")
    assert decision.spec == f"sglang dialect (adapt_sglang): {files}"
    assert decision.adapted is not None and decision.adapted.__module__.startswith("pipespec_sglang_adapted.")


def test_unguarded_setter_keeps_the_capture_flag_on_the_last_rank() -> None:
    """Qwen2.5-VL's setter sets capture_aux_hidden_states = True on every rank (no guard in 0.5.23): in the
    adapted class it is a last-rank fact, so a non-last rank returns its PPProxyTensors instead of unpacking it."""
    decision = verify_architecture("Qwen2_5_VLForConditionalGeneration", 2)
    assert decision.adapted is not None, decision.reason
    source = inspect.getsource(decision.adapted.set_eagle3_layers_to_capture)
    assert source.rstrip().endswith("self.capture_aux_hidden_states = self.pp_group.is_last_rank")


def test_declined_architecture_is_refused_with_the_codemods_reason() -> None:
    decision = verify_architecture("MixtralForCausalLM", 2)
    assert decision.decision is Verdict.REFUSE
    assert "MixtralModel in mixtral.py" in decision.reason and "(line " in decision.reason


def test_cli_json_and_exit_codes() -> None:
    done = verify("--architecture", "LlamaForCausalLM", "--pp", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(answer) == KEYS and answer["decision"] == "adapt" and answer["architecture"] == "LlamaForCausalLM"
    assert answer["class"] == "sglang.srt.models.llama:LlamaForCausalLM"
    refused = verify("--architecture", "NoSuchForCausalLM", "--pp", "2")
    assert refused.returncode == 2
    assert "NoSuchForCausalLM is not an architecture of SGLang 0.5.23" in refused.stdout


def test_class_flag_is_a_usage_error() -> None:
    """Refused before SGLang is imported: one line, exit 2."""
    done = verify("--class", "sglang.srt.models.llama:LlamaForCausalLM", "--pp", "2")
    assert done.returncode == 2 and "give --architecture" in done.stderr.strip().splitlines()[-1]
