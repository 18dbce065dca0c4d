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

A setter without the guard that sets ``self.capture_aux_hidden_states = True`` (qwen2_5_vl's, gemma4_mm's:
already every rank learns its ids) would make a non-last rank unpack the ``PPProxyTensors`` its decoder returns
as ``(hidden, aux)``; it gets the same last line, when its class (or a base class in the file) holds
``self.pp_group``. Left alone and reported (``skipped``): a setter with another ``return``, one that decides on
the pipeline itself (``if self.pp_group.world_size > 1: raise ...``, qwen3_5_text's DFlash setter), one whose
class has no ``self.pp_group``.

``id_conventions`` reads, from the same methods, how given ids become capture points (SGLang captures
id i at layer i's entry: pipespec's input-index id i), e.g. llama's ``val + 1``, deepseek_v2's ``+ 1``
only when the first id is 1. Idempotent: a setter that already ends with the last-rank line is not touched.
Parses source only.
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
CAPTURE_ON = m.Assign(targets=CAPTURE_FLAG.targets, value=m.Name("True"))
CAPTURE_LAST_RANK = m.SimpleStatementLine(body=[m.Assign(targets=CAPTURE_FLAG.targets, value=LAST_RANK)])
PP_GROUP = m.Attribute(value=m.Name("self"), attr=m.Name("pp_group"))
HOLDS_PP_GROUP = m.Assign(targets=[m.AssignTarget(PP_GROUP)])
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
        self._module: cst.Module | None = None
        #: class -> (its base names, whether it assigns ``self.pp_group``), read from the file when first asked.
        self._classes: dict[str, tuple[list[str], bool]] | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node

    def _holds_pp_group(self, name: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether class ``name`` or a base class of it defined in this file assigns ``self.pp_group``."""
        if self._classes is None:
            self._classes = {}
            for cls in m.findall(self._module, m.ClassDef()) if self._module is not None else ():
                klass = cst.ensure_type(cls, cst.ClassDef)
                bases = [b.value.value for b in klass.bases if isinstance(b.value, cst.Name)]
                self._classes[klass.name.value] = (bases, bool(m.findall(klass, HOLDS_PP_GROUP)))
        bases, holds = self._classes.get(name, ([], False))
        return holds or any(self._holds_pp_group(b, seen | {name}) for b in bases if b not in seen)

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
        if len(body) <= first:
            return updated_node
        if not m.matches(body[first], EARLY_RETURN):
            return self._unguarded(updated_node, where, body)
        rest = body[first + 1:]
        if any(m.findall(s, m.Return()) for s in rest):
            self.skipped.append(f"{where}: returns elsewhere too")
            return updated_node
        if rest:
            rest[0] = rest[0].with_changes(leading_lines=[x for x in rest[0].leading_lines if x.comment])
        new = [*body[:first], *rest]
        if any(m.findall(s, CAPTURE_FLAG) for s in rest):
            new.append(_last_rank_line())
        self.adapted.append(where)
        block = cst.ensure_type(updated_node.body, cst.IndentedBlock)
        return updated_node.with_changes(body=block.with_changes(body=new))

    def _unguarded(self, node: cst.FunctionDef, where: str, body: list[cst.BaseStatement]) -> cst.FunctionDef:
        """A setter without the guard: keep ``capture_aux_hidden_states`` a last-rank fact, or say why not."""
        if not any(m.findall(s, CAPTURE_ON) for s in body) or m.matches(body[-1], CAPTURE_LAST_RANK):
            return node
        if any(m.findall(s, m.Return()) for s in body):
            self.skipped.append(f"{where}: sets capture_aux_hidden_states = True on every rank and returns early")
            return node
        decides = [i for s in body for i in m.findall(s, m.If(test=m.MatchIfTrue(
            lambda t: bool(m.findall(t, PP_GROUP)))))]
        if decides:
            test = _code(cst.ensure_type(decides[0], cst.If).test)
            self.skipped.append(f"{where}: decides on the pipeline itself (`if {test}`)")
            return node
        if not self._holds_pp_group(self._class[-1]):
            self.skipped.append(f"{where}: sets capture_aux_hidden_states = True on every rank, and its class holds no "
                                "self.pp_group (in this file) to keep that to the last rank")
            return node
        self.adapted.append(where)
        block = cst.ensure_type(node.body, cst.IndentedBlock)
        return node.with_changes(body=block.with_changes(body=[*body, _last_rank_line()]))


def _last_rank_line() -> cst.BaseStatement:
    return cst.parse_statement("self.capture_aux_hidden_states = self.pp_group.is_last_rank\n").with_changes(
        leading_lines=[cst.EmptyLine(comment=cst.Comment(
            "# pipespec: every rank captures; only the last returns aux states to the logits processor"))])


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
