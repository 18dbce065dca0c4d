"""Out-of-tree vLLM models: ``adapter-gen`` decides what the plugin decides, and the plugin runs them.

* a file that imports vLLM's layer (plugin_scripts/toy_lm.py: ``LlamaDecoderLayer`` built by
  ``make_layers``) and a package whose block class is in a sibling module (plugin_scripts/oot_pkg/:
  ``from oot_pkg.blocks import OotBlock``, a pre-norm block with a fused residual): ``adapter-gen FILE
  --dialect vllm`` writes the source the plugin builds at engine load, byte for byte but for the name it
  gives the source in the header (a project-relative path against the imported module's file);
* the package through ``vllm.LLM`` with the EAGLE3 demo draft at PP=1 (one subprocess,
  plugin_scripts/run_oot_eagle3.py, two engine starts): greedy outputs, draft count and vLLM's accepted
  counts per draft position equal those of vLLM's own Llama on the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.integrations.vllm.adapted_modules import build_adapted_source

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
ADAPTER_GEN = str(Path(sys.executable).parent / "adapter-gen")
PROMPTS = [[1, 5, 77, 300, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS, K = 24, 3
ARCHITECTURE = "OotPkgForCausalLM"


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]),
               PIPESPEC_VLLM_CACHE=str(tmp / "cache"), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.pop("PIPESPEC_VLLM", None)
    env.pop("PIPESPEC_ADAPTERS_PATH", None)
    return env


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("module", "cls", "path"), [
    ("toy_lm", "ToyLMForCausalLM", "toy_lm.py"),
    ("oot_pkg.model", ARCHITECTURE, "oot_pkg/model.py"),
])
def test_adapter_gen_writes_what_the_plugin_builds(module: str, cls: str, path: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One decision path: the CLI (run from another directory) and the plugin's build agree."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setenv("PIPESPEC_VLLM_CACHE", "")  # the codemod runs here, no cached entry is read
    built = build_adapted_source(f"{module}__pipespec__{cls}")
    assert (built.status, built.reason) == ("adapted", "")
    out = tmp_path / "adapted.py"
    proc = subprocess.run([ADAPTER_GEN, str(SCRIPTS / path), "--dialect", "vllm", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    label = (SCRIPTS / path).relative_to(ROOT).as_posix()
    assert Path(built.source_file).resolve() == (SCRIPTS / path).resolve()
    assert built.code.replace(built.source_file, label) == out.read_text()


@pytest.mark.timeout(900)
def test_package_with_a_sibling_block_runs_eagle3_like_vllms_llama(tmp_path: Path) -> None:
    """The plugin adapts oot_pkg at engine load; tokens and acceptance per position equal vLLM's Llama's."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPTS / "run_oot_eagle3.py"), "--target", str(TARGET), "--draft", str(DRAFT),
           "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--k", str(K), "--work", str(tmp_path),
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=_env(tmp_path), cwd=ROOT)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())
    llama, oot = result["llama"], result["oot_pkg"]

    assert f"pipespec: adapted {ARCHITECTURE} for eagle3 at PP=1 (spec: inferred)" in log
    assert oot["overrides"] == {ARCHITECTURE: f"oot_pkg.model__pipespec__{ARCHITECTURE}:{ARCHITECTURE}"}
    assert llama["overrides"] == {}
    assert all(len(o) == MAX_TOKENS for o in oot["outputs"])
    assert oot["outputs"] == llama["outputs"]
    assert oot["accepted_per_pos"] == llama["accepted_per_pos"]
    assert oot["spec_decode_num_drafts"] == llama["spec_decode_num_drafts"]
    per_position, drafts = oot["accepted_per_pos"], oot["spec_decode_num_drafts"]
    assert per_position[0] >= drafts // 4, f"acceptance too low to tell right aux states from wrong: {per_position}"
