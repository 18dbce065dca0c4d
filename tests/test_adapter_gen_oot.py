"""Out-of-tree vLLM model files through `adapter-gen --dialect vllm`: layer classes found where Python
finds them (a sibling module of the package, a release tree), `--residual-rule` where no source can say,
and a whole package directory at once.

Subprocess runs of the real console script on real files (the package tests/vllm/plugin_scripts/oot_pkg/
that the vLLM engine test runs through the plugin, and tests/fixtures/vllm_oot/). Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipespec.codemods.vllm_native_modules import ModuleSources, absolute_name, module_name_of

ROOT = Path(__file__).resolve().parents[1]
ADAPTER_GEN = str(Path(sys.executable).parent / "adapter-gen")
OOT_PKG = ROOT / "tests" / "vllm" / "plugin_scripts" / "oot_pkg"
INJECTED = ROOT / "tests" / "fixtures" / "vllm_oot" / "injected_layers.py"
CAPTURE_WITH_RESIDUAL = "aux_hidden_states, i + 1, hidden_states, residual"
CAPTURE_WITHOUT = "aux_hidden_states, i + 1, hidden_states, None"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ADAPTER_GEN, *args], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_line_usage_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def flat(text: str) -> str:
    """The adapted source with line breaks inside calls joined (the formatter may wrap a long capture)."""
    return " ".join(text.split())


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    """A copy of the package, under a directory that is no package itself."""
    out = tmp_path / "src" / "oot_pkg"
    shutil.copytree(OOT_PKG, out, ignore=shutil.ignore_patterns("__pycache__"))
    return out


# ------------------------------------------------------------------------ layer classes found
def test_block_class_in_a_sibling_module_is_read_there(pkg: Path) -> None:
    """`from oot_pkg.blocks import OotBlock`: the block's own forward (pre-norm, fused residual) says the
    stream is hidden_states + residual, from any working directory."""
    proc = run(str(pkg / "model.py"), "--dialect", "vllm", cwd=pkg.parents[1])
    assert proc.returncode == 0, proc.stderr
    assert CAPTURE_WITH_RESIDUAL in flat(proc.stdout)


def test_block_class_that_cannot_be_found_declines(pkg: Path) -> None:
    """Without the sibling module nothing says what the layers do: declined, naming the way out."""
    (pkg / "blocks.py").unlink()
    proc = run(str(pkg / "model.py"), "--dialect", "vllm")
    assert proc.returncode == 1
    assert "the layer classes of self.layers cannot be found from the source" in proc.stderr
    assert "--residual-rule reads" in proc.stderr and "model.residual_rule" in proc.stderr


def test_relative_import_of_the_block_resolves_in_the_package(pkg: Path) -> None:
    """`from .blocks import OotBlock` reads the same file as the absolute import."""
    model = pkg / "model.py"
    model.write_text(model.read_text().replace("from oot_pkg.blocks import OotBlock", "from .blocks import OotBlock"))
    proc = run(str(model), "--dialect", "vllm")
    assert proc.returncode == 0, proc.stderr
    assert CAPTURE_WITH_RESIDUAL in flat(proc.stdout)


def test_a_stated_rule_the_source_contradicts_is_declined(pkg: Path) -> None:
    """The block reads its residual: `--residual-rule rebinds` is refused, never obeyed."""
    proc = run(str(pkg / "model.py"), "--dialect", "vllm", "--residual-rule", "rebinds")
    assert proc.returncode == 1
    assert "residual rule 'rebinds' was stated, but the source says otherwise: its layer classes read it" in proc.stderr


# ------------------------------------------------------------------------ --residual-rule
def test_injected_layers_decline_naming_the_flag() -> None:
    proc = run(str(INJECTED), "--dialect", "vllm")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "InjectedModel declined" in proc.stderr and "built by `make_layers(" in proc.stderr
    assert "--residual-rule reads" in proc.stderr and "`--residual-rule rebinds`" in proc.stderr


@pytest.mark.parametrize(("rule", "capture"), [("reads", CAPTURE_WITH_RESIDUAL), ("rebinds", CAPTURE_WITHOUT)])
def test_injected_layers_adapt_with_the_stated_rule(rule: str, capture: str, tmp_path: Path) -> None:
    out = tmp_path / "adapted.py"
    proc = run(str(INJECTED), "--dialect", "vllm", "--residual-rule", rule, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert capture in flat(text) and "supports_aux_hidden_states_over_pp = True" in text
    assert run(str(INJECTED), "--dialect", "vllm", "--residual-rule", rule, "--out", str(out), "--check").returncode == 0


def test_the_rule_in_a_vllm_spec_adapts_like_the_flag(tmp_path: Path) -> None:
    spec = tmp_path / "injected.toml"
    spec.write_text(textwrap.dedent("""\
        [adapter]
        name = "injected"
        decoder_class = "injected_layers:InjectedModel"
        dialect = "vllm"
        [model]
        residual = true
        residual_rule = "rebinds"
    """))
    by_spec = run(str(INJECTED), "--dialect", "vllm", "--spec", str(spec))
    by_flag = run(str(INJECTED), "--dialect", "vllm", "--residual-rule", "rebinds")
    assert by_spec.returncode == 0, by_spec.stderr
    assert CAPTURE_WITHOUT in flat(by_spec.stdout)
    assert [ln for ln in by_spec.stdout.splitlines() if "adapter-gen" not in ln] == \
        [ln for ln in by_flag.stdout.splitlines() if "adapter-gen" not in ln]
    clash = run(str(INJECTED), "--dialect", "vllm", "--spec", str(spec), "--residual-rule", "reads")
    one_line_usage_error(clash, "--residual-rule reads contradicts spec injected", "residual_rule = 'rebinds'")


# ------------------------------------------------------------------------ bad input
def test_residual_rule_with_another_dialect_is_a_usage_error(tmp_path: Path) -> None:
    out = tmp_path / "out.py"
    proc = run(str(INJECTED), "--dialect", "pipespec", "--class", "InjectedModel", "--residual-rule", "reads",
               "--out", str(out))
    one_line_usage_error(proc, "--residual-rule reads", "vllm dialect only", "pipespec")
    assert not out.exists()


def test_residual_rule_value_other_than_the_two_is_a_usage_error(tmp_path: Path) -> None:
    out = tmp_path / "out.py"
    proc = run(str(INJECTED), "--dialect", "vllm", "--residual-rule", "maybe", "--out", str(out))
    one_line_usage_error(proc, "--residual-rule", "'maybe'", "reads", "rebinds")
    assert not out.exists()


@pytest.mark.parametrize(("dialect", "value", "fragments"), [
    ("hf", "reads", ("model.residual_rule = 'reads' applies to vLLM model files only", "hf-dialect spec")),
    ("vllm", "sometimes", ("model.residual_rule = 'sometimes' is invalid", "reads, rebinds")),
])
def test_bad_residual_rule_in_a_spec_is_a_usage_error(dialect: str, value: str, fragments: tuple[str, ...],
                                                      tmp_path: Path) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(f'[adapter]\nname = "bad"\ndecoder_class = "m:InjectedModel"\ndialect = "{dialect}"\n'
                    f'[model]\nresidual = true\nresidual_rule = "{value}"\n')
    out = tmp_path / "out.py"
    proc = run(str(INJECTED), "--dialect", "vllm", "--spec", str(spec), "--out", str(out))
    one_line_usage_error(proc, str(spec), *fragments)
    assert not out.exists()


# ------------------------------------------------------------------------ a package directory
def test_directory_out_writes_an_importable_copy_and_check_agrees(pkg: Path, tmp_path: Path) -> None:
    """--out DIR2: every *.py of DIR at its relative path, only the decoder's file changed; --check on the
    copy passes, on the original fails; --diff (the default) shows that one file and writes nothing."""
    before = {p.name: p.read_text() for p in pkg.glob("*.py")}
    out = tmp_path / "adapted_pkg"
    proc = run(str(pkg), "--dialect", "vllm", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    after = {p.name: p.read_text() for p in out.glob("*.py")}
    assert set(after) == set(before) == {"__init__.py", "blocks.py", "model.py"}
    assert [n for n in sorted(after) if after[n] != before[n]] == ["model.py"]
    assert CAPTURE_WITH_RESIDUAL in flat(after["model.py"])
    assert {p.name: p.read_text() for p in pkg.glob("*.py")} == before
    assert run(str(pkg), "--dialect", "vllm", "--out", str(out), "--check").returncode == 0
    stale = run(str(pkg), "--dialect", "vllm", "--check")
    assert stale.returncode == 1 and "--in-place" in stale.stderr
    diff = run(str(pkg))  # a directory is the vllm dialect without saying so
    assert diff.returncode == 0
    changed = [ln for ln in diff.stdout.splitlines() if ln.startswith("+++ ")]
    assert len(changed) == 1 and changed[0].endswith("/model.py")
    assert {p.name: p.read_text() for p in pkg.glob("*.py")} == before


def test_directory_in_place_then_check_is_up_to_date(pkg: Path) -> None:
    proc = run(str(pkg), "--dialect", "vllm", "--in-place")
    assert proc.returncode == 0, proc.stderr
    assert CAPTURE_WITH_RESIDUAL in flat((pkg / "model.py").read_text())
    assert run(str(pkg), "--dialect", "vllm", "--check").returncode == 0
    again = run(str(pkg), "--dialect", "vllm", "--in-place")
    assert again.returncode == 0 and "0 adapted" in again.stderr


def test_directory_with_an_undecidable_file_exits_1_and_says_why(pkg: Path) -> None:
    shutil.copy(INJECTED, pkg / "injected_layers.py")
    proc = run(str(pkg), "--dialect", "vllm")
    assert proc.returncode == 1
    assert "skipped" in proc.stderr and "injected_layers.py" in proc.stderr and "--residual-rule" in proc.stderr
    assert "model.py" in proc.stdout  # the other file is still adapted
    assert run(str(pkg), "--dialect", "vllm", "--residual-rule", "reads").returncode == 0


@pytest.mark.parametrize(("extra", "fragments"), [
    (("--class", "OotPkgModel"), ("--class cannot be combined with a directory",)),
    (("--dialect", "hf"), ("--dialect hf with a directory",)),
    (("--in-place", "--diff"), ("choose one mode",)),
])
def test_directory_bad_flags_are_usage_errors(pkg: Path, extra: tuple[str, ...], fragments: tuple[str, ...]) -> None:
    before = (pkg / "model.py").read_text()
    one_line_usage_error(run(str(pkg), *extra), *fragments)
    assert (pkg / "model.py").read_text() == before


def test_directory_out_inside_itself_is_a_usage_error(pkg: Path) -> None:
    one_line_usage_error(run(str(pkg), "--dialect", "vllm", "--out", str(pkg / "copy")), "inside it")
    assert not (pkg / "copy").exists()


# ------------------------------------------------------------------------ the resolution rule itself
def test_module_names_and_relative_imports_resolve_as_python_does(pkg: Path) -> None:
    assert module_name_of(pkg / "model.py") == ("oot_pkg.model", pkg.parent)
    assert module_name_of(INJECTED) == ("injected_layers", INJECTED.parent)
    assert absolute_name("..layers.mlp", "vllm.model_executor.models") == "vllm.model_executor.layers.mlp"
    assert absolute_name(".blocks", "oot_pkg") == "oot_pkg.blocks"
    assert absolute_name("...x", "a") is None
    sources = ModuleSources(pkg / "model.py")
    assert sources.locate("oot_pkg.blocks") == (pkg / "blocks.py").resolve()
    assert sources.locate(".blocks") == (pkg / "blocks.py").resolve()
    assert sources.locate("oot_pkg") == (pkg / "__init__.py").resolve()
    assert sources.locate("not_a_module_here.blocks") is None


def test_vllm_imports_of_a_file_in_a_release_tree_stay_in_that_tree(tmp_path: Path) -> None:
    """A released tree being surveyed resolves `vllm.*` (and relative imports) inside itself, never in an
    installed vLLM."""
    models = tmp_path / "release" / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    for d in (models.parents[1], models.parent, models):
        (d / "__init__.py").write_text("")
    (models / "a.py").write_text("from .b import Layer\n")
    (models / "b.py").write_text("class Layer: ...\n")
    sources = ModuleSources(models / "a.py")
    assert sources.module_name == "vllm.model_executor.models.a"
    assert sources.locate("vllm.model_executor.models.b") == (models / "b.py").resolve()
    assert sources.locate(".b") == (models / "b.py").resolve()
    assert sources("vllm.model_executor.models.b") == "class Layer: ...\n"
