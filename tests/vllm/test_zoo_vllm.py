"""The vLLM zoo's harness and CLI against the real vLLM CPU build (real classes, real processes, no mocks).

One module-wide pool (a PP=1 worker and a PP=2 pair in vLLM's own gloo process groups) serves the
harness tests; the CLI tests run the installed ``pipespec`` in subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipespec.codemods.adapt_vllm_native import adapt_vllm_module
from pipespec.contract.layout import plan_layout
from pipespec.integrations.vllm.harness import Job
from pipespec.integrations.vllm.tiny import tiny_vllm_config, write_model_dir
from pipespec.integrations.vllm.zoo import (
    STATUSES,
    ZooResult,
    _architecture,
    _check,
    _defining_modules,
    _environment,
    _importing_holders,
    _jobs_for,
    adapt_files,
    inherited_flag_verdicts,
    vllm_root,
)
from pipespec.integrations.vllm.zoo_workers import WorkerPool

REPO = Path(__file__).resolve().parents[2]
VENV_PIPESPEC = Path(sys.executable).with_name("pipespec")
CORE_PYTHON = REPO / ".venv" / "bin" / "python"
MODELS = "vllm.model_executor.models"


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool()
    try:
        yield p
    finally:
        p.close()


def _job(stem: str, causal_lm: str, code: str | None) -> Job:
    return Job(file=f"model_executor/models/{stem}.py", module=f"{MODELS}.{stem}", decoder="", causal_lm=causal_lm,
               architecture=causal_lm, code=code)


def _source(stem: str) -> str:
    return (Path(vllm_root()) / "model_executor" / "models" / f"{stem}.py").read_text(encoding="utf-8")


def _row(job: Job) -> ZooResult:
    return ZooResult(file=job.file, class_name=job.causal_lm, status="failed", reason="")


@pytest.mark.timeout(240)
def test_llama_as_shipped_is_supported_at_pp1_and_pp2(pool: WorkerPool) -> None:
    """vLLM's own llama.py packs the planned keys at PP=2 and its aux states equal the residual stream."""
    row = _row(_job("llama", "LlamaForCausalLM", None))
    _check(pool, _job("llama", "LlamaForCausalLM", None), row)
    assert row.status == "supported", row.reason
    assert row.num_layers == 6 and row.aux_layers == (0, 3, 4, 6)
    assert row.sends_stage0 == tuple(plan_layout(6, 2, (0, 3, 4, 6)).stage(0).sends) == (
        "aux_hidden_states_0", "aux_hidden_states_1")
    assert row.max_abs_err_pp1 is not None and row.max_abs_err_pp1 <= 1e-5
    assert row.max_abs_err_pp2 is not None and row.max_abs_err_pp2 <= 1e-5


@pytest.mark.timeout(240)
def test_decoder_shipped_without_aux_support_fails_pp1(pool: WorkerPool) -> None:
    """gemma.py as vLLM ships it returns no aux states: the check fails instead of passing vacuously."""
    row = _row(_job("gemma", "GemmaForCausalLM", None))
    _check(pool, _job("gemma", "GemmaForCausalLM", None), row)
    assert row.status == "failed"
    assert row.reason.startswith("no aux states returned by GemmaForCausalLM at PP=1"), row.reason


@pytest.mark.timeout(240)
def test_capture_at_idx_instead_of_idx_plus_one_is_a_numerical_mismatch(pool: WorkerPool) -> None:
    """The right classes with each layer's capture one id early: PP=1 reports the id and the difference."""
    adapted = adapt_vllm_module(_source("gemma"), label="gemma.py").code
    broken, edits = re.subn(r"(self\._maybe_add_hidden_state\(\s*aux_hidden_states,\s*)idx \+ 1\b", r"\1idx", adapted)
    assert edits == 1
    good_row, bad_row = _row(_job("gemma", "GemmaForCausalLM", adapted)), _row(_job("gemma", "GemmaForCausalLM", broken))
    _check(pool, _job("gemma", "GemmaForCausalLM", adapted), good_row)
    _check(pool, _job("gemma", "GemmaForCausalLM", broken), bad_row)
    assert good_row.status == "verified", good_row.reason
    assert bad_row.status == "failed"
    assert re.fullmatch(r"PP=1: aux ids? [\d, ]+ differs? from the residual stream \(worst: id \d by [\d.e+-]+; "
                        r"ids \[0, 3, 4, 6\]\)", bad_row.reason), bad_row.reason


@pytest.mark.timeout(240)
def test_mamba1_mixer_without_runner_metadata_is_checked(pool: WorkerPool) -> None:
    """mamba.py adapted: its Mamba-1 mixers (whose no-metadata path cannot run on the CPU build) are not
    run, and the decoder loop is verified at PP=1 and PP=2 like any other."""
    (rel, outcome, code, _source_text), = adapt_files(["model_executor/models/mamba.py"])
    assert outcome.status == "adapted" and code is not None
    job = Job(file=rel, module=f"{MODELS}.mamba", decoder=outcome.class_name, causal_lm="MambaForCausalLM",
              architecture="MambaForCausalLM", code=code)
    row = _row(job)
    _check(pool, job, row)
    assert row.status == "verified", row.reason
    assert row.max_abs_err_pp2 is not None and row.max_abs_err_pp2 <= 1e-5


def test_holder_in_another_file_is_found_through_the_registry() -> None:
    """ernie45_vl_moe.py's holder is built by ernie45_vl.py's registered class, which imports it."""
    assert _importing_holders(f"{MODELS}.ernie45_vl_moe", ["Ernie4_5_VLMoeForCausalLM"]) == [
        (f"{MODELS}.ernie45_vl", "Ernie4_5_VLMoeForConditionalGeneration")]
    assert _importing_holders(f"{MODELS}.llama", ["NoSuchHolder"]) == []


def test_registry_package_is_followed_to_the_platform_variant_holding_the_decoder() -> None:
    """The registry names the package ``vllm.models.deepseek_v41``, whose ``__init__`` imports the class
    from ``.amd.vl_model`` on ROCm and ``.nvidia.vl_model`` elsewhere; amd/model.py's decoder is found in
    the amd variant (the one importing its holder), ahead of the DSpark draft head that imports the decoder."""
    v41 = "vllm.models.deepseek_v41"
    assert _defining_modules(v41, "DeepseekV41ForCausalLM") == [f"{v41}.amd.vl_model", f"{v41}.nvidia.vl_model"]
    assert _defining_modules(v41, "NoSuchClass") == []
    assert _importing_holders(f"{v41}.amd.model", ["DeepseekV41LLMForCausalLM"]) == [
        (f"{v41}.amd.vl_model", "DeepseekV41ForCausalLM")]
    assert (f"{v41}.amd.dspark", "DSparkDeepseekV4ForCausalLM") in _importing_holders(f"{v41}.amd.model", ["DeepseekV4Model"])
    assert _architecture(f"{v41}.amd.vl_model", "DeepseekV41ForCausalLM") == "DeepseekV41ForCausalLM"
    (rel, outcome, code, source), = adapt_files(["models/deepseek_v41/amd/model.py"])
    job, why = _jobs_for(rel, outcome, code, source)
    assert job is not None, why
    assert (job.architecture, job.causal_lm, job.holder_module) == (
        "DeepseekV41ForCausalLM", "DeepseekV41ForCausalLM", f"{v41}.amd.vl_model")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rel", ["model_executor/models/nemotron_h.py", "model_executor/models/deepseek_v2.py"])
def test_dense_nemotron_h_and_latent_attention_are_verified(pool: WorkerPool, rel: str) -> None:
    """Nemotron-H built with Mamba, MLP and attention layers only (its MoE layers' non-gated experts have no
    CPU kernel), and DeepSeek-V2's MLA on vLLM's CPU_MLA backend (AMX_MLA, picked where the CPU has AMX,
    refuses the tiny heads): both verified at PP=1 and PP=2."""
    if rel.endswith("nemotron_h.py"):
        config, _ = tiny_vllm_config("NemotronHForCausalLM", "nemotron_h")
        assert config.hybrid_override_pattern == "M-*-M-"
    (file, outcome, code, source), = adapt_files([rel])
    job, why = _jobs_for(file, outcome, code, source)
    assert job is not None and code is not None, why
    row = _row(job)
    _check(pool, job, row)
    assert row.status == "verified", row.reason
    assert row.max_abs_err_pp2 is not None and row.max_abs_err_pp2 <= 1e-5


def test_remote_config_block_configs_read_by_attribute_after_loading(tmp_path: Path) -> None:
    """Nemotron-NAS's tiny remote-code config: its per-layer block configs read by attribute, also after
    vLLM's loader reads the written directory back (the no-op layers survive the round trip)."""
    from transformers import AutoConfig

    config, model_type = tiny_vllm_config("DeciLMForCausalLM", "nemotron_nas")
    assert model_type == "nemotron-nas"
    loaded = AutoConfig.from_pretrained(write_model_dir(config, str(tmp_path)))
    assert [b.attention.no_op for b in loaded.block_configs] == [False, False, True, False, False, False]
    assert [b.ffn.no_op for b in loaded.block_configs] == [False, False, False, False, True, False]
    assert not hasattr(loaded.block_configs[0].ffn, "ffn_mult")


def test_build_error_of_this_machine_says_it_was_not_checked() -> None:
    """A known CPU-build error keeps its text and says the decoder was not checked; others are unchanged."""
    reason = _environment("PP=1: ModuleNotFoundError: No module named 'torchvision'")
    assert reason.startswith("PP=1: ModuleNotFoundError: No module named 'torchvision' [not checked on this machine:")
    assert _environment("PP=1: ValueError: bad size") == "PP=1: ValueError: bad size"


@pytest.mark.parametrize(("error", "meaning"), [  # the errors measured in this session's zoo, verbatim
    ("RuntimeError: Tried to instantiate dummy base class Event", "torch.cuda.Event"),
    ("RuntimeError: torch.cuda.Stream requires CUDA support", "CUDA streams"),
    ("NotImplementedError: Sparse Attention is not supported on CPU.", "sparse attention"),
    ("AssertionError: WorkspaceManager not initialized. Call init_workspace_manager() with a device before using "
     "workspace functions.", "workspace manager"),
    ("TypeError: Ernie4_5_VLRotaryEmbedding.forward_native() takes from 3 to 4 positional arguments but 5 were "
     "given", "forward_cpu"),
    ("NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now", "activation"),
])
def test_cpu_build_errors_of_deepseek_ernie_nemotron_are_named(error: str, meaning: str) -> None:
    """Each stays a failure, with what it means on this CPU build."""
    reason = _environment(f"PP=1: {error}")
    assert reason.startswith(f"PP=1: {error} [not checked on this machine: ") and meaning in reason


def _cli(*args: str, python: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [str(python), "-m", "pipespec.cli"] if python is not None else [str(VENV_PIPESPEC)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*cmd, "zoo", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.timeout(300)
def test_cli_json_on_a_file_subset(tmp_path: Path) -> None:
    """`--files llama.py,mimo.py --json`: one row per decoder with DESIGN.md's fields; the report is written."""
    report = tmp_path / "coverage-vllm.md"
    done = _cli("--engine", "vllm", "--files", "llama.py,mimo.py", "--json", "--write-coverage", str(report))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert [(r["file"], r["class"]) for r in rows] == [
        ("model_executor/models/llama.py", "LlamaModel"), ("model_executor/models/mimo.py", "MiMoModel")]
    for r in rows:
        assert {"file", "class", "status", "reason"} <= set(r) and r["status"] in STATUSES and r["reason"]
    assert [r["status"] for r in rows] == ["supported", "declined"]
    text = report.read_text(encoding="utf-8")
    assert "pipespec zoo --engine vllm" in text and "| supported | 1 |" in text and "MistralModel" in text


@pytest.mark.timeout(120)
def test_cli_unknown_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A --files entry that is not a vLLM model file: exit 2, one line naming it, no report written."""
    report = tmp_path / "r.md"
    done = _cli("--engine", "vllm", "--files", "llama.py,no_such_model.py", "--write-coverage", str(report))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'no_such_model.py'" in lines[0], done.stderr
    assert not report.exists()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not CORE_PYTHON.exists(), reason="needs the core .venv (make venv) to run without vLLM")
def test_cli_without_vllm_says_where_to_run_it() -> None:
    """In .venv (no vLLM) the command prints the one line pointing at .venv-vllm and exits 2."""
    done = _cli("--engine", "vllm", "--json", python=CORE_PYTHON)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "pipespec: error: pipespec zoo --engine vllm needs vLLM >= 0.32 installed; run it in .venv-vllm (make venv-vllm)"
    )
    assert done.stdout == ""


@pytest.mark.timeout(120)
def test_report_judges_the_four_inherited_flag_classes() -> None:
    """qwen3_vl's and MossQwen3's classes refused with the fix, MistralModel accepted, MiMo refused."""
    verdicts = {v["class"]: v for v in inherited_flag_verdicts()}
    assert {k: v["supported"] for k, v in verdicts.items()} == {
        "Qwen3LLMModel": False, "MossQwen3Model": False, "MistralModel": True, "MiMoModel": False}
    for name in ("Qwen3LLMModel", "MossQwen3Model"):
        assert verdicts[name]["message"].startswith(f"{name} does not support eagle3 with pipeline parallelism: ")
        assert "Fix: " in verdicts[name]["message"]
    assert verdicts["MiMoModel"]["opted_out"] is True
