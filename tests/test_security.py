"""Security invariants, checked by scanning the shipped code (these fail if someone adds a violation)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "sdk", ROOT / "codemods", ROOT / "bench"]


def python_files(*roots: Path) -> list[Path]:
    return sorted(p for r in roots for p in r.rglob("*.py") if ".venv" not in p.parts)


def calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


@pytest.mark.parametrize("path", python_files(*SHIPPED), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_and_safe_torch_load(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(n.split(".")[0] in {"pickle", "cPickle", "dill", "cloudpickle", "marshal"} for n in names), (
                f"{path}:{node.lineno}: pickle-family import; pipespec loads safetensors only")
    for call in calls(tree):
        name = dotted(call.func)
        if name.endswith("torch.load"):
            kw = {k.arg: k.value for k in call.keywords}
            ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            assert ok, f"{path}:{call.lineno}: torch.load without weights_only=True"
        assert name not in {"pickle.load", "pickle.loads", "numpy.load", "np.load"}, f"{path}:{call.lineno}: {name}"


@pytest.mark.parametrize("path", python_files(ROOT / "codemods"), ids=lambda p: str(p.relative_to(ROOT)))
def test_codemods_never_import_or_execute_what_they_transform(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for call in calls(tree):
        name = dotted(call.func)
        assert name not in {"exec", "eval", "compile", "__import__", "importlib.import_module", "import_module",
                            "runpy.run_path", "runpy.run_module"}, f"{path}:{call.lineno}: {name}() in a codemod"


def test_templates_render_with_strict_undefined():
    sources = [p.read_text() for p in python_files(ROOT / "sdk") if "jinja2" in p.read_text()]
    for text in sources:
        if "Environment(" in text:
            assert "StrictUndefined" in text, "every jinja2 Environment must use undefined=StrictUndefined"
