"""Where the modules a model file imports live on disk, resolved the way Python resolves them: the one
rule ``adapter-gen`` and the vLLM plugin both read a layer class's source by.

``ModuleSources(path)`` is a ``ModuleReader`` for the model file ``path``: called with a module name as the
file's imports give it (``"vllm.model_executor.models.llama"``, ``"mypkg.blocks"``, or a relative
``".blocks"`` / ``"..layers"``), it returns that module's source, or None when it is not on disk.

* ``vllm.*`` resolves inside the vLLM tree the file lives in (a released tree being surveyed stays in
  that tree), else inside ``vllm_root`` when given, else inside the installed vLLM (found with
  ``importlib.util.find_spec``, which does not import it);
* a relative import resolves against the file's own package (``__init__.py`` files upwards), or its
  directory when it is in none;
* any other absolute import resolves through ``loaded`` first (the plugin: the modules already imported
  in the engine process, by their ``__file__``), then under the directory that holds the file's top
  package and every directory between it and the file (where ``sys.path`` may point: a script's own
  directory, a package's parent).

Reads files only: never imports the modules it finds.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

LoadedModules = Callable[[str], "Path | None"]


def vllm_tree_of(path: Path) -> Path | None:
    """The ``vllm`` package directory ``path`` is inside (it holds ``model_executor/``), or None."""
    return next((p for p in path.parents if p.name == "vllm" and (p / "model_executor").is_dir()), None)


@cache
def installed_vllm() -> Path | None:
    """The installed vLLM's package directory, found without importing it (None: not installed)."""
    try:
        found = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if found is None or found.origin is None:
        return None
    return Path(found.origin).parent


def imported_modules(name: str) -> Path | None:
    """The source file of a module already imported in this process (``sys.modules``), or None."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return Path(file) if isinstance(file, str) and file.endswith(".py") else None


def module_name_of(path: Path) -> tuple[str, Path]:
    """``(dotted module name, the directory it is importable from)`` for a file, by the ``__init__.py``
    files above it. Example: ``.../site/mypkg/model.py`` (``mypkg/__init__.py`` present) ->
    ``("mypkg.model", .../site)``; a file in no package -> ``(stem, its directory)``."""
    parts = [path.stem] if path.name != "__init__.py" else []
    base = path.parent
    while (base / "__init__.py").is_file():
        parts.insert(0, base.name)
        base = base.parent
    return ".".join(parts), base


class ModuleSources:
    """A ``ModuleReader`` for one model file: module name -> source, resolved from where the file is."""

    def __init__(self, path: Path, *, vllm_root: Path | None = None, loaded: LoadedModules | None = None) -> None:
        self.path = path.resolve()
        self.module_name, self.import_root = module_name_of(self.path)
        self.vllm_root = vllm_tree_of(self.path) or vllm_root or installed_vllm()
        self.loaded = loaded
        between = [p for p in self.path.parents if p == self.import_root or self.import_root in p.parents]
        self.roots = list(dict.fromkeys([*between, self.import_root]))  # nearest first

    @property
    def package(self) -> str:
        """The package the file's relative imports start from ("" for a file in no package)."""
        return self.module_name if self.path.name == "__init__.py" else self.module_name.rpartition(".")[0]

    def locate(self, name: str) -> Path | None:
        """The ``.py`` file (a module, or a package's ``__init__.py``) that ``import name`` reads here."""
        dotted = absolute_name(name, self.package)
        if not dotted:
            return None
        top, _, rest = dotted.partition(".")
        if top == "vllm":
            return _file_under(self.vllm_root, rest.split(".") if rest else []) if self.vllm_root else None
        if self.loaded is not None:
            found = self.loaded(dotted)
            if found is not None and found.is_file():
                return found
        for root in self.roots:
            found = _file_under(root, dotted.split("."))
            if found is not None:
                return found
        return None

    def package_of(self, name: str) -> str:
        """The package the relative imports of module ``name`` (absolute) start from: itself for a package."""
        found = self.locate(name)
        return name if found is not None and found.name == "__init__.py" else name.rpartition(".")[0]

    def __call__(self, name: str) -> str | None:
        found = self.locate(name)
        if found is None:
            return None
        try:
            return found.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None


def absolute_name(name: str, package: str | None) -> str | None:
    """``name`` (``".x"``, ``"..x"`` or absolute) made absolute from ``package`` ("" for a module in no
    package: its directory); unchanged where the package is unknown (None); None where it climbs above the
    top package. Example: ``absolute_name("..layers.mlp", "vllm.model_executor.models")`` ->
    ``"vllm.model_executor.layers.mlp"``."""
    if not name.startswith(".") or package is None:
        return name
    level = len(name) - len(name.lstrip("."))
    base = package.split(".") if package else []
    if level - 1 > len(base):
        return None
    head = base[: len(base) - (level - 1)]
    rest = name[level:]
    return ".".join([*head, rest] if rest else head) or None


def _file_under(root: Path, parts: list[str]) -> Path | None:
    candidate = root.joinpath(*parts)
    for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
        if path.is_file():
            return path
    return None


__all__ = ["LoadedModules", "ModuleSources", "absolute_name", "imported_modules", "installed_vllm", "module_name_of", "vllm_tree_of"]
