"""The vLLM zoo's harness and CLI against the real vLLM CPU build (real classes, real processes, no mocks).

One module-wide pool (a PP=1 worker, a PP=2 pair and a PP=3 trio in vLLM's own gloo process groups) serves
the harness tests; the CLI tests run the installed ``pipespec`` in subprocesses.
"""

from __future__ import annotations

import dataclasses
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
from pipespec.integrations.vllm.pp_ranks import PipelineError, max_error, pp3_ids, pp3_partition, run_pipeline
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
def test_llama_as_shipped_is_supported_at_pp1_pp2_and_pp3(pool: WorkerPool) -> None:
    """vLLM's own llama.py packs the planned keys at PP=2 and PP=3 (its middle rank relayed by vLLM's
    PPHandler) and its aux states equal the residual stream."""
    row = _row(_job("llama", "LlamaForCausalLM", None))
    _check(pool, _job("llama", "LlamaForCausalLM", None), row)
    assert row.status == "supported", row.reason
    assert row.num_layers == 6 and row.aux_layers == (0, 3, 4, 6)
    assert row.sends_stage0 == tuple(plan_layout(6, 2, (0, 3, 4, 6)).stage(0).sends) == (
        "aux_hidden_states_0", "aux_hidden_states_1")
    assert row.partition_pp3 == (3, 1, 2) and row.aux_layers_pp3 == (0, 3, 4, 6)
    plan3 = plan_layout(6, 3, row.aux_layers_pp3, row.partition_pp3)
    assert row.sends_pp3_stage0 == plan3.stage(0).sends
    assert row.sends_pp3_stage1 == plan3.stage(1).sends == tuple(f"aux_hidden_states_{i}" for i in range(3))
    for err in (row.max_abs_err_pp1, row.max_abs_err_pp2, row.max_abs_err_pp3):
        assert err is not None and err <= 1e-5


def test_pp3_ids_put_an_id_on_every_boundary_and_give_the_middle_rank_both_kinds_of_keys() -> None:
    """For every tiny depth, the PP=3 ids hold 0, N and each stage boundary, the first stage owns more than
    layer 0, and the middle stage both relays upstream keys and packs its own (so the check exercises the
    relay and the slot base)."""
    for n in range(3, 9):
        partition = pp3_partition(n)
        plan = plan_layout(n, 3, pp3_ids(n, partition), partition)
        assert {0, n, plan.stage(0).end_layer, plan.stage(1).end_layer} <= set(plan.aux_layers)
        assert plan.stage(0).end_layer >= min(2, n - 2)
        middle = plan.stage(1)
        assert middle.relays and middle.own_keys and middle.sends == middle.relays + middle.own_keys
    with pytest.raises(ValueError, match="at least 3 decoder layers"):
        pp3_partition(2)


def _adapted(rel: str) -> Job:
    (file, outcome, code, source), = adapt_files([rel])
    job, why = _jobs_for(file, outcome, code, source)
    assert job is not None and code is not None, why
    return job


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rel", ["model_executor/models/llama.py", "model_executor/models/gpt2.py",
                                 "model_executor/models/mixtral.py", "model_executor/models/minicpm.py"])
def test_pp3_each_rank_matches_the_plan_and_the_last_rank_the_pp1_reference(pool: WorkerPool, rel: str) -> None:
    """Llama (a residual), GPT-2 adapted (none), Mixtral adapted (MoE) and MiniCPM adapted (its layers return
    None for the residual: zeros are handed off) over three gloo ranks: every rank's
    receive slots, vLLM's relay keys, what it packs and what it sends equal plan_layout's stage, and the last
    rank's aux states equal the PP=1 residual stream at ids on both stage boundaries and id 0."""
    job = _job("llama", "LlamaForCausalLM", None) if rel.endswith("llama.py") else _adapted(rel)
    kind, pp1 = pool.ask("pp1", ("pp1", (job,)))
    assert kind == "ok", pp1
    n = pp1["num_layers"]
    partition = pp3_partition(n)
    ids = pp3_ids(n, partition)
    run = run_pipeline(pool, job, ids, n, 3, partition)
    plan = plan_layout(n, 3, ids, partition)
    for stage, rank in zip(plan.stages, run.ranks):
        assert (rank["start"], rank["end"]) == (stage.start_layer, stage.end_layer)
        assert tuple(rank["receives"]) == stage.receives
        assert tuple(rank["relays"]) == stage.relays
        assert tuple(rank["packed"]) == (() if stage.is_last else stage.own_keys)
        assert run.sends(stage.rank) == stage.sends
    assert run.ranks[1]["relays"] and run.ranks[1]["packed"]  # the middle rank does both
    assert len(run.aux) == len(ids)
    worst, err = max_error(run, pp1["reference"])
    assert err <= 1e-5, (worst, err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("rel", "surface"), [
    # OPTModel wraps the adapted OPTDecoder: the flag on the wrapper's class
    ("model_executor/models/opt.py", "    supports_aux_hidden_states_over_pp = True  # vLLM's V2 runner reads"),
    # DbrxModel drops its config: kept for reserve_aux_intermediate_tensor_slots
    ("model_executor/models/dbrx.py", "        self.config = config  # vLLM's V2 runner reads"),
    # get_language_model() is the decoder itself: its .model
    ("model_executor/models/moondream3.py", "    @property\n    def model(self) -> nn.Module:\n        # The language"),
])
def test_v2_runner_reaches_a_wrapped_configless_or_language_model_decoder(pool: WorkerPool, rel: str, surface: str) -> None:
    """The adapted OPT, Dbrx and Moondream3 at PP=2 and PP=3 driven by vLLM's own V2-runner steps: every rank
    matches plan_layout and the last rank the PP=1 residual stream, ids on each boundary and 0. The same file
    without the runner surface vllm_native_runner_surface gave it fails at PP=2, where vLLM reads it."""
    job = _adapted(rel)
    assert job.code is not None and surface in job.code
    kind, pp1 = pool.ask("pp1", ("pp1", (job,)))
    assert kind == "ok", pp1
    n = pp1["num_layers"]
    for pp, partition in ((2, (n // 2, n - n // 2)), (3, pp3_partition(n))):
        ids = pp3_ids(n, partition)
        run = run_pipeline(pool, job, ids, n, pp, partition)
        assert [run.sends(s.rank) for s in plan_layout(n, pp, ids, partition).stages[:-1]] == \
            [s.sends for s in plan_layout(n, pp, ids, partition).stages[:-1]]
        worst, err = max_error(run, pp1["reference"])
        assert err <= 1e-5, (pp, worst, err)
    start = job.code.index(surface)
    cut = job.code.index("\n\n", start) if "def model" in surface else job.code.index("\n", start)
    without = dataclasses.replace(job, code=job.code[:start] + job.code[cut + 1:])
    partition = (n // 2, n - n // 2)
    with pytest.raises(PipelineError) as refused:
        run_pipeline(pool, without, pp3_ids(n, partition), n, 2, partition)
    assert ("does not support eagle3 with pipeline parallelism" in str(refused.value)
            or "has no attribute 'config'" in str(refused.value)), refused.value


@pytest.mark.timeout(300)
def test_minicpm_none_residual_passes_pp2_only_as_zeros(pool: WorkerPool) -> None:
    """MiniCPM's layers return None for the residual; vLLM's runner copies every handed-off value into a
    tensor buffer. The adapted file sends zeros in its place (its layers rebind the residual first) and
    matches PP=1 at PP=2; the same file sending the layers' None fails on the receiving rank."""
    job = _adapted("model_executor/models/minicpm.py")
    zeros = "torch.zeros_like(hidden_states)\n                    if residual is None\n                    else residual"
    assert job.code is not None and zeros in job.code
    kind, pp1 = pool.ask("pp1", ("pp1", (job,)))
    assert kind == "ok", pp1
    n = pp1["num_layers"]
    partition = (n // 2, n - n // 2)
    ids = pp3_ids(n, partition)
    worst, err = max_error(run_pipeline(pool, job, ids, n, 2, partition), pp1["reference"])
    assert err <= 1e-5, (worst, err)
    without = dataclasses.replace(job, code=job.code.replace(zeros, "residual"))
    with pytest.raises(PipelineError) as refused:
        run_pipeline(pool, without, ids, n, 2, partition)
    assert "NoneType" in str(refused.value), refused.value


def _edited_llama(pattern: str, replacement: str) -> Job:
    code, edits = re.subn(pattern, replacement, _source("llama"))
    assert edits == 1
    return _job("llama", "LlamaForCausalLM", code)


@pytest.mark.timeout(240)
def test_relative_slots_pass_pp2_and_fail_pp3_on_the_middle_rank(pool: WorkerPool) -> None:
    """A decoder that packs its aux states from slot 0 instead of its stage's slot base (the relative-index
    bug) is right at PP=2, where only rank 0 packs; at PP=3 its middle rank packs keys that collide with the
    ones it relays, and the check names the rank and both key lists."""
    job = _edited_llama(r"\*\*self\.pack_local_aux_hidden_states\(aux_hidden_states\)",
                        '**{f"{self.AUX_HIDDEN_STATE_KEY}{i}": t for i, t in enumerate(aux_hidden_states)}')
    row = _row(job)
    _check(pool, job, row)
    assert row.max_abs_err_pp2 is not None and row.max_abs_err_pp2 <= 1e-5
    assert row.status == "failed"
    assert row.reason == ("PP=3 (partition [3, 1, 2]) rank 1 packs (its own aux states) ['aux_hidden_states_0'], "
                          "the layout plan says ['aux_hidden_states_2'] (ids [0, 3, 4, 6])"), row.reason


@pytest.mark.timeout(240)
def test_receive_buffers_without_a_sent_key_fail_on_that_rank_without_blocking_the_next(pool: WorkerPool) -> None:
    """Receive buffers that lack the residual rank 0 sends (the runner would drop it): the middle rank
    reports it, passes the failure on instead of its tensors, and the pool answers the next request as usual."""
    job = _edited_llama(r'\["hidden_states", "residual"\], config\.hidden_size', '["hidden_states"], config.hidden_size')
    partition = pp3_partition(6)
    ids = pp3_ids(6, partition)
    with pytest.raises(PipelineError) as failed:
        run_pipeline(pool, job, ids, 6, 3, partition)
    assert str(failed.value).startswith(f"PP=3 (partition {list(partition)}) rank 1: rank 0 sends residual, which its "
                                        "receive buffers do not hold"), failed.value
    assert "vLLM's runner would drop it" in str(failed.value)
    run = run_pipeline(pool, _job("llama", "LlamaForCausalLM", None), ids, 6, 3, partition)
    assert run.sends(1) == plan_layout(6, 3, ids, partition).stage(1).sends


@pytest.mark.timeout(240)
def test_a_killed_rank_fails_its_request_and_its_group_is_restarted() -> None:
    """A PP=2 worker killed between models: the next request names it as dead, the pair is restarted
    (forked again from the fork server), and the request after that runs on the new pair."""
    own = WorkerPool(sizes=(2,))
    try:
        job = _job("llama", "LlamaForCausalLM", None)
        assert run_pipeline(own, job, (0, 3, 4, 6), 6, 2).sends(0) == ("aux_hidden_states_0", "aux_hidden_states_1")
        killed, _ = own.workers["pp2-1"]
        killed.kill()
        killed.join(10)
        with pytest.raises(PipelineError, match=r"^PP=2 rank 0: pp2-1 worker died \(.*; restarted its group$"):
            run_pipeline(own, job, (0, 3, 4, 6), 6, 2)
        assert own.workers["pp2-1"][0].pid != killed.pid
        assert run_pipeline(own, job, (0, 3, 4, 6), 6, 2).sends(0) == ("aux_hidden_states_0", "aux_hidden_states_1")
    finally:
        own.close()


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
