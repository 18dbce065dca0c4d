"""The CLI's pure commands import no torch, transformers or libcst (issue 33: `pipespec --help` paid for torch).

Each command runs as the installed console script in a fresh process with ``PYTHONPROFILEIMPORTTIME=1``,
so its stderr lists every module the process imported; none of ``HEAVY`` may be among them. The control
case runs a command that must import torch (``generate --device cuda`` asks torch for a GPU) and shows
that the listing sees it — and that the refusal comes before the engine, so transformers stays unloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec.cli import COMMANDS

BIN = Path(sys.executable).parent / "pipespec"
HEAVY = ("torch", "transformers", "libcst")

PURE = {
    "help": ["--help"],
    "version": ["--version"],
    "layout": ["layout", "--num-layers", "32", "--pp", "4", "--aux-layers", "2,16,29"],
    "layout-json": ["layout", "--num-layers", "10", "--pp", "3", "--json"],
    "layout-refused": ["layout", "--num-layers", "8", "--pp", "2", "--aux-layers", "-1,5"],
    "specs": ["specs"],
    "specs-json": ["specs", "--json"],
    "verify-architecture": ["verify", "--architecture", "LlamaForCausalLM", "--num-layers", "80", "--pp", "4"],
    "verify-boundary-rule": ["verify", "--architecture", "KimiK3ForConditionalGeneration", "--num-layers", "8",
                             "--pp", "2", "--aux-layers", "2,4,7"],
    "verify-unsupported": ["verify", "--architecture", "MiMoForCausalLM", "--num-layers", "36", "--pp", "2"],
    **{f"{name}-help": [name, "--help"] for name in COMMANDS},
}
EXIT = {"layout-refused": 2, "verify-boundary-rule": 2, "verify-unsupported": 1}


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``pipespec ARGS`` in a fresh process; its result and the top-level packages it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    names = {line.split("|")[2].strip().split(".")[0] for line in proc.stderr.splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    names.discard("imported package")  # the listing's header line
    return proc, names


@pytest.mark.parametrize("case", sorted(PURE))
def test_pure_command_imports_no_torch_transformers_or_libcst(case: str) -> None:
    proc, names = imported_modules(*PURE[case])
    assert proc.returncode == EXIT.get(case, 0), proc.stderr[-2000:]
    assert "argparse" in names and "pipespec" in names  # the listing is there to be read
    assert sorted(names & set(HEAVY)) == [], f"`pipespec {' '.join(PURE[case])}` imported {sorted(names & set(HEAVY))}"


def test_generate_device_cuda_without_cuda_is_refused_before_the_engine_loads(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --device cuda is not refused here")
    proc, names = imported_modules("generate", "--target", str(tmp_path / "missing"), "--prompt-ids", "1,2",
                                   "--device", "cuda")
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2
    assert len(errors) == 1 and errors[0].startswith("pipespec: error: --device cuda: torch "), errors
    assert "use --device cpu" in errors[0]
    assert "torch" in names  # the control: the listing sees a heavy import when there is one
    assert "transformers" not in names  # refused before the job (tokenizer) or the engine is read
