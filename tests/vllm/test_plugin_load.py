"""pipespec's vLLM plugin at engine load: when it does nothing, and one clear error for each bad input.

Every case builds the run's config in vLLM's real front-end (plugin_scripts/engine_cases.py) with the
plugin installed from pyproject's entry point; the errors must come from the front-end, before vLLM
starts the engine core, so no weight is ever read. Cases that share an environment share a process.
The release gate runs when vLLM loads the plugin (``compat.load``): checked here on the installed vLLM
with its version string changed in the process (its tree stays the real one); the gate's decisions on
0.33 / 0.34 sources and modified trees are tests/test_vllm_compat_sources.py. EAGLE3 over PP (the V1
runner's refusal, or the run itself) is tests/vllm/test_plugin_pp_eagle3.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.integrations.vllm.compat import TESTED_RELEASES, Gate, load
from pipespec.integrations.vllm.compat.releases import RELEASE_MODULES
from pipespec.integrations.vllm.patches import PATCHES

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


def test_switch_off_is_a_no_op_and_a_typo_is_one_error(models: dict[str, Path], tmp_path: Path) -> None:
    """PIPESPEC_VLLM=off leaves the run to vLLM; PIPESPEC_VLLM=bogus stops it when the plugin loads."""
    case = {"name": "mixtral", "model": str(models["mixtral"]), "draft": str(DRAFT), "config_only": True}
    off, log = _run_cases([case], tmp_path, PIPESPEC_VLLM="off")
    assert off["mixtral"] == {"name": "mixtral", "ok": True, "overrides": {}} and "pipespec: adapted" not in log

    bogus, _ = _run_cases([case], tmp_path, PIPESPEC_VLLM="bogus")
    assert bogus["mixtral"]["type"] == "UsageError"
    assert bogus["mixtral"]["message"] == "PIPESPEC_VLLM='bogus': use 1 (on) or 0 (off)"


GATE = """
import json, sys
import vllm
from pipespec.errors import UsageError
from pipespec.integrations.vllm import compat, plugin
for version in sys.argv[1:]:
    vllm.__version__ = version
    compat._CHOSEN.clear()
    try:
        plugin.register()
        print(json.dumps({"version": version, "ok": True, "module": compat.load().module}))
    except UsageError as exc:
        print(json.dumps({"version": version, "ok": False, "message": str(exc)}))
"""


def test_the_plugin_gates_the_installed_vllm_when_it_loads() -> None:
    """The installed release passes with its own rules; the same tree named older, or newer (its V1 runner is
    not what the newest rules assume), is refused in one line naming the way out."""
    assert load().gate is Gate.TESTED
    versions = ["0.32.0", "0.32.3+cpu", "0.31.2", "0.35.0"]
    env = {k: v for k, v in os.environ.items() if k != "PIPESPEC_VLLM"}
    done = subprocess.run([sys.executable, "-c", GATE, *versions], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    lines = {r["version"]: r for r in map(json.loads, [ln for ln in done.stdout.splitlines() if ln.startswith("{")])}
    assert done.returncode == 0 and len(lines) == len(versions), (done.stdout + done.stderr)[-3000:]
    for tested in versions[:2]:
        assert lines[tested] == {"version": tested, "ok": True, "module": RELEASE_MODULES[(0, 32)]}
    older, newer = lines["0.31.2"], lines["0.35.0"]
    assert not older["ok"] and "needs vLLM >= 0.32 (tested on 0.32–0.34), this is vLLM 0.31.2" in older["message"]
    assert not newer["ok"] and "cannot run on vLLM 0.35.0: its contract differs" in newer["message"]
    assert "runner fact v1_runner is True (the 0.34 rules assume False)" in newer["message"]
    for refused in (older, newer):
        assert "\n" not in refused["message"] and refused["message"].endswith("PIPESPEC_VLLM=off to run vLLM without pipespec")


def test_every_patch_names_why_how_and_its_removal() -> None:
    """The patch list is the plugin's contract with vLLM: each entry complete, each symbol real in this vLLM
    when it names this release (the other releases' sources: tests/test_vllm_compat_sources.py)."""
    import importlib

    import vllm

    here = next(r for r in TESTED_RELEASES if r.rsplit(".", 1)[0] == vllm.__version__.rsplit(".", 1)[0])
    checked = 0
    for patch in PATCHES:
        assert patch.tested and set(patch.tested) <= set(TESTED_RELEASES), patch.symbol
        assert patch.why and patch.how and patch.upstream and patch.removal and patch.where
        if here not in patch.tested:
            continue
        parts = patch.symbol.split(".")
        cut = 1
        while cut < len(parts):  # the longest importable module prefix
            try:
                importlib.import_module(".".join(parts[: cut + 1]))
            except ImportError:
                break
            cut += 1
        owner: object = importlib.import_module(".".join(parts[:cut]))
        for attr in parts[cut:]:
            if attr in getattr(owner, "__dataclass_fields__", {}) and not hasattr(owner, attr):
                break  # a dataclass field with a default factory (ModelConfig.model_class_overrides)
            assert hasattr(owner, attr), patch.symbol
            owner = getattr(owner, attr)
        checked += 1
    assert checked >= 10
