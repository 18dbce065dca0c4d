"""pipespec's vLLM release rules (``integrations/vllm/compat``) checked against each release's real source.

Nothing of vLLM is imported: the installed 0.32 (``.venv-vllm``'s package, or the fetched 0.32.0 wheel)
and the 0.33 / 0.34 wheels (``sources.source_tree``) are read with ``ast``. Checked: every contract symbol
and every symbol ``patches.PATCHES`` lists is defined in each release it names; each release module's
runner facts are its release's; every vLLM name a release module reads (imports, module attributes, the
config attributes it reads) exists in that release and is listed in ``PATCHES``; and the plugin gate's
decisions on the three trees and on modified copies (a symbol removed, the version bumped).
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from pipespec.integrations.vllm.compat import gate as gates
from pipespec.integrations.vllm.compat import probe
from pipespec.integrations.vllm.compat.gate import MODEL_CONTRACT, Gate, contract, decide_gate, release_class
from pipespec.integrations.vllm.compat.releases import RELEASE_MODULES, TESTED_RELEASES, Scope, minor_of
from pipespec.integrations.vllm.patches import PATCHES
from pipespec.integrations.vllm.sources import source_tree

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_032 = next(iter((ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm")), None)
#: Attributes the release modules read on vLLM objects they are handed (not imported), by the symbol they are.
READ_ON_OBJECTS = {
    "use_v2_model_runner": probe.RUNNER_SWITCH,
    "uses_aux_hidden_states": probe.METHOD_CONFIG_AUX,
    "custom_method": "vllm.config.speculative.SpeculativeConfig.custom_method",
    "is_unspecified": "vllm.platforms.interface.Platform.is_unspecified",
    "uses_standalone_cpu_model_runner": "vllm.platforms.interface.Platform.uses_standalone_cpu_model_runner",
}
#: Public names the release modules use that PATCHES need not list.
PUBLIC = {"vllm.platforms.current_platform"}


def tree(version: str) -> Path:
    if version == "0.32.0" and INSTALLED_032 is not None and (INSTALLED_032 / "model_executor").is_dir():
        return INSTALLED_032
    return source_tree(version)


@pytest.fixture(scope="module", params=TESTED_RELEASES)
def release(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, tree(request.param)


def vllm_reads(cls: type) -> set[str]:
    """Every vLLM symbol the methods ``cls`` resolves (its own and inherited) import or read, from their source."""
    found: set[str] = set()
    for name in dir(cls):
        func = inspect.getattr_static(cls, name)
        func = getattr(func, "__func__", func)
        if isinstance(func, property):
            func = func.fget
        if not inspect.isfunction(func) or not func.__module__.startswith("pipespec.integrations.vllm.compat"):
            continue
        node = ast.parse(textwrap.dedent(inspect.getsource(func)))
        bound: dict[str, str] = {}
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("vllm"):
                for alias in stmt.names:
                    bound[alias.asname or alias.name] = f"{stmt.module}.{alias.name}"
                    found.add(f"{stmt.module}.{alias.name}")
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.name.startswith("vllm"):
                        bound[alias.asname or alias.name] = alias.name
                        found.add(alias.name)
        for expr in ast.walk(node):
            if isinstance(expr, ast.Attribute):
                if expr.attr in READ_ON_OBJECTS:
                    found.add(READ_ON_OBJECTS[expr.attr])
                elif isinstance(expr.value, ast.Name) and expr.value.id in bound:
                    found.add(f"{bound[expr.value.id]}.{expr.attr}")
    return found


def test_each_release_has_the_contract_and_the_runner_facts_its_module_assumes(release: tuple[str, Path]) -> None:
    """The probe on the release's own source: its version, no contract symbol missing, its module's runner facts."""
    version, path = release
    minor = minor_of(version)
    assert minor is not None
    for scope in Scope:
        found = probe.probe_tree(path, contract(scope, minor))
        assert found.version == version and found.missing == ()
        assert found.runner == release_class(minor).RUNNERS


def test_every_patch_is_defined_in_each_release_it_was_tested_on(release: tuple[str, Path]) -> None:
    version, path = release
    listed = [p.symbol for p in PATCHES if version in p.tested]
    assert listed and [s for s in listed if not probe.defines(path, s)] == []


def test_every_vllm_name_a_release_module_reads_exists_there_and_is_listed(release: tuple[str, Path]) -> None:
    """Each release's rules read only what that release defines, and PATCHES lists each private read."""
    version, path = release
    minor = minor_of(version)
    assert minor is not None
    reads = vllm_reads(release_class(minor))
    assert reads, "the release module reads nothing of vLLM"
    assert sorted(s for s in reads if not probe.defines(path, s)) == []
    listed = {p.symbol for p in PATCHES if version in p.tested} | set(MODEL_CONTRACT) | PUBLIC
    modules = {s for s in reads if probe.module_file(path, s) is not None}
    assert sorted(reads - listed - modules) == []


def test_the_0_34_rules_read_nothing_of_the_v1_runner() -> None:
    """0.34 has no V1 runner, no use_v2_model_runner, no VLLM_USE_V2_MODEL_RUNNER: its rules touch none of them
    (so ``v2_runner_available`` cannot raise AttributeError there), while 0.32's do read the switch."""
    new, old = release_class((0, 34)), release_class((0, 32))
    gone = {probe.RUNNER_SWITCH, "vllm.envs.VLLM_USE_V2_MODEL_RUNNER",
            "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.requires_aux_hidden_states"}
    assert vllm_reads(new) & gone == set()
    assert probe.RUNNER_SWITCH in vllm_reads(old)
    t34 = tree("0.34.0")
    assert [s for s in gone if probe.defines(t34, s)] == []
    assert not any((t34 / f).exists() for f in probe.V1_RUNNER_FILES)


def test_tested_releases_pass_the_gate_with_their_own_module(release: tuple[str, Path]) -> None:
    version, path = release
    for text in (version, version.rsplit(".", 1)[0] + ".7", version + "+cpu"):
        verdict = decide_gate(text, path)
        assert (verdict.gate, verdict.module, verdict.message) == (Gate.TESTED, RELEASE_MODULES[minor_of(version)], "")


def test_an_older_release_is_refused_in_one_line() -> None:
    verdict = decide_gate("0.31.2", tree("0.32.0"))
    assert verdict.gate is Gate.REFUSED and verdict.module is None and "\n" not in verdict.message
    assert "needs vLLM >= 0.32 (tested on 0.32–0.34), this is vLLM 0.31.2" in verdict.message
    assert verdict.message.endswith("set PIPESPEC_VLLM=off to run vLLM without pipespec")


def _copy_probed_files(source: Path, into: Path) -> Path:
    """The files the probe reads, copied byte for byte (the rest of a tree is never opened)."""
    for rel in probe.probed_files(source, contract(Scope.ZOO)):
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, into / rel)
    return into


def _set_version(path: Path, version: str) -> None:
    file = path / "_version.py"
    file.write_text(re.sub(r"__version__ = version = '[^']*'", f"__version__ = version = '{version}'", file.read_text()))


def test_a_newer_release_with_the_contract_intact_runs_with_one_warning(tmp_path: Path) -> None:
    """0.34's source relabelled 0.35.0 (and a build without a version): the 0.34 rules, one warning line."""
    copy = _copy_probed_files(tree("0.34.0"), tmp_path / "vllm")
    _set_version(copy, "0.35.0")
    assert probe.tree_version(copy) == "0.35.0"
    for version in ("0.35.0", "1.0.0", "dev"):
        verdict = decide_gate(version, copy)
        assert (verdict.gate, verdict.module) == (Gate.NEWER, RELEASE_MODULES[(0, 34)])
        assert "\n" not in verdict.message and f"vLLM {version} is newer" in verdict.message
        assert "tested on (0.32–0.34)" in verdict.message and "runs with the 0.34 rules" in verdict.message


def test_a_newer_release_without_a_contract_symbol_is_refused_naming_it(tmp_path: Path) -> None:
    """EagleModelMixin.pack_local_aux_hidden_states renamed away in a copy of 0.34: refused, naming it."""
    copy = _copy_probed_files(tree("0.34.0"), tmp_path / "vllm")
    _set_version(copy, "0.35.0")
    interfaces = copy / "model_executor" / "models" / "interfaces.py"
    text = interfaces.read_text()
    assert text.count("def pack_local_aux_hidden_states(") == 1
    interfaces.write_text(text.replace("def pack_local_aux_hidden_states(", "def pack_local_aux_states("))
    verdict = decide_gate("0.35.0", copy)
    assert verdict.gate is Gate.REFUSED and verdict.module is None and "\n" not in verdict.message
    assert verdict.missing == ("vllm.model_executor.models.interfaces.EagleModelMixin.pack_local_aux_hidden_states",)
    assert "cannot run on vLLM 0.35.0: its contract differs" in verdict.message
    assert verdict.missing[0] in verdict.message and "PIPESPEC_VLLM=off" in verdict.message


def test_a_newer_release_whose_runners_differ_from_the_newest_rules_is_refused(tmp_path: Path) -> None:
    """0.33's source relabelled 0.35.0: every symbol is there, but it still has the V1 runner and its switch,
    which the 0.34 rules (the ones a newer release gets) assume gone."""
    copy = _copy_probed_files(tree("0.33.0"), tmp_path / "vllm")
    _set_version(copy, "0.35.0")
    verdict = gates.decide_gate("0.35.0", copy)
    assert verdict.gate is Gate.REFUSED
    assert "vllm.config.speculative.SpeculativeConfig.uses_aux_hidden_states" in verdict.missing
    assert "runner fact v1_runner is True (the 0.34 rules assume False)" in verdict.missing


def test_the_docs_table_names_every_patch() -> None:
    """docs/vllm.md "What it patches" names each ``PATCHES`` symbol in full (the register and its reference agree)."""
    text = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    section = text.split("## What it patches", 1)[1].split("\n## ", 1)[0]
    assert [p.symbol for p in PATCHES if f"`{p.symbol}`" not in section] == []
