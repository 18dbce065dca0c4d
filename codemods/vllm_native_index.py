"""Classes by name as one vLLM model module sees them: its own, module-level tables of them, and the
ones it imports (``from .x import C``, ``from vllm.<...>.x import C``) from source found on disk, each
parsed once. How the codemod reads a layer class defined in another file. Reads source only: never
imports vLLM nor the modules it reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_native_loop import ClassLookup
from pipespec.codemods.vllm_native_modules import ModuleSources, absolute_name, installed_vllm
from pipespec.codemods.vllm_native_names import source_of

ModuleReader = Callable[[str], "str | None"]


def default_reader(label: str) -> ModuleReader:
    """``ModuleSources`` for ``label`` where it is a file on disk; else, for a label inside vLLM
    (``vllm/model_executor/models/x.py``, or relative to the package: ``model_executor/...``, ``models/...``),
    for that file of the installed vLLM (found without importing it); else a reader that finds nothing."""
    path = Path(label.split(" (")[0])
    if path.is_file():
        return ModuleSources(path)
    inside = path.parts[1:] if path.parts[:1] == ("vllm",) else path.parts  # "vllm/models/..." or "models/..."
    installed = installed_vllm()
    if installed is not None and inside[:1] in (("model_executor",), ("models",)):
        return ModuleSources(installed.joinpath(*inside), vllm_root=installed)
    return lambda dotted: None


def module_path(module: str, level: int, importer: Path, package_root: Path | None, *,
                packages: bool = False) -> Path | None:
    """The ``.py`` file that ``from <level dots><module> import`` in the file ``importer`` names: relative
    to ``importer``'s directory, or for ``vllm.<...>`` inside ``package_root`` (the ``vllm`` directory);
    ``packages``: a package's ``__init__.py`` too. None when it is not on disk (or outside vLLM). The one
    rule both the codemod's class index and the support verdict's source reader resolve imports by.
    Example: ``module_path("llama", 1, Path(".../models/mistral.py"), root)`` -> ``.../models/llama.py``."""
    if level:
        base = importer.parent
        for _ in range(level - 1):
            base = base.parent
        parts = module.split(".") if module else []
    else:
        top, _, rest = module.partition(".")
        if package_root is None or top != package_root.name:
            return None
        base, parts = package_root, rest.split(".") if rest else []
    candidate = base.joinpath(*parts)
    for path in (candidate.with_suffix(".py"), *((candidate / "__init__.py",) if packages else ())):
        if path.is_file():
            return path
    return None


class ClassIndex:
    """Classes by name as one module sees them: its own, and those it imports (``from .x import C``,
    ``from vllm.<...>.x import C``, ``from mypkg.x import C``) from modules ``read`` finds, each parsed once.
    ``package``: the package the module's relative imports start from, when known (they are then read by
    their absolute name); else ``read`` is given them relative (``".x"``, ``"..x"``)."""

    def __init__(self, module: cst.Module, read: ModuleReader, cache: dict[str, cst.Module | None] | None = None,
                 package: str | None = None) -> None:
        self.read = read
        self.package = package
        self.cache: dict[str, cst.Module | None] = cache if cache is not None else {}
        self.classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, its name there)
        self.tables: dict[str, list[str]] = {}  # NAME = {key: Class, ...} at module level
        for stmt in module.body:
            if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Dict())])):
                assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
                values = [e.value for e in cst.ensure_type(assign.value, cst.Dict).elements if isinstance(e, cst.DictElement)]
                if values and all(isinstance(v, cst.Name) for v in values):
                    name = cst.ensure_type(assign.targets[0].target, cst.Name).value
                    self.tables[name] = [cst.ensure_type(v, cst.Name).value for v in values]
            if not m.matches(stmt, m.SimpleStatementLine(body=[m.ImportFrom()])):
                continue
            imp = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.ImportFrom)
            if imp.module is None or isinstance(imp.names, cst.ImportStar):
                continue
            dotted = absolute_name("." * len(imp.relative) + source_of(imp.module), package)
            if dotted is None:
                continue
            for alias in imp.names:
                local = alias.asname.name if alias.asname else alias.name
                if isinstance(local, cst.Name):
                    self.imports[local.value] = (dotted, alias.evaluated_name)

    def lookup(self, name: str, context: cst.ClassDef | None = None) -> list[tuple[cst.ClassDef, ClassLookup]]:
        """The class(es) ``name`` means here, each with the lookup that applies inside its own module."""
        if name in self.classes:
            return [(self.classes[name], self.lookup)]
        if name in self.tables:
            found = [self.lookup(v) for v in dict.fromkeys(self.tables[name])]
            return [x for f in found for x in f] if all(len(f) == 1 for f in found) else []
        if name not in self.imports:
            return []
        dotted, there = self.imports[name]
        if dotted not in self.cache:
            source = self.read(dotted)
            try:
                self.cache[dotted] = cst.parse_module(source) if source is not None else None
            except cst.ParserSyntaxError:
                self.cache[dotted] = None
        parsed = self.cache[dotted]
        if parsed is None:
            return []
        # its relative imports start from its own package (unknown when it was itself reached relatively)
        inner = None if dotted.startswith(".") else (
            self.read.package_of(dotted) if isinstance(self.read, ModuleSources) else dotted.rpartition(".")[0])
        return ClassIndex(parsed, self.read, self.cache, inner).lookup(there)

