"""EAGLE3 over PP = 2 through ``vllm.LLM``, decided by what this vLLM build's runner does, not by its version.

``compat`` says whether the build's default runner relays aux hidden states between PP ranks (vLLM's V2
runner does; 0.32's CPU build runs the V1 runner, 0.34's x86 CPU build a V2 one):

* it relays → the demo target written as Mixtral (the plugin adapts it over PP = 2) runs EAGLE3 at PP = 1
  and at PP = 2 (plugin_scripts/run_eagle3_pp.py); the outputs must be token-exact and vLLM's accepted
  counts per draft position equal, with the draft accepting something;
* it does not → ``vllm.LLM(..., pipeline_parallel_size=2)`` with the draft stops in the front-end with the
  plugin's one line naming the runner, before the engine core starts (no weight read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.integrations.vllm import compat

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
PROMPTS = [[1, 5, 77, 300, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS, K = 24, 3
ENGINE_STARTED = "Initializing a V1 LLM engine"

sys.path.insert(0, str(SCRIPTS))
from families import write_family  # noqa: E402


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPESPEC_VLLM", "PIPESPEC_ADAPTERS_PATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]),
               PIPESPEC_VLLM_CACHE=str(tmp / "cache"))
    return env


@pytest.mark.timeout(900)
def test_eagle3_over_pp2_runs_token_exact_where_the_runner_relays_else_is_refused_up_front(tmp_path: Path) -> None:
    release = compat.current()
    model = write_family("mixtral", TARGET, tmp_path / "mixtral")
    if not release.relays_aux_over_pp():
        case = tmp_path / "cases.json"
        case.write_text(json.dumps([{"name": "pp2", "model": str(model), "draft": str(DRAFT), "pp": 2}]))
        done = subprocess.run([sys.executable, str(SCRIPTS / "engine_cases.py"), str(case)], capture_output=True,
                              text=True, timeout=400, env=_env(tmp_path), cwd=ROOT)
        log = done.stdout + done.stderr
        lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
        assert done.returncode == 0 and len(lines) == 1, log[-4000:]
        refused = lines[0]
        assert (refused["ok"], refused["type"]) == (False, "UnsupportedModelError")
        runner = release.runner_for()
        assert refused["message"] == release.runner_refusal("eagle3", 2, runner)
        assert f"eagle3 over PP=2 cannot run on vLLM's {runner.value}" in refused["message"]
        assert ENGINE_STARTED not in log and "Loading weights took" not in log
        return

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "run_eagle3_pp.py"), "--model", str(model), "--draft",
                           str(DRAFT), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--k", str(K),
                           "--out", str(out)], capture_output=True, text=True, timeout=840, env=_env(tmp_path), cwd=ROOT)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())
    pp1, pp2 = result["pp1"], result["pp2"]
    assert "pipespec: adapted MixtralForCausalLM for eagle3 over PP=2" in log
    assert pp2["overrides"] == pp1["overrides"] != {}
    assert all(len(o) == MAX_TOKENS for o in pp2["outputs"])
    assert pp2["outputs"] == pp1["outputs"]
    assert pp2["accepted_per_pos"] == pp1["accepted_per_pos"]
    assert pp2["spec_decode_num_drafts"] == pp1["spec_decode_num_drafts"]
    assert pp1["accepted_per_pos"][0] >= pp1["spec_decode_num_drafts"] // 4, pp1
