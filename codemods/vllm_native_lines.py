"""Line numbers of a parsed module's nodes for the vLLM-native codemod's messages and order checks: libcst's
``PositionProvider`` start line, resolved over the one top-level class being read (the decoder) rather than
the whole file, which is most of the codemod's cost on a large file. Imports no vLLM."""

from __future__ import annotations

import ast
from collections.abc import Mapping

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider


class LineIndex:
    """``index(node)`` is ``node``'s start line in ``module`` (parsed from ``code``), as the whole module's
    ``PositionProvider`` gives it. ``index.near(cls)`` names the top-level class the next questions are
    about: its positions are resolved on that class alone and shifted by the lines before it, once the
    class's own code is found at that line of ``code``; any other node falls back to the whole module's."""

    def __init__(self, module: cst.Module, code: str) -> None:
        self._module, self._code = module, code
        self._near: cst.ClassDef | None = None
        self._classes: dict[cst.ClassDef, tuple[Mapping[cst.CSTNode, CodeRange], int]] = {}  # class -> positions, shift
        self._tried: set[cst.ClassDef] = set()  # class of those resolved alone, or found elsewhere than said
        self._whole: Mapping[cst.CSTNode, CodeRange] | None = None
        self._starts: tuple[list[int], dict[str, list[int]]] | None = None  # line offsets, first lines by class

    def near(self, cls: cst.ClassDef) -> None:
        self._near = cls

    def __call__(self, node: cst.CSTNode) -> int:
        for positions, shift in self._classes.values():
            if node in positions:
                return positions[node].start.line + shift
        near = self._near
        if near is not None and near not in self._tried:
            self._tried.add(near)
            found = self._class_positions(near)
            if found is not None:
                self._classes[near] = found
                positions, shift = found
                if node in positions:
                    return positions[node].start.line + shift
        if self._whole is None:
            self._whole = MetadataWrapper(self._module, unsafe_skip_copy=True).resolve(PositionProvider)
        return self._whole[node].start.line

    def _class_positions(self, cls: cst.ClassDef) -> tuple[Mapping[cst.CSTNode, CodeRange], int] | None:
        """The class's positions on its own and the lines before its code in the file; None where the
        class is not a top-level statement of the module or its code is not found where they say."""
        module = self._module
        if all(s is not cls for s in module.body):
            return None
        alone = cst.Module(body=[cls], header=(), footer=(), encoding=module.encoding,
                           default_indent=module.default_indent, default_newline=module.default_newline,
                           has_trailing_newline=module.has_trailing_newline)
        positions = MetadataWrapper(alone, unsafe_skip_copy=True).resolve(PositionProvider)
        text = alone.code_for_node(cls)
        start = self._line_start_of(cls, positions)
        if start is None or not self._code.startswith(text, start[1]):
            return None
        return positions, start[0]

    def _line_start_of(self, cls: cst.ClassDef, positions: Mapping[cst.CSTNode, CodeRange]) -> tuple[int, int] | None:
        """(lines before the class's code, its character offset in the file): the line of its ``class``
        keyword (where libcst starts the class, after any decorators) as Python's parser gives it, less that
        line within the class's own code (its leading blank and comment lines and decorators before it). None
        for a file with other line breaks
        than ``\\n`` or ``\\r\\n`` (lines counted otherwise), or a class name defined twice."""
        if self._starts is None:
            if "\r" in self._code.replace("\r\n", "\n"):
                self._starts = ([], {})
            else:
                starts, at = [0], 0
                for line in self._code.split("\n"):
                    at += len(line) + 1
                    starts.append(at)
                firsts: dict[str, list[int]] = {}
                try:
                    body = ast.parse(self._code).body
                except SyntaxError:  # libcst's grammar took it, Python's does not: no class is found here
                    body = []
                for s in body:
                    if isinstance(s, ast.ClassDef):
                        firsts.setdefault(s.name, []).append(s.lineno)
                self._starts = (starts, firsts)
        starts, firsts = self._starts
        first = firsts.get(cls.name.value, [])
        if len(first) != 1:
            return None
        shift = first[0] - positions[cls].start.line
        if shift < 0 or shift >= len(starts):
            return None
        return shift, starts[shift]
