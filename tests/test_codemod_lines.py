"""``LineIndex``: the vLLM-native codemod's line numbers, resolved per top-level class, equal the whole
module's ``PositionProvider`` lines for every node (real vLLM files of each release's fixtures, and files
with decorators, comments, a class defined twice and ``\\r\\n`` line breaks)."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from pipespec.codemods.vllm_native_lines import LineIndex

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm_native"
RELEASE_FILES = sorted(p for p in FIXTURES.glob("*/*.py"))


def _all_nodes(node: cst.CSTNode) -> list[cst.CSTNode]:
    out = [node]
    for child in node.children:
        out.extend(_all_nodes(child))
    return out


def _assert_same_lines(code: str) -> int:
    module = cst.parse_module(code)
    whole = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    index = LineIndex(module, code)
    checked = 0
    for cls in (s for s in module.body if isinstance(s, cst.ClassDef)):
        index.near(cls)
        for node in _all_nodes(cls):
            assert index(node) == whole[node].start.line, (cls.name.value, type(node).__name__)
            checked += 1
    for stmt in module.body:  # nodes outside any class: the whole module's lines
        if not isinstance(stmt, cst.ClassDef):
            assert index(stmt) == whole[stmt].start.line
    return checked


@pytest.mark.parametrize("path", RELEASE_FILES[::3], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_class_lines_equal_whole_module_lines_on_vllm_files(path: Path) -> None:
    assert _assert_same_lines(path.read_text(encoding="utf-8")) > 100


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_decorators_comments_and_a_class_defined_twice(newline: str) -> None:
    code = newline.join([
        "import torch",
        "",
        "# a comment before the class",
        "",
        "@decorator(1)",
        "@other",
        "class A(Base):",
        "    # inside",
        "    x = 1",
        "",
        "    def forward(self, h):",
        "        return h + 1",
        "",
        "class B:",
        "    pass",
        "",
        "class B:  # defined again: the whole module's positions answer",
        "    def f(self):",
        "        return 2",
        "",
    ])
    assert _assert_same_lines(code) > 10
