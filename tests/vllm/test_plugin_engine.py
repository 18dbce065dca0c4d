"""pipespec's vLLM plugin end to end: real ``vllm.LLM`` runs of families vLLM 0.32 does not support for EAGLE3.

For each model (three in-tree families, the out-of-tree ``toy_lm``, and ``toy_inherited`` — a subclass of
vLLM's Qwen2 that inherits its aux-over-PP flag over a forward that captures nothing, which vLLM's own
check lets through; the demo target's weights under each architecture, see plugin_scripts/families.py)
one subprocess does every vLLM run (two engine starts for Mixtral and ``toy_lm``, one for the others) and
the test checks:

* the plugin adapted the class at engine load and said so in one line;
* greedy output with the EAGLE3 draft at PP=1 equals greedy output without it (plain PP=2 through the
  adapted class, for Mixtral and ``toy_lm``: so the adaptation keeps plain pipelines intact, and the
  plain run is the no-draft baseline) and pipespec's own engine's output for the same weights;
* vLLM's acceptance counts per draft position (``vllm:spec_decode_num_accepted_tokens_per_pos``) and
  draft count equal those of ``pipespec generate`` for the same target, draft and prompts — the
  independent check that vLLM's draft reads the right aux states — and are far from zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
PROMPTS = [[1, 5, 77, 300, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS, K = 24, 3
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "toy_lm": "ToyLMForCausalLM",
                 "toy_inherited": "OverridingQwen2ForCausalLM"}
OUT_OF_TREE = {"toy_lm", "toy_inherited"}  # modules in plugin_scripts/, registered by model_class_overrides
# The plain PP=2 run (vLLM's compiled path: it needs enforce_eager=False on this build, ~41 s of compiling
# in a ~145 s case on the 2-core CPU) for one in-tree MoE family and the out-of-tree model: GraniteMoe's and
# Qwen2-MoE's adapted classes take the codemod's PP=2 path that Mixtral's does, and toy_inherited's is toy_lm's.
PP2_RUNS = {"mixtral", "toy_lm"}

sys.path.insert(0, str(SCRIPTS))
from families import write_family, write_toy, write_transformers_layout  # noqa: E402


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]),
               PIPESPEC_VLLM_CACHE=str(tmp / "cache"), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.pop("PIPESPEC_VLLM", None)
    env.pop("PIPESPEC_ADAPTERS_PATH", None)
    return env


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (checkpoint vLLM loads, the same weights under transformers' names for pipespec)."""
    base = tmp_path_factory.mktemp("families")
    out: dict[str, tuple[Path, Path]] = {}
    for family in ("mixtral", "granitemoe", "qwen2_moe"):
        vllm_dir = write_family(family, TARGET, base / family)
        out[family] = (vllm_dir, write_transformers_layout(vllm_dir, base / f"{family}-hf"))
    toy = write_toy(TARGET, base / "toy_lm")
    out["toy_lm"] = (toy, toy)
    inherited = write_family("qwen2", TARGET, base / "toy_inherited", architecture=ARCHITECTURES["toy_inherited"])
    out["toy_inherited"] = (inherited, inherited)
    return out


def _pipespec_reference(checkpoint: Path, tmp: Path) -> dict:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    cmd = [sys.executable, "-m", "pipespec.cli", "generate", "--target", str(checkpoint), "--draft", str(DRAFT),
           "--pp", "1", "--prompts-file", str(prompts), "--max-new-tokens", str(MAX_TOKENS), "--num-spec-tokens",
           str(K), "--spec-policy", "always", "--ignore-eos", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _accepted_per_position(reference: dict) -> tuple[list[int], int]:
    """Per draft position, the rounds that accepted it; and the number of rounds that drafted."""
    counts, rounds = [0] * K, 0
    for output in reference["outputs"]:
        for length in output["acceptance_lengths"]:  # accepted drafts + the target's own token
            rounds += 1
            for position in range(length - 1):
                counts[position] += 1
    return counts, rounds


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_adapted_family_runs_eagle3_token_exact(family: str, checkpoints: dict, tmp_path: Path) -> None:
    """The plugin adapts the class at load; outputs and per-position acceptance match pipespec's engine."""
    vllm_dir, hf_dir = checkpoints[family]
    arch = ARCHITECTURES[family]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPTS / "run_family.py"), "--model", str(vllm_dir), "--draft", str(DRAFT),
           "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--k", str(K), "--out", str(out)]
    if family in OUT_OF_TREE:
        cmd += ["--override", f"{arch}={family}:{arch}"]
    if family not in PP2_RUNS:
        cmd += ["--skip-pp2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=_env(tmp_path), cwd=ROOT)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())

    assert f"pipespec: adapted {arch} for eagle3 at PP=1 (spec: inferred)" in log
    eagle3 = result["eagle3_pp1"]
    adapted_module = f"{family if family in OUT_OF_TREE else 'vllm.model_executor.models.' + family}__pipespec__{arch}"
    assert eagle3["overrides"] == {arch: f"{adapted_module}:{arch}"}

    reference = _pipespec_reference(hf_dir, tmp_path)
    expected = [o["output_ids"] for o in reference["outputs"]]
    assert all(len(o) == MAX_TOKENS for o in eagle3["outputs"])
    if family in PP2_RUNS:
        assert eagle3["outputs"] == result["plain_pp2"]["outputs"]  # with the draft == without it (and PP=2 == PP=1)
    assert eagle3["outputs"] == expected

    per_position, rounds = _accepted_per_position(reference)
    assert eagle3["accepted_per_pos"] == per_position
    assert eagle3["spec_decode_num_drafts"] == rounds
    assert per_position[0] >= rounds // 4, f"acceptance too low to tell right aux states from wrong: {per_position}"
