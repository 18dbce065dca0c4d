"""pipespec's vLLM plugin at engine load: when it does nothing, and one clear error for each bad input.

Every case builds the run's config in vLLM's real front-end (plugin_scripts/engine_cases.py) with the
plugin installed from pyproject's entry point; the errors must come from the front-end, before vLLM
starts the engine core, so no weight is ever read. Cases that share an environment share a process.
The release gate runs when vLLM loads the plugin (``compat.load``): checked here on the installed vLLM
with its version string changed (its tree stays the real one); the gate's decisions on 0.33 / 0.34
sources and modified trees are tests/test_vllm_compat_sources.py.

EAGLE3 over PP = 2 follows what this build's runner does, asked of ``compat`` (no version check): where
the runner relays aux states (vLLM's V2 runner) the demo target written as Mixtral runs EAGLE3 through
``vllm.LLM`` at PP = 1 and PP = 2 (plugin_scripts/run_eagle3_pp.py), token-exact and with equal accepted
counts per draft position; where it does not (0.32's CPU build: the V1 runner) ``vllm.LLM(...,
pipeline_parallel_size=2)`` stops in the front-end with the plugin's line naming the runner (a case of the
shared front-end process, so it costs no engine start).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipespec.integrations.vllm import compat
from pipespec.integrations.vllm.compat import load
from pipespec.integrations.vllm.compat.gate import Gate
from pipespec.integrations.vllm.compat.releases import RELEASE_MODULES, TESTED_RELEASES
from pipespec.integrations.vllm.patches import PATCHES

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "plugin_scripts"
TARGET = ROOT / "sdk" / "pipespec" / "demo" / "target"
DRAFT = ROOT / "sdk" / "pipespec" / "demo" / "draft"
ENGINE_STARTED = "Initializing a V1 LLM engine"
PROMPTS = [[1, 5, 77, 300, 9], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS, K = 24, 3
#: Whether this build's default runner relays aux hidden states between PP ranks (vLLM's V2 runner).
RELAYS = compat.current().relays_aux_over_pp()

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


@pytest.fixture(scope="module")
def front_end(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], str]:
    """Every front-end case in one process (one vLLM import); the PP = 2 case only where it is refused."""
    mixtral, draft = str(models["mixtral"]), str(DRAFT)
    pp2 = [] if RELAYS else [{"name": "eagle3_pp2", "model": mixtral, "draft": draft, "pp": 2}]
    return _run_cases([
        {"name": "llama_supported", "model": str(TARGET), "draft": draft, "config_only": True},
        {"name": "no_eagle3_method", "model": mixtral, "config_only": True},
        {"name": "aux_ids_beyond_layers", "model": mixtral, "draft": str(models["bad_draft"])},
        {"name": "spec_names_missing_class", "model": mixtral, "draft": draft,
         "env": {"PIPESPEC_ADAPTERS_PATH": str(models["specs"])}},
        *pp2,
        # last: the adapted class stays registered in this process (later lookups get it, as vLLM's would)
        {"name": "mixtral_adapted", "model": mixtral, "draft": draft, "config_only": True},
    ], tmp_path_factory.mktemp("front-end"))


def test_engine_load_decisions_and_errors_before_the_engine_starts(front_end: tuple[dict[str, dict], str]) -> None:
    """No-op where nothing is needed, adapt where it is, and one line per bad input — all in the front-end."""
    results, log = front_end
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


@pytest.mark.timeout(900)
def test_eagle3_over_pp2_runs_token_exact_where_the_runner_relays_else_is_refused_up_front(
        front_end: tuple[dict[str, dict], str], models: dict[str, Path], tmp_path: Path) -> None:
    release = compat.current()
    if not RELAYS:
        results, log = front_end
        refused = results["eagle3_pp2"]
        assert (refused["ok"], refused["type"]) == (False, "UnsupportedModelError")
        runner = release.runner_for()
        assert refused["message"] == release.runner_refusal("eagle3", 2, runner)
        assert f"eagle3 over PP=2 cannot run on vLLM's {runner.value}" in refused["message"]
        assert ENGINE_STARTED not in log
        return
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PIPESPEC_VLLM", "PIPESPEC_ADAPTERS_PATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")]),
               PIPESPEC_VLLM_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(SCRIPTS / "run_eagle3_pp.py"), "--model", str(models["mixtral"]),
                           "--draft", str(DRAFT), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS),
                           "--k", str(K), "--out", str(out)], capture_output=True, text=True, timeout=840, env=env,
                          cwd=ROOT)
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


@pytest.fixture
def gate_reset(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The gate's per-process choice forgotten before and after (this process keeps its real one)."""
    saved = dict(compat._CHOSEN)
    compat._CHOSEN.clear()
    yield monkeypatch
    compat._CHOSEN.clear()
    compat._CHOSEN.update(saved)


def test_the_plugin_gate_on_the_installed_vllm(gate_reset: pytest.MonkeyPatch) -> None:
    """The installed release passes with its own rules; the same tree named older, or newer (its V1 runner is
    not what the newest rules assume), is refused in one line naming the way out."""
    import vllm

    from pipespec.errors import UsageError

    for version in (vllm.__version__, "0.32.3+cpu"):
        gate_reset.setattr(vllm, "__version__", version)
        compat._CHOSEN.clear()
        verdict = load()
        assert (verdict.gate, verdict.module) == (Gate.TESTED, RELEASE_MODULES[(0, 32)])
        assert type(compat.current()).__name__ == "Vllm032"
    messages = {}
    for version in ("0.31.2", "0.35.0"):
        gate_reset.setattr(vllm, "__version__", version)
        compat._CHOSEN.clear()
        with pytest.raises(UsageError) as refused:
            load()
        messages[version] = str(refused.value)
    assert "needs vLLM >= 0.32 (tested on 0.32–0.34), this is vLLM 0.31.2" in messages["0.31.2"]
    assert "cannot run on vLLM 0.35.0: its contract differs" in messages["0.35.0"]
    assert "runner fact v1_runner is True (the 0.34 rules assume False)" in messages["0.35.0"]
    for message in messages.values():
        assert "\n" not in message and message.endswith("PIPESPEC_VLLM=off to run vLLM without pipespec")


def test_a_newer_vllm_with_the_contract_intact_runs_with_one_warning_a_run(gate_reset: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """vLLM named 0.35.0 whose package is 0.34.0's source (the files the gate reads): the 0.34 rules, one
    warning line, and none again in a process that inherits this one's environment (vLLM's engine core and
    workers)."""
    import logging

    import vllm

    from pipespec.integrations.vllm.compat.gate import contract
    from pipespec.integrations.vllm.compat.probe import probed_files
    from pipespec.integrations.vllm.sources import source_tree

    source, tree = source_tree("0.34.0"), tmp_path / "vllm"
    for rel in probed_files(source, contract()):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, tree / rel)
    gate_reset.setattr(vllm, "__version__", "0.35.0")
    gate_reset.setattr(vllm, "__file__", str(tree / "__init__.py"))
    gate_reset.setenv(compat.WARNED, "")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("vllm.plugins.pipespec").addHandler(handler)
    try:
        verdict = load()
        assert (verdict.gate, verdict.module) == (Gate.NEWER, RELEASE_MODULES[(0, 34)])
        assert type(compat.current()).__name__ == "Vllm034"
        assert lines == [verdict.message] and "vLLM 0.35.0 is newer" in verdict.message
        assert os.environ[compat.WARNED] == "0.35.0"
        compat._CHOSEN.clear()  # a process started from this one: same environment, its own choice
        assert load().gate is Gate.NEWER and len(lines) == 1
    finally:
        logging.getLogger("vllm.plugins.pipespec").removeHandler(handler)


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
