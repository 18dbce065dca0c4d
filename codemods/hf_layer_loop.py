"""The loop over the decoder layers in an HF ``forward``: finding the one top-level loop, its form
(``for layer in self.layers[...]``, ``enumerate(...)``, ``range(...)``), the residual stream it calls each
layer on, and whether the layers hand a separate residual along.

Part of the HF forward-shape analysis (``hf_forward_shape.analyze_forward`` is the entry point). Pure
libcst; must not import ``hf_forward_shape`` (it imports this) or anything that runs the analysed code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.hf_decline import ShapeError
from pipespec.codemods.hf_names import assigned_names, children, code, dotted, names_in, self_attr, walk

_NESTED = object()  # marker: a nested loop over the known layer list whose shape did not parse


@dataclass
class LoopShape:
    """The loop over the decoder layers."""

    node: cst.For
    index: int  # position among the forward's top-level statements
    form: str  # "plain" | "enumerate" | "range"
    layers_attr: str  # dotted, without "self."
    layer_var: str | None  # the name bound to each layer (None for `range` loops)
    index_var: str | None  # the loop index (enumerate / range), else None
    num_layers_key: str | None  # config key in the slice / range bound, if any
    stream: str  # the residual-stream variable


def find_layer_loop(
    func: cst.FunctionDef,
    stmts: Sequence[cst.BaseStatement],
    layers_attr: str | None,
    line_of: Callable[[cst.CSTNode], int | None],
) -> LoopShape:
    """The one top-level loop of ``func`` (body ``stmts``) over the decoder layers, checked to be a plain
    run of the stack; ``layers_attr`` (from a spec) names the layer list, else it is detected."""
    loops: list[LoopShape] = []
    for i, stmt in enumerate(stmts):
        if isinstance(stmt, cst.For):
            try:
                shape = _candidate_loop(stmt, layers_attr)
            except ShapeError as exc:
                raise ShapeError(exc.reason, line_of(stmt)) from None
            if shape is not None:
                shape.index = i
                loops.append(shape)
    top_level = {id(s.node) for s in loops}
    known_attr = layers_attr or (loops[0].layers_attr if loops else None)
    for stmt in stmts:
        for n in walk(stmt):
            if not isinstance(n, cst.For) or id(n) in top_level or n is stmt:
                continue
            try:
                nested = _candidate_loop(n, known_attr)
            except ShapeError:
                nested = None if known_attr is None else _NESTED
            if nested is not None:
                raise ShapeError(
                    "the decoder layers run inside another statement (a loop or branch), not as one top-level loop of forward",
                    line_of(n),
                )
    if not loops:
        where = f"self.{layers_attr}" if layers_attr else "a layer list"
        raise ShapeError(
            f"forward has no top-level loop over {where} (the decoder stack is not run by a for loop here)",
            line_of(func),
        )
    if len(loops) > 1:
        lines = ", ".join(str(line_of(s.node)) for s in loops)
        raise ShapeError(
            f"forward runs self.{loops[0].layers_attr} in {len(loops)} loops (lines {lines}): "
            "looped or recurrent depth does not split into pipeline stages"
        )
    loop = loops[0]
    if loop.node.orelse is not None:
        raise ShapeError("the layer loop has an `else:` clause", line_of(loop.node))
    control = [n for n in loop_control(loop.node.body) if not isinstance(n, cst.Continue)]
    if control:
        kind = type(control[0]).__name__.lower()
        raise ShapeError(
            f"the layer loop uses `{kind}`: a stage could skip a capture or stop early", line_of(control[0])
        )
    if loop.stream not in assigned_names(loop.node.body):
        raise ShapeError(
            f"the layer loop never assigns `{loop.stream}`, so it is not the residual stream", line_of(loop.node)
        )
    if "input_ids" in names_in(loop.node.body):
        raise ShapeError(
            "the layers read `input_ids` (token-dependent routing or per-layer inputs): a later stage has no input_ids",
            line_of(loop.node),
        )
    return loop


def separate_residual(loop: LoopShape) -> bool:
    """The layers hand a separate residual to each other: ``<stream>, residual = layer(...)``."""
    residual = False
    for n in walk(loop.node.body):
        if isinstance(n, cst.Assign) and m.matches(
            n, m.Assign(targets=[m.AssignTarget(target=m.Tuple(elements=[m.Element(m.Name(loop.stream)), m.Element(m.Name("residual"))]))])
        ):
            residual = True
    return residual


def _unwrap_layers_iter(it: cst.BaseExpression) -> tuple[str, str | None, str | None] | None:
    """For ``self.L`` / ``self.L[: self.config.K]``: (L, K or None, problem or None)."""
    attr = self_attr(it)
    if attr is not None:
        return attr, None, None
    if isinstance(it, cst.Subscript):
        attr = self_attr(it.value)
        if attr is None or len(it.slice) != 1 or not isinstance(it.slice[0].slice, cst.Slice):
            return None
        sl = it.slice[0].slice
        assert isinstance(sl, cst.Slice)
        if sl.lower is not None or sl.step is not None or sl.upper is None:
            return attr, None, f"it runs the slice {code(it)} of the stack, not the whole of it"
        upper = dotted(sl.upper)
        if upper is not None and upper.startswith("self.config."):
            return attr, upper[len("self.config.") :], None
        return attr, None, f"it runs the slice {code(it)} of the stack, not the whole of it"
    return None


def _range_bound(call: cst.Call) -> tuple[str | None, str | None]:
    """For ``range(self.config.K)`` / ``range(len(self.L))``: (K or None, L or None)."""
    if len(call.args) != 1 or call.args[0].keyword is not None:
        return None, None
    arg = call.args[0].value
    bound = dotted(arg)
    if bound is not None and bound.startswith("self.config."):
        return bound[len("self.config.") :], None
    if m.matches(arg, m.Call(func=m.Name("len"), args=[m.Arg()])):
        assert isinstance(arg, cst.Call)
        return None, self_attr(arg.args[0].value)
    return None, None


def _calls_of(node: cst.CSTNode, func_name: str) -> list[cst.Call]:
    return [n for n in walk(node) if isinstance(n, cst.Call) and m.matches(n.func, m.Name(func_name))]


def _range_layer_calls(body: cst.CSTNode, index_var: str, layers_attr: str | None) -> tuple[str | None, str | None, list[cst.Call]]:
    """In a ``range`` loop body: the layer list indexed by ``index_var`` and called, the bound layer name, the calls.

    Recognises ``self.L[i](...)`` and ``layer = self.L[i]`` followed by ``layer(...)``.
    """

    def indexed(node: cst.BaseExpression) -> str | None:
        if isinstance(node, cst.Subscript) and len(node.slice) == 1:
            if m.matches(node.slice[0].slice, m.Index(value=m.Name(index_var))):
                attr = self_attr(node.value)
                if attr is not None and not attr.startswith("config.") and (layers_attr is None or attr == layers_attr):
                    return attr
        return None

    for n in walk(body):
        if isinstance(n, cst.Call) and indexed(n.func) is not None:
            return indexed(n.func), None, [n]
        if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name):
            attr = indexed(n.value)
            var = n.targets[0].target.value
            if attr is not None and _calls_of(body, var):
                return attr, var, _calls_of(body, var)
    return None, None, []


def _candidate_loop(stmt: cst.For, layers_attr: str | None) -> LoopShape | None:
    """The loop shape if ``stmt`` runs the decoder layers (of ``layers_attr`` when given)."""
    it = stmt.iter
    form, layer_var, index_var, attr, key, problem = "plain", None, None, None, None, None
    if isinstance(it, cst.Call) and m.matches(it.func, m.Name("enumerate")):
        if not it.args:
            return None
        inner = _unwrap_layers_iter(it.args[0].value)
        if inner is None:
            return None
        attr, key, problem = inner
        form = "enumerate"
        if len(it.args) > 1:
            problem = problem or f"{code(it)} does not count layers from 0"
        if m.matches(stmt.target, m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())])):
            assert isinstance(stmt.target, cst.Tuple)
            index_var = stmt.target.elements[0].value.value  # type: ignore[attr-defined]
            layer_var = stmt.target.elements[1].value.value  # type: ignore[attr-defined]
        else:
            problem = problem or f"the loop target {code(stmt.target)} is not `index, layer`"
    elif isinstance(it, cst.Call) and m.matches(it.func, m.Name("range")):
        if not isinstance(stmt.target, cst.Name):
            return None
        index_var = stmt.target.value
        attr, layer_var, range_calls = _range_layer_calls(stmt.body, index_var, layers_attr)
        if attr is None:
            return None
        key, len_attr = _range_bound(it)
        if len_attr is not None and len_attr != attr:
            return None
        if key is None and len_attr is None:
            problem = f"{code(it)} is not the whole stack (range(self.config.<key>) or range(len(self.{attr})))"
        form = "range"
    else:
        inner = _unwrap_layers_iter(it)
        if inner is None:
            return None
        attr, key, problem = inner
        if not isinstance(stmt.target, cst.Name):
            return None
        layer_var = stmt.target.value
    if layers_attr is not None and attr != layers_attr:
        return None
    assert attr is not None
    # A layer loop calls each layer on the stream: `stream = layer(stream, ...)`.
    if form == "range":
        calls = range_calls
    else:
        assert layer_var is not None
        calls = _calls_of(stmt.body, layer_var)
        if not calls and layers_attr is None:
            return None
    stream = _stream_of(calls)
    shape = LoopShape(stmt, -1, form, attr, layer_var, index_var, key, stream or "")
    if problem:
        raise ShapeError(f"the loop over self.{attr} cannot be split into stages: {problem}")
    if stream is None:
        raise ShapeError(
            f"the loop over self.{attr} does not call each layer on a hidden-states variable "
            "(`hidden_states = layer(hidden_states, ...)`), so there is no residual stream to hand between stages"
        )
    return shape


def _stream_of(calls: Sequence[cst.Call]) -> str | None:
    for call in calls:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if positional and isinstance(positional[0].value, cst.Name):
            return positional[0].value.value
        for a in call.args:
            if a.keyword is not None and a.keyword.value == "hidden_states" and isinstance(a.value, cst.Name):
                return a.value.value
    return None


def loop_control(body: cst.CSTNode) -> list[cst.CSTNode]:
    """``break``/``continue``/``return``/``yield`` of the layer loop itself (not of inner loops)."""
    found: list[cst.CSTNode] = []

    def visit(node: cst.CSTNode, in_inner_loop: bool) -> None:
        for child in children(node):
            if isinstance(child, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                continue
            if isinstance(child, (cst.Break, cst.Continue)) and not in_inner_loop:
                found.append(child)
            elif isinstance(child, (cst.Return, cst.Yield)):
                found.append(child)
            visit(child, in_inner_loop or isinstance(child, (cst.For, cst.While)))

    visit(body, False)
    return found

