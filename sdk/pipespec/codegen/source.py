"""``adapter-gen``'s input: a source file (or an installed transformers module) read, parsed, its class found.

``load_target`` reads a file and parses it, a syntax error being a ``UsageError`` naming file and line;
``load_hf_target`` (``--hf MODEL_TYPE``) finds the installed transformers modeling module of a type.
Never imports or executes the code it reads; only ``--hf`` imports the installed transformers, to find
which module and class a model type uses.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from pipespec.errors import UsageError

__all__ = ["Target", "class_names", "find_class", "load_hf_target", "load_target", "parse_source", "project_label", "read_text"]


@dataclass(frozen=True)
class Target:
    """A parsed source file and the class in it to adapt."""

    path: Path
    label: str  # how headers and messages name the source (project-relative, or the installed module)
    code: str
    module: cst.Module
    class_name: str | None  # None: every PP decoder of the file (vllm dialect only)
    module_name: str | None = None  # dotted module name when known (installed modules)
    package: str | None = None  # package of an installed module, to make its relative imports absolute



def project_label(path: Path) -> str:
    """``path`` relative to its project root (nearest parent with ``.git``), else its file name.

    Headers name sources this way so ``--check`` gives the same answer from any working directory.
    """
    path = path.resolve()
    for parent in path.parents:
        if (parent / ".git").exists():
            return path.relative_to(parent).as_posix()
    return path.name


def read_text(path: Path, what: str = "source file") -> str:
    """The file's text; a missing, unreadable or non-UTF-8 file is a ``UsageError`` naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: {what} does not exist; pass the path of a Python file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory; pass one Python file") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); pass a Python source file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None


def parse_source(code: str, label: str) -> cst.Module:
    """Parse with Python's own parser first (exact line and message), then with libcst."""
    try:
        ast.parse(code, filename=label)
    except SyntaxError as exc:
        raise UsageError(f"{label}:{exc.lineno}: syntax error: {exc.msg}; fix the source, adapter-gen reads valid Python only") from None
    try:
        return cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        raise UsageError(f"{label}:{exc.raw_line}: libcst cannot parse this source: {exc.message}") from None


def class_names(module: cst.Module) -> list[str]:
    """Top-level class names, in source order (what error messages list)."""
    return [s.name.value for s in module.body if isinstance(s, cst.ClassDef)]


def find_class(module: cst.Module, name: str, label: str) -> cst.ClassDef:
    """The top-level class ``name``, else a ``UsageError`` listing the classes present."""
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == name:
            return stmt
    present = class_names(module)
    shown = ", ".join(present) if present else "none"
    raise UsageError(f"{label}: no top-level class {name!r} (classes here: {shown}); pass one of them to --class")


def load_target(path: str | Path, class_name: str | None) -> Target:
    """Read and parse ``path`` and check it defines ``class_name`` (``None``: every PP decoder, vllm dialect)."""
    path = Path(path)
    label = project_label(path)
    code = read_text(path)
    module = parse_source(code, label)
    if class_name is not None:
        find_class(module, class_name, label)
    return Target(path=path, label=label, code=code, module=module, class_name=class_name)


def load_hf_target(model_type: str, class_name: str | None = None) -> Target:
    """The installed transformers modeling module of ``model_type`` and its decoder class."""
    if not re.fullmatch(r"[a-z0-9_\-]+", model_type):
        raise UsageError(f"--hf {model_type!r}: a model type is lowercase letters, digits, _ or - (e.g. llama, qwen2)")
    from pipespec.integrations.transformers.infer import decoder_class_for_model_type

    if class_name is None:
        cls = decoder_class_for_model_type(model_type)
        module_name, class_name = cls.__module__, cls.__name__
    else:
        module_name = f"transformers.models.{model_type.replace('-', '_')}.modeling_{model_type.replace('-', '_')}"
    found = importlib.util.find_spec(module_name)
    if found is None or found.origin is None:
        raise UsageError(f"--hf {model_type}: the installed transformers has no module {module_name}")
    import transformers

    path = Path(found.origin)
    label = f"{module_name.replace('.', '/')}.py (transformers {transformers.__version__})"
    code = read_text(path)
    module = parse_source(code, label)
    find_class(module, class_name, label)
    return Target(path=path, label=label, code=code, module=module, class_name=class_name,
                  module_name=module_name, package=module_name.rsplit(".", 1)[0])
