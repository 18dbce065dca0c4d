"""Read the shape of a vLLM-style decoder ``forward`` without running it.

Used by ``AdaptVllmForwardCommand`` (the ``pipespec`` dialect); its matchers and name helpers
(``self_attr``, ``names_in``, ``is_docstring``) also serve the ``vllm`` dialect's
``vllm_native_shape`` and ``adapt_vllm_native``. A forward we can adapt has ONE top-level loop over this stage's
layers, in one of these forms::

    for layer in islice(self.layers, self.start_layer, self.end_layer):             # or a slice
    for i, layer in enumerate(islice(...)[, start=self.start_layer]):                # enumerate
    for i in range(self.start_layer, self.end_layer):  ... = self.layers[i](...)     # range

whose body calls the layer once as ``hidden_states = layer(...)`` or ``hidden_states, residual =
layer(...)``; no ``break``/``continue``/``yield``; no return before the loop ends; non-last ranks return
``IntermediateTensors({...})`` with a dict literal. Anything else is a ``ShapeError`` carrying the
specific reason and the node it is about (the codemod turns the node into a line number).

Pure libcst over source text: must not import vllm, torch, or the codemod modules (they import this).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.helpers import parse_template_expression

from pipespec.codemods.scope import own_scope


def self_attr(name: str | None = None) -> m.Attribute:
    """Matcher for ``self.<name>`` (any name when ``None``)."""
    return m.Attribute(value=m.Name("self"), attr=m.Name(name) if name else m.Name())


START, END = self_attr("start_layer"), self_attr("end_layer")
_ISLICE = m.Call(func=m.Name("islice") | m.Attribute(attr=m.Name("islice")),
                 args=[m.Arg(self_attr()), m.Arg(START), m.Arg(END)])
_SLICE = m.Subscript(value=self_attr(), slice=[m.SubscriptElement(m.Slice(lower=START, upper=END, step=None))])
STAGE_LAYERS = _ISLICE | _SLICE
ENUMERATE = m.Call(func=m.Name("enumerate"), args=[m.Arg(STAGE_LAYERS, keyword=None), m.ZeroOrMore()])
RANGE = m.Call(func=m.Name("range"), args=[m.Arg(START), m.Arg(END)])
_DOCSTRING = m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])


class ShapeError(Exception):
    """The forward has a shape this codemod does not understand: ``reason`` says which, ``node`` where."""

    def __init__(self, reason: str, node: cst.CSTNode) -> None:
        super().__init__(reason)
        self.reason, self.node = reason, node


@dataclass(frozen=True)
class LoopShape:
    """The layer loop and how to make it capture with a global layer index."""

    loop: cst.For
    layers_attr: str | None  # ``self.<layers_attr>`` the loop runs (None for the range form)
    idx: str  # the name that holds the global layer index inside the loop
    new_iter: cst.BaseExpression | None  # replacement ``iter`` (None: keep)
    new_target: cst.BaseAssignTargetExpression | None  # replacement ``target`` (None: keep)
    hidden: str
    residual: str | None
    made_absolute: bool  # an enumerate index that counted from 0 now counts from start_layer


def is_docstring(stmt: cst.CSTNode) -> bool:
    return m.matches(stmt, _DOCSTRING)


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_fields(kind: type) -> tuple[str, ...]:
    fields = _CHILD_FIELDS.get(kind)
    if fields is None:
        fields = _CHILD_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return fields


def names_in(node: cst.CSTNode) -> set[str]:
    """Every identifier used in a subtree. A plain walk over the nodes' fields (the children a libcst
    visitor would visit), without the visitor's rebuild of every node on the way back up."""
    names: set[str] = set()
    stack: list[object] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, cst.Name):
            names.add(item.value)
        elif isinstance(item, cst.CSTNode):
            stack.extend(getattr(item, f) for f in _child_fields(type(item)))
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return names


def fresh_name(base: str, used: set[str]) -> str:
    name, n = base, 1
    while name in used:
        name, n = f"{base}_{n}", n + 1
    return name


def assigned_leaves(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The names/attributes an assignment target binds (tuple and list targets unpacked)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return [leaf for e in target.elements for leaf in assigned_leaves(e.value)]
    return [target]


def is_stage_loop(loop: cst.For) -> bool:
    return m.matches(loop.iter, STAGE_LAYERS | ENUMERATE | RANGE)


def find_layer_loop(fn: cst.FunctionDef) -> int:
    """Index, in forward's top-level statements, of the one loop over this stage's layers."""
    stmts = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
    top = [i for i, s in enumerate(stmts) if isinstance(s, cst.For) and is_stage_loop(s)]
    if len(top) == 1:
        return top[0]
    if len(top) > 1:
        raise ShapeError("forward has more than one layer loop", stmts[top[1]])
    for loop in m.findall(fn, m.For()):
        assert isinstance(loop, cst.For)
        if is_stage_loop(loop):
            raise ShapeError("the layer loop is nested inside another statement: only a top-level loop is understood", loop)
        if m.findall(loop.iter, self_attr()):
            raise ShapeError(f"loop `for ... in {cst.Module([]).code_for_node(loop.iter)}` is not over this stage's "
                             "layers (islice(self.layers, self.start_layer, self.end_layer), a slice of it, "
                             "enumerate of either, or range(self.start_layer, self.end_layer))", loop)
    raise ShapeError("forward has no layer loop over islice(self.<layers>, self.start_layer, self.end_layer)", fn)


def loop_shape(loop: cst.For, used: set[str]) -> LoopShape:
    """Read the layer loop: its index (made global), the layer call and the names it assigns."""
    if loop.orelse is not None:
        raise ShapeError("the layer loop has an else branch", loop)
    body = cst.ensure_type(loop.body, cst.IndentedBlock)
    it, target = loop.iter, loop.target
    new_iter: cst.BaseExpression | None = None
    new_target: cst.BaseAssignTargetExpression | None = None
    layers_attr: str | None = None
    made_absolute = False
    if m.matches(it, RANGE):
        if not isinstance(target, cst.Name):
            raise ShapeError("the range loop's target is not a single name", loop)
        idx = target.value
        call = m.Call(func=m.Subscript(value=self_attr(), slice=[m.SubscriptElement(m.Index(m.Name(idx)))]))
    else:
        enumerated = m.matches(it, ENUMERATE)
        args = cst.ensure_type(it, cst.Call).args if enumerated else ()
        stage_layers = args[0].value if enumerated else it
        layers_attr = cst.ensure_type(m.findall(stage_layers, self_attr())[0], cst.Attribute).attr.value
        absolute = parse_template_expression("enumerate({layers}, start=self.start_layer)", layers=stage_layers)
        if not enumerated:
            if not isinstance(target, cst.Name):
                raise ShapeError("the layer loop's target is not a single name", loop)
            layer, idx = target.value, fresh_name("idx", used)
            new_iter = absolute
            new_target = cst.Tuple([cst.Element(cst.Name(idx)), cst.Element(cst.Name(layer))], lpar=[], rpar=[])
        else:
            if not m.matches(target, m.Tuple([m.Element(m.Name()), m.Element(m.Name())])):
                raise ShapeError("the enumerate loop's target is not `index, layer`", loop)
            idx, layer = (cst.ensure_type(e.value, cst.Name).value for e in cst.ensure_type(target, cst.Tuple).elements)
            if not (len(args) == 2 and m.matches(args[1], m.Arg(START, keyword=m.Name("start") | None))):
                if idx in names_in(body):
                    raise ShapeError(f"the loop index `{idx}` counts from 0 on every stage (enumerate without "
                                     "start=self.start_layer) and the body uses it: a stage > 0 reads the wrong "
                                     "layer's entry; fix the source with start=self.start_layer, then regenerate", loop)
                new_iter, made_absolute = absolute, True
        call = m.Call(func=m.Name(layer))
    assigns = [s for s in body.body if m.matches(s, m.SimpleStatementLine(body=[m.Assign(value=call)]))]
    if len(assigns) != 1:
        raise ShapeError("the loop body must call the layer exactly once as `hidden_states[, residual] = layer(...)`", loop)
    targets = cst.ensure_type(cst.ensure_type(assigns[0], cst.SimpleStatementLine).body[0], cst.Assign).targets
    names = targets[0].target
    if len(targets) == 1 and isinstance(names, cst.Name):
        return LoopShape(loop, layers_attr, idx, new_iter, new_target, names.value, None, made_absolute)
    if len(targets) == 1 and m.matches(names, m.Tuple([m.Element(m.Name()), m.Element(m.Name())])):
        hidden, residual = (cst.ensure_type(e.value, cst.Name).value for e in cst.ensure_type(names, cst.Tuple).elements)
        return LoopShape(loop, layers_attr, idx, new_iter, new_target, hidden, residual, made_absolute)
    raise ShapeError(f"the layer call assigns `{cst.Module([]).code_for_node(names)}`: only `hidden_states` or "
                     "`hidden_states, residual` is understood (a layer that carries recurrent state across layers "
                     "is declined)", assigns[0])


def classify_returns(
    fn: cst.FunctionDef, loop_end_line: int, line_of: Callable[[cst.CSTNode], int]
) -> tuple[set[int], set[int]]:
    """``id()`` of the non-last-rank returns (``IntermediateTensors({...})``) and of the last-rank returns.

    ``line_of(node)`` gives a node's line; every return must come after ``loop_end_line``.
    """
    scope = own_scope(fn)
    if scope.jumps:
        raise ShapeError("forward breaks, continues or yields: only a straight layer loop is understood", scope.jumps[0])
    nonlast, last = set(), set()
    for ret in scope.returns:
        if line_of(ret) <= loop_end_line:
            raise ShapeError("forward returns before its layer loop ends: only a straight layer loop is understood", ret)
        if m.matches(ret.value, m.Call(func=m.Name("IntermediateTensors"))):
            call = cst.ensure_type(ret.value, cst.Call)
            if len(call.args) != 1 or call.args[0].keyword is not None or not isinstance(call.args[0].value, cst.Dict):
                raise ShapeError("the non-last-rank return is not `IntermediateTensors({...})` with a dict literal", ret)
            nonlast.add(id(ret))
        elif ret.value is None:
            raise ShapeError("forward has a bare `return`: the last rank must return the hidden states", ret)
        else:
            last.add(id(ret))
    if not nonlast:
        raise ShapeError("forward never returns `IntermediateTensors({...})` for non-last ranks: it does not "
                         "support pipeline parallelism yet", fn)
    if not last:
        raise ShapeError("forward has no last-rank return of the hidden states", fn)
    return nonlast, last
