"""``pipespec verify --engine vllm``: what the plugin would do at engine load, without weights.

Real vLLM classes, the real codemod on vLLM's installed source, the real CLI (``pipespec.cli.main``, in
this process so vLLM is imported once; without vLLM: a subprocess). The JSON
is DESIGN.md's contract: ``{"architecture", "class", "decision", "reason", "spec"}``, exit 0 unless
refused (2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.cli import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
V1_RUNNER = "eagle3 over PP=2 cannot run on vLLM's V1 model runner"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Run ``pipespec verify --engine vllm ARGS`` in this process (vLLM imported once for the file)."""
    for key in ("PIPESPEC_VLLM", "PIPESPEC_ADAPTERS_PATH", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIPESPEC_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(SCRIPTS))

    def run(*args: str, **env: str) -> tuple[int, str, str]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = main(["verify", "--engine", "vllm", *args])
        out, err = capsys.readouterr()
        for key in env:
            monkeypatch.delenv(key)
        return code, out, err

    return run


def _json(cli, *args: str, **env: str) -> tuple[int, dict]:
    code, out, err = cli(*args, "--json", **env)
    assert out.strip(), err[-2000:]
    return code, json.loads(out.strip().splitlines()[-1])


def test_supported_class_is_left_alone(cli) -> None:
    """vLLM's Llama carries SupportsEagle3 and its own flag: nothing to do."""
    code, result = _json(cli, "--architecture", "LlamaForCausalLM", "--pp", "1")
    assert code == 0
    assert result["decision"] == "supported" and result["spec"] is None
    assert result["class"] == "vllm.model_executor.models.llama:LlamaForCausalLM"
    assert set(result) == {"architecture", "class", "decision", "reason", "spec"}


@pytest.mark.parametrize("pp, env", [(1, {}), (2, {"VLLM_USE_V2_MODEL_RUNNER": "1"})])
def test_in_tree_class_without_eagle3_would_be_adapted(cli, pp: int, env: dict[str, str]) -> None:
    """Mixtral lacks SupportsEagle3: adapted from vLLM's own mixtral.py (at PP=2 where the V2 runner runs)."""
    code, result = _json(cli, "--architecture", "MixtralForCausalLM", "--pp", str(pp), **env)
    assert code == 0, result
    assert (result["decision"], result["spec"]) == ("adapt", "inferred")
    assert result["reason"].startswith("MixtralForCausalLM does not support eagle3")
    assert result["reason"].endswith("vllm/model_executor/models/mixtral.py")


def test_out_of_tree_class_would_be_adapted(cli) -> None:
    """A model author's module (absolute imports, decoder at .backbone) is adapted the same way."""
    code, result = _json(cli, "--class", "toy_lm:ToyLMForCausalLM", "--pp", "1")
    assert code == 0
    assert (result["architecture"], result["decision"]) == ("ToyLMForCausalLM", "adapt")


def test_eagle3_over_pp_on_the_v1_runner_is_refused(cli) -> None:
    """This CPU build runs vLLM's V1 runner, which never relays aux states: refused, naming the runner."""
    code, result = _json(cli, "--architecture", "LlamaForCausalLM", "--pp", "2")
    assert code == 2 and result["decision"] == "refuse"
    assert result["reason"].startswith("pipespec: " + V1_RUNNER)


def test_class_that_opts_out_is_refused(cli) -> None:
    """MiMo sets supports_aux_hidden_states_over_pp = False itself: refused, not adapted behind its back."""
    code, result = _json(cli, "--architecture", "MiMoForCausalLM", "--pp", "2", VLLM_USE_V2_MODEL_RUNNER="1")
    assert code == 2 and result["decision"] == "refuse"
    assert "sets supports_aux_hidden_states_over_pp = False itself" in result["reason"]


def test_unknown_architecture_is_refused_in_one_line(cli) -> None:
    code, out, err = cli("--architecture", "NoSuchForCausalLM", "--pp", "1")
    assert code == 2
    assert out.strip().splitlines() == [
        "NoSuchForCausalLM: refuse: NoSuchForCausalLM is not an architecture of vLLM 0.32.0 (nor of any loaded "
        "vLLM plugin): check the spelling (config.json's `architectures`), or register the model with "
        "ModelRegistry.register_model"
    ]


def test_without_vllm_one_line_and_exit_2() -> None:
    """Where vLLM cannot be imported (here: import blocked in the subprocess) the CLI says where to run it."""
    code = ("import sys; sys.modules['vllm'] = None\nfrom pipespec.cli import main\n"
            "sys.exit(main(['verify', '--engine', 'vllm', '--architecture', 'MixtralForCausalLM', '--pp', '1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pipespec: error: pipespec verify --engine vllm needs vLLM (>= 0.32) installed: run it where vLLM is "
        "(`pip install 'pipespec[vllm]'`)"
    ]


def test_class_the_codemod_cannot_adapt_is_refused_with_its_reason(cli) -> None:
    """A decoder that loops over all layers has no stage loop: vLLM's words, then the codemod's reason."""
    code, result = _json(cli, "--class", "toy_unadaptable:AllLayersForCausalLM", "--pp", "1")
    assert code == 2 and result["decision"] == "refuse"
    head, _, why = result["reason"].partition("; pipespec cannot adapt it: ")
    assert head == "AllLayersForCausalLM does not support eagle3: `AllLayersForCausalLM` does not implement SupportsEagle3"
    assert why.startswith(str(SCRIPTS / "toy_unadaptable.py") + ": no PP decoder here")


def test_spec_marking_the_architecture_unsupported_refuses(cli, tmp_path: Path) -> None:
    """A user's spec with supported = false wins over adaptation, and its reason is quoted."""
    (tmp_path / "mixtral.toml").write_text(
        '[adapter]\nname = "mixtral_off"\narchitectures = ["MixtralForCausalLM"]\n'
        'decoder_class = "vllm.model_executor.models.mixtral:MixtralModel"\ndialect = "vllm"\n'
        'supported = false\nreason = "our MoE kernels are not validated with drafts"\n'
    )
    code, result = _json(cli, "--architecture", "MixtralForCausalLM", "--pp", "1", PIPESPEC_ADAPTERS_PATH=str(tmp_path))
    assert code == 2 and result["decision"] == "refuse"
    assert "pipespec cannot adapt it: MixtralForCausalLM does not support EAGLE3 hidden-state capture: our MoE " \
           "kernels are not validated with drafts" in result["reason"]
    assert f"({tmp_path / 'mixtral.toml'} says supported = false)" in result["reason"]


def test_spec_on_the_adapters_path_guides_the_adaptation_and_is_named(cli, tmp_path: Path) -> None:
    """A vLLM-dialect spec for the architecture is used (and named in the verdict and the log line)."""
    (tmp_path / "mixtral_vllm.toml").write_text(
        '[adapter]\nname = "mixtral_vllm"\narchitectures = ["MixtralForCausalLM"]\n'
        'decoder_class = "vllm.model_executor.models.mixtral:MixtralModel"\ndialect = "vllm"\n'
    )
    code, result = _json(cli, "--architecture", "MixtralForCausalLM", "--pp", "1", PIPESPEC_ADAPTERS_PATH=str(tmp_path))
    assert code == 0
    assert (result["decision"], result["spec"]) == ("adapt", "PIPESPEC_ADAPTERS_PATH mixtral_vllm.toml")


@pytest.mark.parametrize("pp, env", [(1, {}), (2, {"VLLM_USE_V2_MODEL_RUNNER": "1"})])
def test_inherited_flag_over_an_overriding_forward_is_adapted(cli, pp: int, env: dict[str, str]) -> None:
    """vLLM's check passes on the inherited flag (qwen3_vl's bug); pipespec judges the forward and adapts."""
    code, result = _json(cli, "--class", "toy_inherited:OverridingQwen2ForCausalLM", "--pp", str(pp), **env)
    assert code == 0 and result["decision"] == "adapt"
    assert "`OverridingQwen2Model.forward`" in result["reason"]
    assert "supports_aux_hidden_states_over_pp = True is only inherited from `Qwen2Model`" in result["reason"]


def test_transparent_override_keeps_support(cli) -> None:
    """MistralModel's forward only delegates to super().forward: supported as is, nothing adapted."""
    code, result = _json(cli, "--architecture", "MistralForCausalLM", "--pp", "2", VLLM_USE_V2_MODEL_RUNNER="1")
    assert code == 0 and result["decision"] == "supported"


def test_transformers_backend_multimodal_is_left_to_vllm_at_pp1(cli) -> None:
    """The multimodal Transformers backend (no text decoder pipespec's subclass can hook): vLLM's own at PP=1.
    The text classes get pipespec's subclass (tests/vllm/test_transformers_backend.py)."""
    code, result = _json(cli, "--architecture", "TransformersMultiModalForCausalLM", "--pp", "1")
    assert code == 0 and result["decision"] == "supported"
    assert result["reason"].startswith("TransformersMultiModalForCausalLM implements vLLM's SupportsEagle3 (PP = 1; "
                                       "pipespec leaves it to vLLM: ")
