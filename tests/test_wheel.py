"""The wheel is the product: built from this checkout, installed into a fresh venv, used from an empty
directory.

``python -m build`` writes the sdist and then the wheel from the unpacked sdist, so a file the sdist
lacks fails the wheel too (without build isolation: the venv holds the backend pyproject's
``[build-system]`` requires). The wheel goes into the venv after the CPU torch (``torch==2.13.0``, as the
README's install section says; the transformers release is this checkout's, so a new transformers
release does not fail the wheel) with the ``test`` extra, and the README's install commands run from an
empty directory with the venv's ``bin`` first on PATH and the Hugging Face hub offline: the wheel must
carry everything they read. One venv per run (in /dev/shm when it has room), removed at the end.
``-m wheel`` selects the tests that build it, ``-m "not wheel"`` skips them; the two checks of
pyproject.toml run either way.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from pipespec.contract.layout import eagle3_default_aux_ids

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
REQUIRED_ROW_KEYS = {"id", "value", "goal", "unit", "meets", "device", "command"}


def _package_roots() -> dict[str, Path]:
    """Dotted package name -> source directory, from ``[tool.setuptools] package-dir``."""
    return {name: ROOT / path for name, path in SETUPTOOLS["package-dir"].items()}


def _source_packages() -> set[str]:
    """Every directory holding Python modules under a mapped package root, as a dotted package name."""
    found: set[str] = set()
    for name, root in _package_roots().items():
        for module in root.rglob("*.py"):
            rel = module.parent.relative_to(root)
            if "__pycache__" not in rel.parts:
                found.add(".".join((name, *rel.parts)))
    return found


def test_every_package_directory_is_listed_for_the_wheel() -> None:
    """A subpackage added to the source but not to ``[tool.setuptools] packages`` would be missing from the
    wheel (and work in an editable install): every directory of modules must be listed, and nothing else."""
    listed = set(SETUPTOOLS["packages"])
    assert _source_packages() - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - _source_packages() == set(), "listed in pyproject.toml but no such source directory"


def test_license_is_an_spdx_expression_with_its_file() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


# ------------------------------------------------------------------------------------------- the venv
def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    said = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{shlex.join(cmd)} exited {proc.returncode}:\n{said}"
    return proc


@dataclass(frozen=True)
class Installed:
    venv: Path
    dist: Path
    work: Path  # an empty directory, the user's cwd
    env: dict[str, str]
    source_files: frozenset[str]  # what the wheel must carry, read from the tree just before the build

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def sdist(self) -> Path:
        (path,) = self.dist.glob("pipespec-*.tar.gz")
        return path

    def wheel(self) -> Path:
        (path,) = self.dist.glob("pipespec-*.whl")
        return path

    def run(self, argv: list[str], *, cwd: Path | None = None, timeout: float = 300,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` as the user types it; its program is the venv's (``pipespec``, ``adapter-gen``,
        ``python``)."""
        program = self.venv / "bin" / argv[0]
        assert program.is_file(), f"{argv[0]} is not installed in the venv"
        env = {**self.env, **(extra_env or {})}
        return _run([str(program), *argv[1:]], cwd=cwd or self.work, env=env, timeout=timeout)


def _user_env(venv: Path) -> dict[str, str]:
    """This process's environment without what points into the checkout or its venvs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIPESPEC_", "PYTHON", "VIRTUAL_ENV", "PYTEST_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # as the Makefile exports it: stage processes share the cores
    env["HF_HUB_OFFLINE"] = "1"  # everything a command reads must come with the wheel or the command line
    return env


def _files_for_the_wheel() -> frozenset[str]:
    """Every module and package-data file of the source, as its path in the wheel."""
    expected: set[str] = set()
    for name, root in _package_roots().items():
        sources = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
        patterns = SETUPTOOLS["package-data"].get(name, [])
        data = [p for pattern in patterns for p in root.glob(pattern) if p.is_file()]
        expected |= {f"{name.replace('.', '/')}/{p.relative_to(root).as_posix()}" for p in sources + data}
    return frozenset(expected)


def _scratch_dir() -> Path:
    """Where the venv goes: memory (/dev/shm) when it has room, else the default temporary directory. A
    venv is ~25k files; on the shared 2-core machine's disk, writing and deleting it took 34 s and 37 s,
    in memory 22 s and 0.4 s."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 * 2**30:
        return shm
    return Path(tempfile.gettempdir())


def _remove_abandoned(scratch: Path) -> None:
    """A run killed before its cleanup (``timeout``'s SIGTERM skips it) leaves its venv, in memory when it
    is in /dev/shm: remove the venvs whose run (the pid each one records) is gone; runs going on stay."""
    for old in scratch.glob("pipespec-wheel-*"):
        try:
            pid = int((old / "pid").read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, ValueError):  # no pid yet (a run starting), or a process of another user
            continue


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    scratch = _scratch_dir()
    _remove_abandoned(scratch)
    with tempfile.TemporaryDirectory(prefix="pipespec-wheel-", dir=scratch) as tmp:
        base = Path(tmp)
        (base / "pid").write_text(str(os.getpid()))
        venv, dist, work = base / "venv", base / "dist", base / "work"
        work.mkdir()
        _run([sys.executable, "-m", "venv", str(venv)], cwd=base, timeout=120)
        python = str(venv / "bin" / "python")
        # --no-compile: no .pyc written at install (imports compile what they use): the same files,
        # minutes less on 2 cores for torch and transformers, and fewer to delete.
        pip = [python, "-m", "pip", "install", "-q", "--no-compile"]
        # The build backend goes into the venv and the build runs without isolation: one install instead
        # of an isolated env for the sdist and another for the wheel; `build` still checks that the
        # backend satisfies pyproject's [build-system] requires.
        _run([*pip, "build", *PYPROJECT["build-system"]["requires"]], cwd=base, timeout=300)
        source_files = _files_for_the_wheel()  # the tree is shared: what it holds when the build starts
        _run([python, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)], cwd=base,
             timeout=600)
        _run([*pip, "torch==2.13.0"], cwd=base, timeout=600)
        (wheel,) = dist.glob("pipespec-*.whl")
        _run([*pip, f"transformers=={version('transformers')}", f"{wheel}[test]"], cwd=base, timeout=600)
        yield Installed(venv, dist, work, _user_env(venv), source_files)


# ------------------------------------------------------------------------------------------- the files
@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_sdist_carries_the_package_and_license_and_no_tests(installed: Installed) -> None:
    """The sdist carries no tests (they need the repository: bench/ scripts, fixtures, goldens, vLLM
    trees)."""
    with tarfile.open(installed.sdist()) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        pkg_info = sdist.extractfile(f"{installed.sdist().name.removesuffix('.tar.gz')}/PKG-INFO")
        assert pkg_info is not None
        metadata = pkg_info.read().decode()
    assert {"LICENSE", "README.md", "pyproject.toml", "sdk/pipespec/__init__.py"} <= names
    assert not [n for n in names if n == "tests" or n.startswith("tests/")]
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_wheel_carries_every_module_and_data_file_of_the_source(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel()) as wheel:
        names = set(wheel.namelist())
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert wheel.read(license_file) == (ROOT / "LICENSE").read_bytes()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode()
    expected = installed.source_files
    assert "pipespec/bench/p3_speedup.py" in expected and "pipespec/demo/target/config.json" in expected
    assert expected - names == set(), "in the source but not in the wheel"


# ------------------------------------------------------------------------------------------- the commands
def _readme_install_commands() -> list[str]:
    """The shell lines of the README's ``## Install`` section, comments stripped."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        lines += [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]
    return lines


def _checkout_cli(*args: str) -> str:
    """The same command through this checkout's pipespec (the installed one's oracle), in a fresh process: in
    this one the registry would also hold what earlier tests registered with ``@pipespec.adapter``."""
    proc = subprocess.run([sys.executable, "-m", "pipespec.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_readme_install_commands_run_from_an_empty_directory(installed: Installed) -> None:
    """Every ``pipespec``/``adapter-gen`` line of the README's install section, run as written from an empty
    directory; the checks below pin what each must say (``bench`` runs in its own test, with ``--json``)."""
    lines = _readme_install_commands()
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in lines
    assert "pip install pipespec" in lines
    commands = [shlex.split(line) for line in lines if line.split()[0] in ("pipespec", "adapter-gen")]
    assert ["pipespec", "demo"] in commands and ["pipespec", "bench", "all", "--quick"] in commands
    out: dict[str, str] = {}
    for argv in commands:
        if argv[:2] == ["pipespec", "bench"]:
            continue
        cwd = installed.work / f"cmd{len(out)}"
        cwd.mkdir()
        out[shlex.join(argv)] = installed.run(argv, cwd=cwd).stdout
        if argv[:2] != ["adapter-gen", "new"]:
            assert list(cwd.iterdir()) == [], f"{shlex.join(argv)} wrote into the working directory"
    for subcommand in ("layout", "verify", "specs", "generate", "demo", "bench", "adapter-gen"):
        assert subcommand in out["pipespec --help"]
    layout = next(argv for argv in commands if argv[:2] == ["pipespec", "layout"])
    as_json = json.loads(installed.run([*layout, "--json"]).stdout)
    assert as_json == json.loads(_checkout_cli(*layout[1:], "--json"))
    verify = next(argv for argv in commands if argv[:2] == ["pipespec", "verify"])
    assert out[shlex.join(verify)] == _checkout_cli(*verify[1:])
    assert out["pipespec specs"] == _checkout_cli("specs")
    assert "+++" in out["adapter-gen --hf llama"] and "aux_hidden_states" in out["adapter-gen --hf llama"]
    demo = out["pipespec demo"]
    assert "identical token for token" in demo and "mean acceptance length" in demo, demo


@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_adapter_gen_new_writes_a_test_that_passes_with_the_test_extra(installed: Installed) -> None:
    work = installed.work / "new"
    work.mkdir()
    said = installed.run(["adapter-gen", "new", "olmo2"], cwd=work).stdout
    assert "pip install 'pipespec[test]'" in said and "pytest -q tests/test_adapter_olmo2.py" in said
    assert (work / "adapters" / "olmo2.toml").is_file()
    proc = installed.run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_adapter_olmo2.py"], cwd=work, timeout=600)
    assert re.search(r"\b[1-9]\d* passed\b", proc.stdout) and "failed" not in proc.stdout, proc.stdout


_TINY_PAIR = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target
target = write_tiny_target(sys.argv[1] + "/target", "llama", num_layers=8, seed=3)
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
write_tiny_draft(sys.argv[1] + "/draft", model.config, seed=4)
ids = torch.tensor([[5, 17, 3, 60, 8]])
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                         pad_token_id=0)
print(json.dumps(out[0, ids.shape[1]:].tolist()))
"""


@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_generate_on_a_tiny_checkpoint_equals_transformers_greedy(installed: Installed) -> None:
    """``pipespec generate`` over 2 stages with a random EAGLE3 draft, against the target's own greedy
    ``generate``, both in the installed venv."""
    work = installed.work / "generate"
    work.mkdir()
    greedy = json.loads(installed.run(["python", "-c", _TINY_PAIR, str(work)], cwd=work).stdout)
    argv = ["pipespec", "generate", "--target", str(work / "target"), "--draft", str(work / "draft"),
            "--pp", "2", "--prompt-ids", "5,17,3,60,8", "--max-new-tokens", "12", "--num-spec-tokens", "3",
            "--json"]
    result = json.loads(installed.run(argv, cwd=work).stdout)
    assert result["output_ids"] == greedy and len(greedy) == 12
    assert result["aux_convention"] == "input" and result["aux_layers"] == list(eagle3_default_aux_ids(8))


@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_bench_all_quick_runs_every_cpu_benchmark_from_the_wheel(installed: Installed) -> None:
    """``pipespec bench all --quick`` needs nothing outside the package: every CPU-feasible benchmark of the
    installed ``pipespec.bench`` reports rows (tables on stderr, the JSON list on stdout)."""
    code = ("import importlib, json; from pipespec.cli.bench import BENCHES; "
            "print(json.dumps([n for n, m in BENCHES.items() if importlib.import_module(m).CPU_FEASIBLE]))")
    feasible = json.loads(installed.run(["python", "-c", code]).stdout)
    assert {"p3", "p4", "pipeline"} <= set(feasible)
    rows: list[dict[str, Any]] = json.loads(installed.run(["pipespec", "bench", "all", "--quick", "--json"],
                                                           timeout=900).stdout)
    for row in rows:
        assert REQUIRED_ROW_KEYS <= set(row) and row["command"] == "pipespec bench all --quick --json", row
    prefixes = {row["id"].split(".", 1)[0].lower() for row in rows}
    assert prefixes == set(feasible)
