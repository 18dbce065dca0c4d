"""What a vLLM tree provides, read from its source with ``ast``: nothing is imported.

``probe_tree(tree, symbols)`` answers, for one ``vllm`` package directory (installed, or fetched with
``pipespec.integrations.vllm.sources.source_tree``): its version (``vllm/_version.py``), which of the
dotted ``symbols`` it defines, and the runner facts pipespec's rules depend on. The plugin gate
(``compat.gate``) compares that with what the chosen release module relies on.

A dotted symbol ``vllm.a.b.C.m`` is found when the longest module prefix is a file of the tree
(``a/b.py`` or ``a/b/__init__.py``) and the rest names, in that module, a top-level class, function,
assignment or imported name (``C``), then a member of that class's body (``m``: a method, a property, an
assignment or an annotated field). Definitions under a top-level ``if`` / ``try`` count (vLLM declares its
environment variables under ``if TYPE_CHECKING:``).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# The runner facts, each read from the tree: a file that exists, or a symbol it defines.
V1_RUNNER_FILES = ("v1/worker/gpu_model_runner.py", "v1/worker/cpu_model_runner.py")
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
V2_AUX_RELAY = "vllm.v1.worker.gpu.pp_utils.PPHandler.relay_aux_hidden_states"
RUNNER_SWITCH = "vllm.config.vllm.VllmConfig.use_v2_model_runner"
METHOD_CONFIG_AUX = "vllm.config.speculative.SpeculativeConfig.uses_aux_hidden_states"


@dataclass(frozen=True)
class RunnerFacts:
    """Which model runners a vLLM tree has, and how it says which speculative methods use aux states."""

    v1_runner: bool  # the V1 model runner's files (builds the drafter on the last rank, never relays aux states)
    v2_runner: bool  # the V2 model runner (``vllm/v1/worker/gpu/model_runner.py``)
    v2_relays_aux: bool  # the V2 runner's ``PPHandler.relay_aux_hidden_states``
    runner_switch: bool  # ``VllmConfig.use_v2_model_runner`` chooses between the two
    method_config_aux: bool  # ``SpeculativeConfig.uses_aux_hidden_states`` answers per method config


@dataclass(frozen=True)
class Probe:
    """One tree's answers: its version, the symbols asked for that it lacks, its runner facts."""

    tree: Path
    version: str | None  # None when the tree has no readable ``_version.py``
    missing: tuple[str, ...]
    runner: RunnerFacts


def module_file(tree: Path, module: str) -> Path | None:
    """The file of ``module`` (dotted, under ``vllm``) in ``tree``, or None."""
    parts = module.split(".")[1:]
    if not parts:
        candidate = tree / "__init__.py"
        return candidate if candidate.is_file() else None
    for candidate in (tree.joinpath(*parts).with_suffix(".py"), tree.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=64)
def _parsed(path: Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _module_ast(path: Path) -> ast.Module:
    return _parsed(path, path.stat().st_mtime_ns)


def _flat(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a body, looking into ``if`` / ``try`` blocks (not into functions or classes)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _flat(stmt.body)
            yield from _flat(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _flat(stmt.body)
            for handler in stmt.handlers:
                yield from _flat(handler.body)
            yield from _flat(stmt.orelse)
            yield from _flat(stmt.finalbody)
        else:
            yield stmt


def _bound(body: Iterable[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a body binds: classes, functions, (annotated) assignments, imports; the first binding wins."""
    out: dict[str, ast.stmt] = {}
    for stmt in _flat(body):
        names: list[str] = []
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names = [stmt.name]
        elif isinstance(stmt, ast.Assign):
            names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names = [stmt.target.id]
        elif isinstance(stmt, ast.Import | ast.ImportFrom):
            names = [(a.asname or a.name).split(".")[0] for a in stmt.names]
        for name in names:
            out.setdefault(name, stmt)
    return out


def defines(tree: Path, symbol: str) -> bool:
    """Whether the tree defines the dotted ``symbol`` (``vllm.module``, ``vllm.module.Name[.member]``)."""
    if module_file(tree, symbol) is not None:
        return True  # a module
    parts = symbol.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        path = module_file(tree, ".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if len(rest) > 2:
            return False
        top = _bound(_module_ast(path).body).get(rest[0])
        if top is None:
            return False
        if len(rest) == 1:
            return True
        return isinstance(top, ast.ClassDef) and rest[1] in _bound(top.body)
    return False


def tree_version(tree: Path) -> str | None:
    """``__version__`` as ``vllm/_version.py`` assigns it (``__version__ = version = '0.34.0'``), or None."""
    path = tree / "_version.py"
    if not path.is_file():
        return None
    for stmt in _flat(_module_ast(path).body):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            if any(isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets):
                return stmt.value.value
    return None


def runner_facts(tree: Path) -> RunnerFacts:
    """The runner facts of ``tree`` (see ``RunnerFacts``)."""
    return RunnerFacts(
        v1_runner=all((tree / f).is_file() for f in V1_RUNNER_FILES),
        v2_runner=defines(tree, V2_RUNNER),
        v2_relays_aux=defines(tree, V2_AUX_RELAY),
        runner_switch=defines(tree, RUNNER_SWITCH),
        method_config_aux=defines(tree, METHOD_CONFIG_AUX),
    )


def probed_files(tree: Path, symbols: Iterable[str]) -> list[Path]:
    """The files of ``tree`` that ``probe_tree(tree, symbols)`` reads (relative): the modules of the symbols
    and of the runner facts, the V1 runner's files and ``_version.py``. A copy of just these is, for the probe,
    the same tree (the tests build modified trees that way)."""
    wanted = [*symbols, V2_RUNNER, V2_AUX_RELAY, RUNNER_SWITCH, METHOD_CONFIG_AUX]
    files = {Path("_version.py"), *map(Path, V1_RUNNER_FILES)}
    for symbol in wanted:
        parts = symbol.split(".")
        found = next((f for cut in range(len(parts), 0, -1)
                      if (f := module_file(tree, ".".join(parts[:cut]))) is not None), None)
        if found is not None:
            files.add(found.relative_to(tree))
    return sorted(f for f in files if (tree / f).is_file())


def probe_tree(tree: Path, symbols: Iterable[str]) -> Probe:
    """Version, missing symbols (in the order asked) and runner facts of the ``vllm`` directory ``tree``."""
    tree = Path(tree)
    missing = tuple(dict.fromkeys(s for s in symbols if not defines(tree, s)))
    return Probe(tree, tree_version(tree), missing, runner_facts(tree))
