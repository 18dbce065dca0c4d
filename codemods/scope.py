"""A function's own code, for the codemods' visitors and transformers: the nodes a ``return``,
``break`` or rank check belongs to, with nested ``def``s, classes and (unless asked) lambdas left out.

``FunctionBodyVisitor`` / ``FunctionBodyTransformer`` are the bases that keep that depth count (the
visit/leave pair every such visitor would otherwise repeat); ``own_scope(fn)`` collects the loops,
returns and jumps of ``fn``'s own body. Pure libcst; imports nothing from pipespec, so every codemod
module may import it.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst


class _FunctionBody:
    """The ``visit_`` half shared by both bases: enter the outermost ``def`` met, skip what is nested.

    ``function_depth`` counts the ``def``s around the node being visited; it starts at 1 with
    ``inside_function=True``, for a visitor run on statements of a function's body (every ``def`` met
    is then nested).
    """

    #: Lambdas are expressions of the function's own code; a visitor that rewrites expressions (a rank
    #: check that reads ``self``) enters them, one that collects statements has nothing to find there.
    ENTER_LAMBDAS: ClassVar[bool] = False
    function_depth: int

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.function_depth += 1
        return self.function_depth == 1

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return self.ENTER_LAMBDAS


class FunctionBodyVisitor(_FunctionBody, cst.CSTVisitor):
    """A ``CSTVisitor`` that sees one function's own code (see ``_FunctionBody``)."""

    def __init__(self, *, inside_function: bool = False) -> None:
        super().__init__()
        self.function_depth = int(inside_function)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.function_depth -= 1


class FunctionBodyTransformer(_FunctionBody, cst.CSTTransformer):
    """A ``CSTTransformer`` that rewrites one function's own code (see ``_FunctionBody``)."""

    def __init__(self, *, inside_function: bool = False) -> None:
        super().__init__()
        self.function_depth = int(inside_function)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self.function_depth -= 1
        return updated_node


class _OwnScope(FunctionBodyVisitor):
    """Loops, returns and jumps of a function's own body (nested functions, classes and lambdas are not
    its code)."""

    def __init__(self) -> None:
        super().__init__()
        self.loops: list[cst.For] = []
        self.returns: list[cst.Return] = []
        self.jumps: list[cst.CSTNode] = []

    def visit_For(self, node: cst.For) -> None:
        self.loops.append(node)

    def visit_Return(self, node: cst.Return) -> None:
        self.returns.append(node)

    def visit_Break(self, node: cst.Break) -> None:
        self.jumps.append(node)

    def visit_Continue(self, node: cst.Continue) -> None:
        self.jumps.append(node)

    def visit_Yield(self, node: cst.Yield) -> None:
        self.jumps.append(node)


def own_scope(node: cst.CSTNode) -> _OwnScope:
    """What ``node``'s own body holds (``_OwnScope``), nested scopes left out."""
    scope = _OwnScope()
    node.visit(scope)
    return scope
