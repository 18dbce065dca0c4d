"""pipespec's vLLM plugin at engine load: when it does nothing, and one clear error for each bad input.

Every case builds the run's config in vLLM's real front-end (plugin_scripts/engine_cases.py) with the
plugin installed from pyproject's entry point; the errors must come from the front-end, before vLLM
starts the engine core, so no weight is ever read. Cases that share an environment share a process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.errors import UsageError
from pipespec.integrations.vllm.patches import PATCHES, TESTED_VERSIONS, check_vllm_version

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
ENGINE_STARTED = "Initializing a V1 LLM engine"

sys.path.insert(0, str(SCRIPTS))
from families import write_family  # noqa: E402


def _run_cases(cases: list[dict], tmp: Path, **env: str) -> tuple[dict[str, dict], str]:
    path = tmp / f"cases-{len(list(tmp.glob('cases-*')))}.json"
    path.write_text(json.dumps(cases))
    full = dict(os.environ)
    for key in ("PIPESPEC_VLLM", "PIPESPEC_ADAPTERS_PATH"):
        full.pop(key, None)
    full.update(OMP_NUM_THREADS="1", PIPESPEC_VLLM_CACHE=str(tmp / "cache"), **env)
    done = subprocess.run([sys.executable, str(SCRIPTS / "engine_cases.py"), str(path)], capture_output=True,
                          text=True, timeout=400, env=full, cwd=ROOT)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(lines) == len(cases), (done.stdout + done.stderr)[-4000:]
    return {line["name"]: line for line in lines}, done.stdout + done.stderr


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("load")
    bad_draft = base / "draft-beyond"
    shutil.copytree(DRAFT, bad_draft)
    config = json.loads((bad_draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 12]  # the target has 8 layers
    (bad_draft / "config.json").write_text(json.dumps(config))
    spec_dir = base / "specs"
    spec_dir.mkdir()
    (spec_dir / "mixtral_vllm.toml").write_text(
        '[adapter]\nname = "mixtral_vllm"\narchitectures = ["MixtralForCausalLM"]\n'
        'decoder_class = "vllm.model_executor.models.mixtral:MixtralDecoderStack"\ndialect = "vllm"\n'
    )
    return {"mixtral": write_family("mixtral", TARGET, base / "mixtral"), "bad_draft": bad_draft, "specs": spec_dir}


def test_engine_load_decisions_and_errors_before_the_engine_starts(models: dict[str, Path], tmp_path: Path) -> None:
    """No-op where nothing is needed, adapt where it is, and one line per bad input — all in the front-end."""
    mixtral, draft = str(models["mixtral"]), str(DRAFT)
    results, log = _run_cases([
        {"name": "llama_supported", "model": str(TARGET), "draft": draft, "config_only": True},
        {"name": "no_eagle3_method", "model": mixtral, "config_only": True},
        {"name": "aux_ids_beyond_layers", "model": mixtral, "draft": str(models["bad_draft"])},
        {"name": "spec_names_missing_class", "model": mixtral, "draft": draft,
         "env": {"PIPESPEC_ADAPTERS_PATH": str(models["specs"])}},
        {"name": "eagle3_over_pp_on_v1_runner", "model": mixtral, "draft": draft, "pp": 2},
        # last: the adapted class stays registered in this process (later lookups get it, as vLLM's would)
        {"name": "mixtral_adapted", "model": mixtral, "draft": draft, "config_only": True},
    ], tmp_path)
    assert ENGINE_STARTED not in log and "Loading weights took" not in log

    assert results["llama_supported"] == {"name": "llama_supported", "ok": True, "overrides": {}}
    assert results["no_eagle3_method"]["overrides"] == {}
    assert results["mixtral_adapted"]["overrides"] == {
        "MixtralForCausalLM": "vllm.model_executor.models.mixtral__pipespec__MixtralForCausalLM:MixtralForCausalLM"}
    assert log.count("pipespec: adapted") == 1  # the supported and the plain run log nothing

    beyond = results["aux_ids_beyond_layers"]
    assert (beyond["ok"], beyond["type"]) == (False, "UsageError")
    assert "[2, 4, 12] include [12]" in beyond["message"] and "ids 0..8 for 8 decoder layers" in beyond["message"]

    missing = results["spec_names_missing_class"]
    assert (missing["ok"], missing["type"]) == (False, "UnsupportedModelError")
    assert missing["message"].startswith("MixtralForCausalLM does not support eagle3: ")
    assert "mixtral_vllm.toml: adapter.decoder_class = 'vllm.model_executor.models.mixtral:MixtralDecoderStack'" in missing["message"]

    runner = results["eagle3_over_pp_on_v1_runner"]
    assert (runner["ok"], runner["type"]) == (False, "UnsupportedModelError")
    assert "eagle3 over PP=2 cannot run on vLLM's V1 model runner" in runner["message"]


def test_switch_off_is_a_no_op_and_a_typo_is_one_error(models: dict[str, Path], tmp_path: Path) -> None:
    """PIPESPEC_VLLM=off leaves the run to vLLM; PIPESPEC_VLLM=bogus stops it when the plugin loads."""
    case = {"name": "mixtral", "model": str(models["mixtral"]), "draft": str(DRAFT), "config_only": True}
    off, log = _run_cases([case], tmp_path, PIPESPEC_VLLM="off")
    assert off["mixtral"] == {"name": "mixtral", "ok": True, "overrides": {}} and "pipespec: adapted" not in log

    bogus, _ = _run_cases([case], tmp_path, PIPESPEC_VLLM="bogus")
    assert bogus["mixtral"]["type"] == "UsageError"
    assert bogus["mixtral"]["message"] == "PIPESPEC_VLLM='bogus': use 1 (on) or 0 (off)"


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "nightly"])
def test_untested_vllm_version_is_refused_in_one_line(version: str) -> None:
    """A vLLM outside the tested range stops the plugin, naming the range and the way out."""
    with pytest.raises(UsageError, match=rf"tested on vLLM 0\.32\.0 \(>=0\.32\.0,<0\.33\), this is vLLM {version}: .*PIPESPEC_VLLM=off"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", [*TESTED_VERSIONS, "0.32.1", "0.32.0+cpu"])
def test_tested_vllm_versions_pass(version: str) -> None:
    check_vllm_version(version)


def test_every_patch_names_why_how_and_its_removal() -> None:
    """The patch list is the plugin's contract with vLLM: each entry complete, each symbol real."""
    import importlib

    for patch in PATCHES:
        assert patch.tested == TESTED_VERSIONS and patch.why and patch.how and patch.upstream and patch.removal
        module, _, attr = patch.symbol.rpartition(".")
        try:
            owner: object = importlib.import_module(module)
        except ImportError:
            owner_module, _, owner_name = module.rpartition(".")
            owner = getattr(importlib.import_module(owner_module), owner_name)
        assert hasattr(owner, attr), patch.symbol
