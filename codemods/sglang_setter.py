"""``CaptureOnEveryRankCommand``: SGLang's ``set_eagle3_layers_to_capture`` no longer returns off the last rank.

SGLang's ``*ForCausalLM.set_eagle3_layers_to_capture`` (and ``set_dflash_layers_to_capture``) starts with
``if not self.pp_group.is_last_rank: return``, so a non-last rank never learns which layers to capture.
The rewrite drops that guard: every rank sets ``self.model.layers_to_capture``, translated by the model's
own convention. ``capture_aux_hidden_states`` (which makes the decoder return ``(hidden, aux)`` and the
runner unpack it) stays a last-rank fact: the setter ends with
``self.capture_aux_hidden_states = self.pp_group.is_last_rank``.

Before::

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if not self.pp_group.is_last_rank:
            return
        ...
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [val + 1 for val in layer_ids]

After::

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        ...
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [val + 1 for val in layer_ids]
        # pipespec: every rank captures; only the last returns aux states to the logits processor
        self.capture_aux_hidden_states = self.pp_group.is_last_rank

``id_conventions`` reads, from the same methods, how given ids become capture points (SGLang captures
id i at layer i's entry: pipespec's input-index id i), e.g. llama's ``val + 1``, deepseek_v2's ``+ 1``
only when the first id is 1. A setter with another ``return`` is left alone and reported. Idempotent:
a setter without the guard is not touched. Parses source only.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand

SETTERS = ("set_eagle3_layers_to_capture", "set_dflash_layers_to_capture", "set_dspark_layers_to_capture")
LAST_RANK = m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("pp_group")), attr=m.Name("is_last_rank"))
EARLY_RETURN = m.If(test=m.UnaryOperation(operator=m.Not(), expression=LAST_RANK),
                    body=m.IndentedBlock(body=[m.SimpleStatementLine(body=[m.Return(value=None)])]), orelse=None)
CAPTURE_FLAG = m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self"),
                                                            attr=m.Name("capture_aux_hidden_states")))])
DOCSTRING = m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])


def _code(node: cst.CSTNode) -> str:
    text = " ".join(cst.Module(body=[]).code_for_node(node).split())
    return text.replace("[ ", "[").replace(", ]", "]").replace("( ", "(").replace(", )", ")")


def _body(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else []


class CaptureOnEveryRankCommand(VisitorBasedCodemodCommand):
    """Drop the last-rank-only guard of every ``set_*_layers_to_capture`` in a file."""

    DESCRIPTION = "SGLang's set_eagle3_layers_to_capture tells every PP rank its layers, not only the last."

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context)
        #: ``Class.method`` rewritten, and ``Class.method: why`` left alone although it had the guard.
        self.adapted: list[str] = []
        self.skipped: list[str] = []
        self._class: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._class.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._class.pop()
        return updated_node

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        name = original_node.name.value
        if name not in SETTERS or not self._class:
            return updated_node
        where = f"{self._class[-1]}.{name}"
        body = _body(updated_node)
        first = 1 if body and m.matches(body[0], DOCSTRING) else 0
        if len(body) <= first or not m.matches(body[first], EARLY_RETURN):
            return updated_node
        rest = body[first + 1:]
        if any(m.findall(s, m.Return()) for s in rest):
            self.skipped.append(f"{where}: returns elsewhere too")
            return updated_node
        if rest:
            rest[0] = rest[0].with_changes(leading_lines=[x for x in rest[0].leading_lines if x.comment])
        new = [*body[:first], *rest]
        if any(m.findall(s, CAPTURE_FLAG) for s in rest):
            last = cst.parse_statement("self.capture_aux_hidden_states = self.pp_group.is_last_rank\n").with_changes(
                leading_lines=[cst.EmptyLine(comment=cst.Comment(
                    "# pipespec: every rank captures; only the last returns aux states to the logits processor"))])
            new.append(last)
        self.adapted.append(where)
        block = cst.ensure_type(updated_node.body, cst.IndentedBlock)
        return updated_node.with_changes(body=block.with_changes(body=new))


def id_conventions(module: cst.Module) -> dict[str, str]:
    """``{class: convention}`` for each class with ``set_eagle3_layers_to_capture``: how its ids become the
    capture list (capture points are pipespec ids: SGLang captures id i at layer i's entry).

    >>> id_conventions(cst.parse_module(
    ...     "class M:\\n def set_eagle3_layers_to_capture(self, layer_ids=None):\\n"
    ...     "  if layer_ids is None:\\n   self.model.layers_to_capture = [2, 4]\\n"
    ...     "  else:\\n   self.model.layers_to_capture = [val + 1 for val in layer_ids]\\n"))
    {'M': 'layer_ids is None: [2, 4]; layer_ids is not None: id + 1'}
    """
    found: dict[str, str] = {}
    for cls in m.findall(module, m.ClassDef()):
        klass = cst.ensure_type(cls, cst.ClassDef)
        for fn in klass.body.body if isinstance(klass.body, cst.IndentedBlock) else ():
            if m.matches(fn, m.FunctionDef(name=m.Name(SETTERS[0]))):
                rules = _rules(_body(cst.ensure_type(fn, cst.FunctionDef)), ())
                found[klass.name.value] = "; ".join(rules) if rules else "no layers_to_capture assignment (delegates)"
    return found


def _rules(stmts: Sequence[cst.BaseStatement], conditions: tuple[str, ...]) -> list[str]:
    rules: list[str] = []
    for stmt in stmts:
        if isinstance(stmt, cst.If):
            rules += _if_rules(stmt, conditions)
            continue
        assigned = m.Assign(targets=[m.AssignTarget(m.Attribute(attr=m.Name("layers_to_capture")))])
        passed = m.Call(func=m.Attribute(attr=m.Name(SETTERS[0])), args=[m.Arg(keyword=None)])
        for node in m.findall(stmt, assigned | passed):
            value = node.value if isinstance(node, cst.Assign) else cst.ensure_type(node, cst.Call).args[0].value
            when = " and ".join(conditions)
            rule = _describe(value)
            rules.append(f"{when}: {rule}" if when else rule)
    return rules


def _if_rules(stmt: cst.If, conditions: tuple[str, ...]) -> list[str]:
    rules = _rules(_block(stmt.body), (*conditions, _code(stmt.test)))
    orelse = stmt.orelse
    if isinstance(orelse, cst.If):
        rules += _if_rules(orelse, (*conditions, _negated(stmt.test)))
    elif isinstance(orelse, cst.Else):
        rules += _rules(_block(orelse.body), (*conditions, _negated(stmt.test)))
    return rules


def _negated(test: cst.BaseExpression) -> str:
    if m.matches(test, m.Comparison(comparisons=[m.ComparisonTarget(operator=m.Is())])):
        return _code(test).replace(" is ", " is not ", 1)
    return f"not ({_code(test)})"


def _block(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    return list(suite.body) if isinstance(suite, cst.IndentedBlock) else []


def _describe(value: cst.BaseExpression) -> str:
    shifted = m.ListComp(elt=m.BinaryOperation(left=m.Name(), operator=m.Add(), right=m.Integer()))
    if m.matches(value, shifted):
        return f"id + {cst.ensure_type(cst.ensure_type(value, cst.ListComp).elt, cst.BinaryOperation).right.value}"
    if m.matches(value, m.Call(func=m.Name("list"), args=[m.Arg(m.Name())]) | m.Name()):
        return "id as given"
    return _code(value)
