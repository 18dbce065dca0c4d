"""vLLM's Transformers modeling backend under pipespec: the adapted subclass, end to end and per stage.

Real vLLM (CPU build), real transformers models, real processes:

* end to end through ``vllm.LLM`` (plugin_scripts/run_tf_backend.py, one subprocess, one engine at a
  time): the demo pair with the draft's aux ids set to [0, 4, 5] (id 0 crashes vLLM's own backend at
  load: ``KeyError: -1``). EAGLE3 at PP=1 with ``model_impl="transformers"`` runs through pipespec's
  subclass, compiled (vLLM's default), and equals vLLM's native Llama class (eager) on the same weights and
  draft in tokens and in accepted tokens per draft position; plain PP=2 through the subclass equals PP=1
  token for token;
* per stage (plugin_scripts/tf_backend_stages.py: groups of gloo processes in vLLM's own process groups):
  llama, qwen2 and gemma2 (scaled embedding: id 0 is what enters layer 0) at PP = 1, 2, 3 with ids on
  every stage boundary and id 0. What each rank sends (after vLLM's own relay merge on the middle rank)
  and what its receive buffer reserves equal ``plan_layout``'s plan; every sent state and the last rank's
  concatenation equal the PP=1 reference residual stream;
* ``pipespec verify --engine vllm --model-impl transformers`` and its bad input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.cli import main
from pipespec.contract.layout import default_partition, plan_layout
from pipespec.integrations.vllm.reference_stream import ATOL

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
PROMPTS = [[1, 5, 77, 300, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS, K = 24, 3
DRAFT_IDS = [0, 4, 5]  # id 0: the embeddings, which vLLM's own backend cannot capture
STAGE_IDS = (0, 2, 3, 4, 6)  # tiny models have 6 layers: boundaries 3 (PP=2), 2 and 4 (PP=3), and N
BACKEND = "vllm.model_executor.models.transformers"
ADAPTED = "pipespec.integrations.vllm.transformers_backend:PipespecTransformersForCausalLM"


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]),
               PIPESPEC_VLLM_CACHE=str(tmp / "cache"), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    for key in ("PIPESPEC_VLLM", "PIPESPEC_ADAPTERS_PATH", "VLLM_USE_V2_MODEL_RUNNER"):
        env.pop(key, None)
    return env


def _draft_with_ids(tmp: Path, ids: list[int]) -> Path:
    """A copy of the demo draft whose config asks for ``ids`` (same weights)."""
    draft = tmp / "draft"
    draft.mkdir()
    for item in DRAFT.iterdir():
        if item.is_file():
            (draft / item.name).write_bytes(item.read_bytes())
    config = json.loads((draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = ids
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    return draft


@pytest.mark.timeout(900)
def test_backend_eagle3_with_id0_equals_native_llama_and_plain_pp2_equals_pp1(tmp_path: Path) -> None:
    """EAGLE3 with aux id 0 through model_impl="transformers" runs and matches vLLM's Llama; PP=2 == PP=1."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPTS / "run_tf_backend.py"), "--model", str(TARGET), "--draft",
           str(_draft_with_ids(tmp_path, DRAFT_IDS)), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS),
           "--k", str(K), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=_env(tmp_path), cwd=ROOT)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())

    assert "pipespec: adapted TransformersForCausalLM for eagle3 at PP=1 (spec: transformers backend)" in log
    native, backend = result["native_eagle3_pp1"], result["backend_eagle3_pp1"]
    assert native["overrides"] == {}  # vLLM's Llama supports EAGLE3 itself: left alone
    assert backend["overrides"] == {"TransformersForCausalLM": ADAPTED}
    assert all(len(o) == MAX_TOKENS for o in backend["outputs"])
    assert backend["outputs"] == native["outputs"]
    assert backend["spec_decode_num_drafts"] == native["spec_decode_num_drafts"] > 0
    assert backend["accepted_per_pos"] == native["accepted_per_pos"]
    assert len(backend["accepted_per_pos"]) == K
    assert result["backend_plain_pp2"]["outputs"] == backend["outputs"]


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the per-stage check over every family and PP size (one subprocess, spawned ranks)."""
    tmp = tmp_path_factory.mktemp("stages")
    out = tmp / "stages.json"
    cmd = [sys.executable, str(SCRIPTS / "tf_backend_stages.py"), "--families", "llama,qwen2,gemma2", "--pp", "2,3",
           "--ids", ",".join(map(str, STAGE_IDS)), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(tmp), cwd=ROOT)
    assert done.returncode == 0 and out.is_file(), (done.stdout + done.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["errors"] == []
    return report


@pytest.mark.timeout(700)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_each_rank_follows_the_plan_and_the_last_rank_equals_pp1(stages: dict, family: str) -> None:
    """PP=1, 2, 3: keys sent and reserved per plan_layout; every state equals the PP=1 residual stream."""
    entry = stages["families"][family]
    assert entry["class"].startswith(f"{BACKEND}:Transformers")
    # vLLM's own class on the same model: id 0 fails at load, and its first rank records nothing (its hooks
    # target the class of the ModuleList's last entry, a PPMissingLayer there) and fails at the first forward.
    # When a release fixes both, PATCHES' removal plan applies (drop the subclass for it).
    assert entry["vllm_own"] == "KeyError: -1"
    assert all(entry["stages"][str(pp)][0]["vllm_own_first_rank"] == "IndexError: tuple index out of range"
               for pp in (2, 3))
    assert len(entry["pp1"]) == len(STAGE_IDS) and max(entry["pp1"]) <= ATOL, entry["pp1"]
    n = entry["num_layers"]
    assert _boundaries(n, 2) | _boundaries(n, 3) | {0, n} <= set(STAGE_IDS)  # every boundary, id 0 and N
    for pp in (2, 3):
        plan = plan_layout(n, pp, STAGE_IDS, partition=default_partition(n, pp))
        ranks = entry["stages"][str(pp)]
        assert len(ranks) == pp and None not in ranks, ranks
        for stage, row in zip(plan.stages, ranks):
            assert row["receive_buffer"] == ["hidden_states", *stage.receives]
            if stage.is_last:
                assert row["num_aux"] == len(STAGE_IDS)
                assert max(row["aux_errors"]) <= ATOL, (pp, row["aux_errors"])
                continue
            sent = [k for k in row["sends"] if k != "hidden_states"]
            assert sorted(sent, key=lambda k: int(k.rsplit("_", 1)[1])) == list(stage.sends), (pp, stage.rank, sent)
            assert "hidden_states" in row["sends"]
            assert max(row["sent_errors"].values(), default=0.0) <= ATOL, (pp, stage.rank, row["sent_errors"])
        assert any(s.relays for s in plan.stages) == (pp == 3)  # PP=3's middle rank relays rank 0's states


def _boundaries(n: int, pp: int) -> set[int]:
    counts = default_partition(n, pp)
    return {sum(counts[: i + 1]) for i in range(pp - 1)}


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_the_backend_code_compat_mirrors_is_unchanged_in_later_releases(version: str) -> None:
    """compat's backend_model_call mirrors 0.32's Base.forward, and the subclass replaces Base's
    set_aux_hidden_state_layers and reads _layer_names as Base fills them: the same source in 0.33 and 0.34."""
    import ast
    import inspect

    from vllm.model_executor.models.transformers import base

    from pipespec.integrations.vllm.sources import source_tree

    def members(source: str) -> dict[str, str]:
        cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Base")
        return {n.name: ast.dump(n) for n in cls.body if isinstance(n, ast.FunctionDef)}

    installed = inspect.getsource(base)
    released = (source_tree(version) / "model_executor" / "models" / "transformers" / "base.py").read_text()
    for name in ("forward", "set_aux_hidden_state_layers"):
        assert members(released)[name] == members(installed)[name], name
    filled = "self._layer_names[int(child_name)] = layer_name"
    assert filled in installed and filled in released


# ------------------------------------------------------------------------------------------- verify
@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``pipespec verify ARGS`` in this process (vLLM imported once for the file)."""
    for key in ("PIPESPEC_VLLM", "PIPESPEC_ADAPTERS_PATH", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIPESPEC_VLLM_CACHE", str(tmp_path / "cache"))

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["verify", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.parametrize("architecture, backend_class", [
    ("LlamaForCausalLM", "TransformersForCausalLM"),
    ("MixtralForCausalLM", "TransformersMoEForCausalLM"),
    ("TransformersForCausalLM", "TransformersForCausalLM"),
])
def test_verify_answers_adapt_for_the_backend_class(cli, architecture: str, backend_class: str) -> None:
    """--model-impl transformers: the class vLLM's backend resolves to, adapted with pipespec's subclass."""
    code, out, err = cli("--engine", "vllm", "--model-impl", "transformers", "--architecture", architecture,
                         "--pp", "1", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["class"] == f"{BACKEND}:{backend_class}"
    assert (result["architecture"], result["decision"], result["spec"]) == (architecture, "adapt", "transformers backend")
    assert result["reason"].startswith(f"{backend_class} records eagle3 aux states at `_layer_names[id - 1]`")
    assert result["reason"].endswith(f"adapted as pipespec.integrations.vllm.transformers_backend:Pipespec{backend_class}")


def test_verify_treats_the_adapted_class_as_supported(cli) -> None:
    """What the plugin registers is pipespec's subclass: verify on it says supported, nothing to do."""
    code, out, err = cli("--engine", "vllm", "--class", ADAPTED, "--pp", "1", "--json")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["decision"] == "supported"


@pytest.mark.parametrize("args, words", [
    (("--engine", "transformers", "--model-impl", "transformers", "--architecture", "LlamaForCausalLM", "--pp", "1",
      "--num-layers", "8"), "--model-impl transformers is for --engine vllm"),
    (("--engine", "vllm", "--model-impl", "bogus", "--architecture", "LlamaForCausalLM", "--pp", "1"),
     "--model-impl 'bogus' is not one of vllm, transformers"),
    (("--engine", "vllm", "--model-impl", "transformers", "--architecture", "NoSuchModelForCausalLM", "--pp", "1"),
     "--architecture NoSuchModelForCausalLM: transformers"),
])
def test_verify_model_impl_bad_input_is_one_line(cli, args: tuple[str, ...], words: str) -> None:
    """A bad --model-impl, one without --engine vllm, or an architecture transformers lacks: one line, exit 2."""
    code, out, err = cli(*args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], err
