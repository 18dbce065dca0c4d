"""No project module imports a name through a module that only re-exports it (issue 34).

A *re-export module* offers names it does not define: every name in its ``__all__`` is bound by an import
or served lazily by a module ``__getattr__`` (without ``__all__``: its body is a docstring and imports). Package
``__init__``s that document an API for users keep such re-exports (``REEXPORTS_KEPT``, each with its
reason); pipespec's own modules under sdk/, codemods/, bench/, templates/ and adapters/ import each name from
the module that defines it, so a reader following an import lands on the definition. Read with ``ast``
only: nothing is imported; parsing every file is the cost (about 2 s on the shared cores).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Source directory → the dotted package it installs as (pyproject's ``package-dir``; bench/ is the repo's own).
PACKAGE_DIRS = {
    "sdk/pipespec": "pipespec",
    "codemods": "pipespec.codemods",
    "templates": "pipespec.templates",
    "adapters": "pipespec.adapters",
    "bench": "bench",
}

#: Re-export modules that stay, and why. Internal code still imports from the defining modules.
REEXPORTS_KEPT = {
    "pipespec": "the package's public API (`pipespec.adapt`, `@pipespec.adapter`, ...), served lazily so "
    "`import pipespec` stays free of torch; README and docs/ use it",
    "pipespec.engine.draft": "its docstring documents the draft model's API for users "
    "(`from pipespec.engine.draft import Eagle3Draft, Eagle3DraftConfig, DraftKVCache`)",
    "pipespec.engine.draft_checkpoint": "the checkpoint half of that documented API "
    "(`from pipespec.engine.draft_checkpoint import inspect_draft_checkpoint, load_draft_checkpoint, TargetInfo`)",
}


@dataclass(frozen=True)
class Module:
    """One project source file: its dotted name, whether it is a package ``__init__``, its parsed tree."""

    name: str
    path: Path
    is_package: bool
    tree: ast.Module


def project_modules(root: Path) -> dict[str, Module]:
    """Every ``.py`` file under the package directories, by the dotted name it is imported as."""
    modules: dict[str, Module] = {}
    for directory, package in PACKAGE_DIRS.items():
        for path in sorted((root / directory).rglob("*.py")):
            parts = list(path.relative_to(root / directory).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            modules[name] = Module(name, path, is_package, ast.parse(path.read_text(), filename=str(path)))
    return modules


def _type_checking_block(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _top_level_statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """The module's statements, ``if TYPE_CHECKING:`` blocks opened (what they bind is what the module offers)."""
    for node in tree.body:
        if _type_checking_block(node):
            assert isinstance(node, ast.If)
            yield from node.body
        else:
            yield node


def defined_names(tree: ast.Module) -> set[str]:
    """Names the module itself defines at top level: functions, classes and assignment targets."""
    names: set[str] = set()
    for node in _top_level_statements(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def imported_names(tree: ast.Module) -> set[str]:
    """Names the module binds at top level by an import (``import a.b`` binds ``a``)."""
    names: set[str] = set()
    for node in _top_level_statements(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def declared_all(tree: ast.Module) -> list[str] | None:
    """The module's literal ``__all__``, or None when it has none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [str(name) for name in value]
    return None


def _only_imports(tree: ast.Module) -> bool:
    """The body is a docstring and imports, nothing else."""
    for index, node in enumerate(tree.body):
        docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if not (docstring or isinstance(node, (ast.Import, ast.ImportFrom))):
            return False
    return bool(imported_names(tree))


def is_reexport(module: Module) -> bool:
    """True when the module offers names it does not define.

    With ``__all__``: none of its names is defined in the module (they are imported, or served by a module
    ``__getattr__``). Without: the body is only a docstring and imports.
    """
    declared = declared_all(module.tree)
    if declared is None:
        return _only_imports(module.tree)
    return bool(declared) and not set(declared) & defined_names(module.tree)


def _resolve_relative(importer: Module, level: int, module: str | None) -> str:
    package = importer.name.split(".") if importer.is_package else importer.name.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def reexport_modules(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Each re-export module's name, with the names it defines itself (``pipespec.__version__``)."""
    return {name: defined_names(module.tree) for name, module in modules.items() if is_reexport(module)}


def through_reexports(importer: Module, modules: dict[str, Module], reexports: dict[str, set[str]]) -> list[str]:
    """Each name ``importer`` takes through a re-export module, as ``line: name via module``.

    ``from M import N`` and attribute chains on an imported module (``from pipespec import codegen`` then
    ``codegen.unified_diff``) both count; a name M defines itself (``pipespec.__version__``) or a submodule
    of M does not.
    """

    def goes_through(module_name: str, name: str) -> bool:
        own = reexports.get(module_name)
        return own is not None and name not in own and f"{module_name}.{name}" not in modules

    found: list[str] = []
    bound_modules: dict[str, str] = {}  # local name → the project module it is bound to
    for node in ast.walk(importer.tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source = _resolve_relative(importer, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    bound_modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif goes_through(source, alias.name):
                    found.append(f"{node.lineno}: {alias.name} via {source}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound_modules[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound_modules[top] = top
    for node in ast.walk(importer.tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        chain: list[str] = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound_modules:
            continue
        module_name = bound_modules[value.id]
        for attr in chain:
            if f"{module_name}.{attr}" in modules:
                module_name = f"{module_name}.{attr}"
                continue
            if goes_through(module_name, attr):
                found.append(f"{node.lineno}: {attr} via {module_name}")
            break
    return sorted(set(found), key=lambda entry: (int(entry.split(":")[0]), entry))


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return project_modules(ROOT)


def test_every_reexport_module_that_stays_says_why(modules: dict[str, Module]) -> None:
    """A re-export module is kept only for users (with a reason here); one nobody needs shrinks to its docstring."""
    reexports = set(reexport_modules(modules))
    unexplained = sorted(reexports - REEXPORTS_KEPT.keys())
    assert not unexplained, (
        f"{unexplained} only re-export names: import them from their defining modules and reduce the module to "
        "its docstring, or add it to REEXPORTS_KEPT with the reason users need it"
    )
    stale = sorted(REEXPORTS_KEPT.keys() - reexports)
    assert not stale, f"{stale} in REEXPORTS_KEPT no longer re-export: remove them from the list"


def test_no_project_module_imports_a_name_through_a_reexport(modules: dict[str, Module]) -> None:
    """sdk/, codemods/, bench/, templates/ and adapters/ import every name from the module that defines it."""
    reexports = reexport_modules(modules)
    offenders = {
        str(module.path.relative_to(ROOT)): hits
        for module in modules.values()
        if (hits := through_reexports(module, modules, reexports))
    }
    assert not offenders, f"names imported through re-export modules (import them from their definitions): {offenders}"


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_check_sees_direct_lazy_and_attribute_imports_through_a_reexport(tmp_path: Path) -> None:
    """A miniature project: each way of going through a re-export is reported, the direct imports are not."""
    _write(tmp_path, "sdk/pipespec/__init__.py",
           '"""Doc."""\n__version__ = "1"\n__all__ = ["thing"]\n'
           "def __getattr__(name):\n    return name\n")
    _write(tmp_path, "sdk/pipespec/pkg/__init__.py", '"""Doc."""\nfrom pipespec.pkg.impl import thing\n__all__ = ["thing"]\n')
    _write(tmp_path, "sdk/pipespec/pkg/impl.py", "def thing():\n    return 1\n")
    _write(tmp_path, "sdk/pipespec/user.py",
           "from pipespec import __version__\n"
           "from pipespec.pkg.impl import thing\n"
           "from pipespec.pkg import thing as again\n"
           "from pipespec import thing as lazy\n"
           "from pipespec import pkg\n"
           "import pipespec.pkg.impl\n"
           "pkg.thing()\n"
           "pipespec.pkg.impl.thing()\n")
    _write(tmp_path, "sdk/pipespec/pkg/sibling.py",
           "from . import thing\nfrom .impl import thing as direct\n\n\ndef both():\n    return thing() + direct()\n")
    for directory in ("codemods", "templates", "adapters", "bench"):
        (tmp_path / directory).mkdir()
    mini = project_modules(tmp_path)

    reexports = reexport_modules(mini)
    assert reexports == {"pipespec": {"__version__", "__all__", "__getattr__"}, "pipespec.pkg": {"__all__"}}
    assert through_reexports(mini["pipespec.user"], mini, reexports) == [
        "3: thing via pipespec.pkg",
        "4: thing via pipespec",
        "7: thing via pipespec.pkg",
    ]
    assert through_reexports(mini["pipespec.pkg.sibling"], mini, reexports) == ["1: thing via pipespec.pkg"]
    assert through_reexports(mini["pipespec.pkg.impl"], mini, reexports) == []
