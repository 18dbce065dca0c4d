"""codemods/scope.py: the visitor and transformer bases that see one function's own code, and own_scope.

Real libcst on small sources written for these tests; each test names what a nested scope must not
contribute (a nested def's return, a class body's loop, a lambda's expression).
"""

from __future__ import annotations

import textwrap

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.scope import FunctionBodyTransformer, FunctionBodyVisitor, own_scope

SOURCE = textwrap.dedent(
    """
    def forward(self, xs):
        for x in xs:
            if x is None:
                continue
        def helper(y):
            for z in y:
                break
            return y
        class Local:
            def method(self):
                return 1
        key = lambda v: get_pp_group().is_first_rank
        if get_pp_group().is_first_rank:
            return xs
        return None
    """
)


def _forward() -> cst.FunctionDef:
    return cst.ensure_type(cst.parse_module(SOURCE).body[0], cst.FunctionDef)


class _Names(FunctionBodyVisitor):
    def __init__(self, *, inside_function: bool = False) -> None:
        super().__init__(inside_function=inside_function)
        self.names: list[str] = []

    def visit_Name(self, node: cst.Name) -> None:
        self.names.append(node.value)


class _RankChecks(FunctionBodyTransformer):
    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        if original_node.attr.value == "is_first_rank":
            return cst.parse_expression("self.is_first_stage")
        return updated_node


class _RankChecksInLambdas(_RankChecks):
    ENTER_LAMBDAS = True


def test_own_scope_collects_the_functions_own_loops_returns_and_jumps_only() -> None:
    """The nested def's loop, break and return and the method's return are not forward's."""
    scope = own_scope(_forward())
    assert [cst.Module([]).code_for_node(loop.iter) for loop in scope.loops] == ["xs"]
    assert [cst.Module([]).code_for_node(r.value) for r in scope.returns if r.value is not None] == ["xs", "None"]
    assert [type(j).__name__ for j in scope.jumps] == ["Continue"]


def test_visitor_skips_nested_defs_classes_and_lambdas() -> None:
    """Nothing of helper, Local or the lambda's body is visited (not even their names)."""
    visitor = _Names()
    _forward().visit(visitor)
    assert "z" not in visitor.names and "y" not in visitor.names
    assert not {"v", "helper", "Local", "method"} & set(visitor.names)
    assert {"forward", "xs", "x", "key", "get_pp_group"} <= set(visitor.names)
    assert visitor.function_depth == 0


def test_visitor_run_inside_a_function_treats_every_def_as_nested() -> None:
    """With inside_function=True a statement that is itself a def is not entered."""
    helper = _forward().body.body[1]
    assert isinstance(helper, cst.FunctionDef)
    inside = _Names(inside_function=True)
    helper.visit(inside)
    assert inside.names == []
    outside = _Names()
    helper.visit(outside)
    assert {"helper", "y", "z"} <= set(outside.names)


def test_sibling_functions_are_each_entered_once_depth_returns_to_zero() -> None:
    """Two top-level defs in one module: both are a function's own code, neither nested."""
    visitor = _Names()
    cst.parse_module("def a():\n    one = 1\n\n\ndef b():\n    two = 2\n").visit(visitor)
    assert {"one", "two"} <= set(visitor.names)


def test_transformer_rewrites_own_code_and_enters_lambdas_only_when_asked() -> None:
    """The rank check in forward's `if` is rewritten; the lambda's only with ENTER_LAMBDAS."""
    plain = cst.ensure_type(_forward().visit(_RankChecks()), cst.FunctionDef)
    assert len(m.findall(plain, m.Attribute(attr=m.Name("is_first_stage")))) == 1
    assert len(m.findall(plain, m.Attribute(attr=m.Name("is_first_rank")))) == 1  # the lambda's
    with_lambdas = cst.ensure_type(_forward().visit(_RankChecksInLambdas()), cst.FunctionDef)
    assert len(m.findall(with_lambdas, m.Attribute(attr=m.Name("is_first_stage")))) == 2
    assert not m.findall(with_lambdas, m.Attribute(attr=m.Name("is_first_rank")))
