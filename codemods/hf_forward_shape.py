"""Read the shape of an HF transformers decoder ``forward`` without running it.

Shared by the codemod (``AdaptHFStageForwardCommand``, which rewrites what this finds) and by
``pipespec.integrations.transformers.infer`` (which turns it into an adapter spec). Pure libcst: the analysed code is never
imported or executed.

A forward we can adapt has three parts around ONE top-level loop over the decoder layers::

    <prologue>   argument checks, the embedding lookup, cache, positions, masks, rotary embeddings
    for ... in self.layers[: self.config.num_hidden_layers]:     # or enumerate(...) / range(...)
        hidden_states = decoder_layer(hidden_states, ...)         # the residual stream
    <epilogue>   final norm, return the model output

Everything else (several loops over the stack, ``break`` in the loop, layers that read
``input_ids``, tensors derived from the embedding and fed to every layer) is a ``ShapeError`` whose
message is the specific, true reason a stage forward cannot be generated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

#: Config keys that hold the number of decoder layers in HF configs we have seen.
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_blocks")


class ShapeError(Exception):
    """The forward has a shape the HF codemod cannot adapt; ``str(exc)`` says which and where."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        self.reason = reason
        self.line = line
        super().__init__(f"line {line}: {reason}" if line else reason)


_NESTED = object()  # marker: a nested loop over the known layer list whose shape did not parse


class AlreadyStageAware(Exception):
    """The forward already takes ``intermediate_tensors``."""


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


@dataclass
class ForwardShape:
    """What the codemod and spec inference need to know about one forward."""

    func: cst.FunctionDef
    body_start: int  # index of the first statement after the docstring
    params: tuple[str, ...]
    cache_kwarg: str | None
    loop: LoopShape
    embed_index: int  # top-level index of the statement holding the embedding lookup
    embed_attr: str
    embed_conditional: bool  # the lookup sits under `if inputs_embeds is None:`
    first_stage_only: list[int] = field(default_factory=list)  # prologue statements to guard
    stream_first_assigned: int | None = None  # guarded statement that first binds the stream
    norm_attr: str | None = None
    residual: bool = False
    decorators: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- small helpers
def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base is not None else None
    return None


def self_attr(node: cst.BaseExpression) -> str | None:
    """``x.y`` for ``self.x.y``, else None."""
    name = dotted(node)
    if name is not None and name.startswith("self.") and name != "self.":
        return name[len("self.") :]
    return None


def code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def names_in(node: cst.CSTNode) -> set[str]:
    """Every variable name used (read or bound) in ``node``; not attribute or keyword-argument names."""
    return {n.value for n in _variable_names(node)}


def _variable_names(node: cst.CSTNode) -> list[cst.Name]:
    out: list[cst.Name] = []

    def visit(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Name):
            out.append(n)
            return
        for child in children(n):
            if isinstance(n, cst.Attribute) and child is n.attr:
                continue
            if isinstance(n, cst.Arg) and child is n.keyword:
                continue
            if isinstance(n, (cst.FunctionDef, cst.ClassDef)) and child is n.name:
                continue
            visit(child)

    visit(node)
    return out


def read_names(node: cst.CSTNode) -> set[str]:
    """Names ``node`` reads (binding targets of ``=``, ``for``, ``:=`` and ``as`` excluded; ``+=`` reads)."""
    targets: set[int] = set()
    for n in walk(node):
        bound: list[cst.CSTNode] = []
        if isinstance(n, cst.Assign):
            bound = [t.target for t in n.targets]
        elif isinstance(n, cst.AnnAssign):
            bound = [n.target]
        elif isinstance(n, (cst.For, cst.CompFor)):
            bound = [n.target]
        elif isinstance(n, cst.NamedExpr):
            bound = [n.target]
        elif isinstance(n, cst.AsName):
            bound = [n.name]
        for b in bound:
            for t in walk(b):
                if isinstance(t, cst.Name) and not _is_attr_or_subscript_base(b, t):
                    targets.add(id(t))
    return {n.value for n in _variable_names(node) if id(n) not in targets}


def _is_attr_or_subscript_base(target: cst.CSTNode, name: cst.Name) -> bool:
    """In ``x.a = ...`` or ``x[i] = ...`` the target reads ``x`` (and ``i``) rather than binding it."""
    return not isinstance(target, (cst.Name, cst.Tuple, cst.List, cst.StarredElement)) or any(
        isinstance(n, (cst.Attribute, cst.Subscript)) and name in set(walk(n)) for n in walk(target)
    )


#: id(node) -> (node, its children). Holding the node keeps its id from being reused; bounded below.
_CHILDREN: dict[int, tuple[cst.CSTNode, tuple[cst.CSTNode, ...]]] = {}
_CHILDREN_MAX = 200_000


def children(node: cst.CSTNode) -> Sequence[cst.CSTNode]:
    """``node.children``, memoised: libcst recomputes it on every access, and the analysis walks the
    same forward a dozen times (most of ``pipespec.adapt``'s time before this cache)."""
    hit = _CHILDREN.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    if len(_CHILDREN) >= _CHILDREN_MAX:
        _CHILDREN.clear()
    found = tuple(node.children)
    _CHILDREN[id(node)] = (node, found)
    return found


def walk(node: cst.CSTNode, *, into_functions: bool = False) -> Iterator[cst.CSTNode]:
    """Pre-order walk; by default does not enter nested defs, lambdas or classes."""
    yield node
    for child in children(node):
        if not into_functions and isinstance(child, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            continue
        yield from walk(child, into_functions=into_functions)


def assigned_names(node: cst.CSTNode) -> set[str]:
    """Names bound (``=``, ``+=``, annotated, walrus, ``for`` targets, ``with ... as``) inside ``node``."""
    out: set[str] = set()

    def targets(t: cst.BaseExpression) -> None:
        if isinstance(t, cst.Name):
            out.add(t.value)
        elif isinstance(t, (cst.Tuple, cst.List)):
            for el in t.elements:
                targets(el.value)
        elif isinstance(t, cst.StarredElement):
            targets(t.value)

    for n in walk(node):
        if isinstance(n, cst.Assign):
            for t in n.targets:
                targets(t.target)
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            targets(n.target)
        elif isinstance(n, cst.NamedExpr):
            targets(n.target)
        elif isinstance(n, cst.For):
            targets(n.target)
        elif isinstance(n, cst.AsName):
            targets(n.name)  # type: ignore[arg-type]
    return out


def is_docstring(stmt: cst.BaseStatement) -> bool:
    return m.matches(
        stmt, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])
    )


def is_alias(stmt: cst.BaseStatement, target: str, source: str) -> bool:
    """``target = source`` (optionally annotated)."""
    return m.matches(
        stmt,
        m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(target))], value=m.Name(source))]),
    ) or m.matches(stmt, m.SimpleStatementLine(body=[m.AnnAssign(target=m.Name(target), value=m.Name(source))]))


def decorator_name(dec: cst.Decorator) -> str:
    node = dec.decorator
    if isinstance(node, cst.Call):
        node = node.func
    return dotted(node) or code(node)


def _params(func: cst.FunctionDef) -> tuple[str, ...]:
    p = func.params
    names = [x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)]
    if isinstance(p.star_arg, cst.Param):
        names.append(p.star_arg.name.value)
    if p.star_kwarg is not None:
        names.append(p.star_kwarg.name.value)
    return tuple(names)


# ----------------------------------------------------------------------------- the layer loop
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


def _loop_control(body: cst.CSTNode) -> list[cst.CSTNode]:
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


# ----------------------------------------------------------------------------- the whole forward
def rotary_attrs(cls: cst.ClassDef) -> set[str]:
    """``self`` attributes that ``__init__`` builds from a rotary-embedding class (``*Rotary*``/``*Rope*``)."""
    out: set[str] = set()
    for stmt in cls.body.body:
        if not (isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__"):
            continue
        for n in walk(stmt):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                attr = self_attr(n.targets[0].target)
                callee = (dotted(n.value.func) or "").rsplit(".", 1)[-1].lower()
                if attr is not None and ("rotary" in callee or "rope" in callee):
                    out.add(attr)
    return out


def find_forward(cls: cst.ClassDef) -> cst.FunctionDef | None:
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            return stmt
    return None


def analyze_forward(
    func: cst.FunctionDef,
    *,
    layers_attr: str | None = None,
    embed_attr: str | None = None,
    norm_attr: str | None = None,
    shape_only_attrs: Iterable[str] = (),
    line_of: Callable[[cst.CSTNode], int | None] = lambda node: None,
) -> ForwardShape:
    """Analyse ``func``; attributes left ``None`` are detected. Raises ``ShapeError``/``AlreadyStageAware``.

    ``shape_only_attrs``: ``self`` attributes whose call reads tensors only for shape/dtype/device
    (rotary embeddings; see ``rotary_attrs``).
    """
    params = _params(func)
    if "intermediate_tensors" in params:
        raise AlreadyStageAware()
    stmts = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    body_start = 1 if stmts and is_docstring(stmts[0]) else 0
    for needed in ("input_ids", "inputs_embeds"):
        if needed not in params:
            raise ShapeError(
                f"forward has no `{needed}` parameter: a later stage feeds the received hidden states in as "
                "`inputs_embeds` in place of the `input_ids` lookup",
                line_of(func),
            )
    cache_kwarg = "cache" if "cache" in params else ("past_key_values" if "past_key_values" in params else None)

    # --- the loop over the layers: exactly one, at the top level
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
    control = [n for n in _loop_control(loop.node.body) if not isinstance(n, cst.Continue)]
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
    residual = False
    for n in walk(loop.node.body):
        if isinstance(n, cst.Assign) and m.matches(
            n, m.Assign(targets=[m.AssignTarget(target=m.Tuple(elements=[m.Element(m.Name(loop.stream)), m.Element(m.Name("residual"))]))])
        ):
            residual = True

    # --- the embedding lookup
    prologue = stmts[body_start : loop.index]
    embed_index, found_attr, conditional = _find_embedding(prologue, embed_attr, loop.stream)
    if embed_index is None:
        what = f"self.{embed_attr}(...)" if embed_attr else "self.<embedding>(input_ids)"
        raise ShapeError(f"no embedding lookup {what} before the layer loop", line_of(func))
    embed_index += body_start
    assert found_attr is not None

    shape = ForwardShape(
        func=func,
        body_start=body_start,
        params=params,
        cache_kwarg=cache_kwarg,
        loop=loop,
        embed_index=embed_index,
        embed_attr=found_attr,
        embed_conditional=conditional,
        residual=residual,
        decorators=tuple(decorator_name(d) for d in func.decorators),
    )
    _classify_prologue(shape, stmts, line_of)
    _check_loop_carried(shape, stmts, line_of)
    _check_stage_inputs(shape, stmts, line_of, set(shape_only_attrs))

    # --- the epilogue
    epilogue = stmts[loop.index + 1 :]
    returns = [n for s in epilogue for n in walk(s) if isinstance(n, cst.Return)]
    if not returns:
        raise ShapeError("forward does not return after the layer loop", line_of(loop.node))
    for s in epilogue:
        for n in walk(s):
            if isinstance(n, cst.SimpleStatementLine) and any(isinstance(x, cst.Return) for x in n.body) and len(n.body) > 1:
                raise ShapeError("a return after the loop shares its line with other statements", line_of(n))
    shape.norm_attr = _find_norm(epilogue, loop.stream, norm_attr)
    return shape


def _find_embedding(
    prologue: Sequence[cst.BaseStatement], embed_attr: str | None, stream: str
) -> tuple[int | None, str | None, bool]:
    """(index in prologue, attr, under ``if inputs_embeds is None``) of the embedding lookup.

    With ``embed_attr`` (from a spec): the first call ``self.<embed_attr>(...)``. Without: the first
    ``inputs_embeds = self.<x>(... input_ids ...)``, else the first ``<stream> = self.<x>(... input_ids ...)``
    (a method such as ``self.warn_if_padding_and_no_attention_mask(input_ids, ...)`` is neither).
    """
    if embed_attr is not None:
        for i, stmt in enumerate(prologue):
            for n in walk(stmt):
                if isinstance(n, cst.Call) and self_attr(n.func) == embed_attr:
                    return i, embed_attr, _under_inputs_embeds_none(stmt)
        return None, None, False
    for target in ("inputs_embeds", stream):
        for i, stmt in enumerate(prologue):
            for n in walk(stmt):
                if not isinstance(n, (cst.Assign, cst.AnnAssign)):
                    continue
                targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
                if not any(m.matches(t, m.Name(target)) for t in targets) or n.value is None:
                    continue
                for call in walk(n.value):
                    if isinstance(call, cst.Call) and self_attr(call.func) is not None and any(
                        "input_ids" in names_in(a.value) for a in call.args
                    ):
                        return i, self_attr(call.func), _under_inputs_embeds_none(stmt)
    return None, None, False


def _under_inputs_embeds_none(stmt: cst.BaseStatement) -> bool:
    return m.matches(
        stmt, m.If(test=m.Comparison(left=m.Name("inputs_embeds"), comparisons=[m.ComparisonTarget(m.Is(), m.Name("None"))]))
    )


#: Tensor functions/methods that change a tensor's shape (concatenating streams, adding dimensions).
RESHAPES = frozenset(
    ("cat", "concat", "concatenate", "stack", "expand", "unsqueeze", "view", "reshape", "repeat", "flatten", "permute", "transpose")
)


def _reshaping_call(stmt: cst.BaseStatement, tensors: set[str]) -> str | None:
    """The reshaping function applied to the stream/embeddings in an assignment back to them, if any."""
    for n in walk(stmt):
        if not isinstance(n, (cst.Assign, cst.AugAssign, cst.AnnAssign)) or n.value is None:
            continue
        targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
        if not any(isinstance(t, cst.Name) and t.value in tensors for t in targets):
            continue
        for call in walk(n.value):
            if not isinstance(call, cst.Call):
                continue
            func = call.func
            name = func.attr.value if isinstance(func, cst.Attribute) else (dotted(func) or "")
            if name in RESHAPES and names_in(call) & tensors:
                return name
    return None


def _classify_prologue(shape: ForwardShape, stmts: Sequence[cst.BaseStatement], line_of: Callable[[cst.CSTNode], int | None]) -> None:
    """Mark the statements after the embedding that change the stream as first-stage only."""
    stream = shape.loop.stream
    watched = {stream, "inputs_embeds"}
    defined = stream == "inputs_embeds"
    if not shape.embed_conditional:
        shape.first_stage_only.append(shape.embed_index)
        bound = assigned_names(stmts[shape.embed_index])
        if stream in bound and stream != "inputs_embeds":
            shape.stream_first_assigned = shape.embed_index
            defined = True
    elif stream != "inputs_embeds" and stream in assigned_names(stmts[shape.embed_index]):
        raise ShapeError(
            f"`{stream}` is bound inside the embedding branch: a later stage would have no stream",
            line_of(stmts[shape.embed_index]),
        )
    later_uses: list[set[str]] = [names_in(s) for s in stmts]
    for i in range(shape.embed_index + 1, shape.loop.index):
        stmt = stmts[i]
        bound = assigned_names(stmt)
        if not bound & watched:
            continue
        if is_alias(stmt, stream, "inputs_embeds"):
            defined = True
            continue
        others = bound - watched
        used_later = sorted(x for x in others if any(x in later_uses[j] for j in range(i + 1, len(stmts))))
        if used_later:
            raise ShapeError(
                f"this statement changes the embeddings and also computes {', '.join('`' + x + '`' for x in used_later)}, "
                "which the rest of forward uses: a later stage cannot skip it and cannot run it",
                line_of(stmt),
            )
        reshape = _reshaping_call(stmt, watched)
        if reshape is not None:
            raise ShapeError(
                f"the first stage reshapes the stream with {reshape}(...): what it sends is not shaped like the "
                "embeddings [batch, seq, hidden], so a later stage cannot derive masks and positions from it",
                line_of(stmt),
            )
        shape.first_stage_only.append(i)
        if not defined and stream in bound:
            shape.stream_first_assigned = i
            defined = True
    if not defined:
        raise ShapeError(f"`{stream}` is never bound before the layer loop", line_of(shape.loop.node))


def _is_none_test(node: cst.CSTNode, name: str, op: type[cst.BaseCompOp]) -> bool:
    return m.matches(node, m.Comparison(left=m.Name(name), comparisons=[m.ComparisonTarget(m.TypeOf(op)(), m.Name("None"))]))  # type: ignore[operator]


def _unreachable_on_later_stages(test: cst.BaseExpression) -> bool:
    """A branch test that is false on a later stage (there ``input_ids is None`` and ``inputs_embeds`` is set)."""
    parts: list[cst.BaseExpression] = [test]
    while parts:
        node = parts.pop()
        if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
            parts += [node.left, node.right]
        elif _is_none_test(node, "input_ids", cst.IsNot) or _is_none_test(node, "inputs_embeds", cst.Is):
            return True
    return False


def _reachable_reads(stmt: cst.CSTNode) -> list[cst.Name]:
    """Names ``stmt`` reads on a later stage: skips branches that cannot run there and ``x is None`` tests."""
    out: list[cst.Name] = []

    def visit(node: cst.CSTNode) -> None:
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return
        if isinstance(node, cst.If):
            visit(node.test)
            if not _unreachable_on_later_stages(node.test):
                visit(node.body)
            if node.orelse is not None:
                visit(node.orelse)
            return
        if isinstance(node, cst.Comparison) and (
            _is_none_test(node, "input_ids", cst.Is) or _is_none_test(node, "input_ids", cst.IsNot)
        ):
            return
        if isinstance(node, cst.Name):
            out.append(node)
        elif isinstance(node, cst.Attribute):
            visit(node.value)
            return
        elif isinstance(node, cst.Arg):
            visit(node.value)
            return
        for child in children(node):
            visit(child)

    visit(stmt)
    return out


def _shape_only_ids(stmt: cst.CSTNode, shape_only_attrs: set[str]) -> set[int]:
    """ids of Name nodes in ``stmt`` read only for shape, dtype or device.

    Those are: ``x.shape``/``x.dtype``/``x.device``/``x.size``/``x.ndim``; every argument of a mask
    builder (any callee whose name contains "mask") or of a rotary embedding (``self.rotary_emb`` or an
    attribute ``__init__`` builds from a ``*Rotary*`` class: it reads the input's dtype and device); the
    ``"inputs_embeds": inputs_embeds`` entry of a ``mask_kwargs`` dict.
    """
    allowed: set[int] = set()
    for n in walk(stmt):
        if isinstance(n, cst.Attribute) and n.attr.value in ("shape", "dtype", "device", "size", "ndim") and isinstance(n.value, cst.Name):
            allowed.add(id(n.value))
        elif isinstance(n, cst.Call):
            fname = dotted(n.func) or ""
            short = fname.rsplit(".", 1)[-1]
            if "mask" in short.lower() or "rotary" in short.lower() or self_attr(n.func) in shape_only_attrs:
                allowed.update(id(sub) for sub in walk(n) if isinstance(sub, cst.Name))
        elif isinstance(n, cst.DictElement) and m.matches(
            n, m.DictElement(key=m.SimpleString('"inputs_embeds"') | m.SimpleString("'inputs_embeds'"), value=m.Name())
        ):
            allowed.add(id(n.value))
    return allowed


def _check_stage_inputs(
    shape: ForwardShape,
    stmts: Sequence[cst.BaseStatement],
    line_of: Callable[[cst.CSTNode], int | None],
    shape_only_attrs: set[str],
) -> None:
    """Refuse forwards that feed the layers a tensor computed from the embeddings' values or ``input_ids``.

    On a later stage such a tensor would be computed from the received hidden states (or from no
    ``input_ids`` at all) instead of from the embedding: silently wrong, so decline. Tracks derivation
    through the prologue (``a = f(inputs_embeds)``, ``b = g(a)``, layer reads ``b``).
    """
    stream = shape.loop.stream
    tensors = {stream, "inputs_embeds"}
    guarded = set(shape.first_stage_only) | {shape.embed_index}
    taint: dict[str, tuple[str, int | None]] = {}
    for i in range(shape.body_start, shape.loop.index):
        if i in guarded:
            continue
        stmt = stmts[i]
        allowed = _shape_only_ids(stmt, shape_only_attrs)
        reads = {n.value for n in _reachable_reads(stmt) if id(n) not in allowed}
        why: str | None = None
        if "input_ids" in reads:
            why = "input_ids"
        elif reads & tensors:
            why = "the embeddings"
        else:
            for name in sorted(reads & taint.keys()):
                why = taint[name][0]
                break
        if why is None:
            continue
        for name in assigned_names(stmt) - tensors - {"input_ids"}:
            taint.setdefault(name, (why, line_of(stmt)))
    loop_names = read_names(shape.loop.node.body) - {shape.loop.layer_var, shape.loop.index_var}
    for name in sorted(loop_names & taint.keys()):
        why, line = taint[name]
        if why == "input_ids":
            raise ShapeError(f"`{name}` is computed from input_ids and used by the layers: a later stage has no input_ids", line)
        raise ShapeError(
            f"`{name}` is computed from the embeddings and passed to the layers: a later stage would compute it "
            "from the received hidden states instead",
            line,
        )


def _check_loop_carried(shape: ForwardShape, stmts: Sequence[cst.BaseStatement], line_of: Callable[[cst.CSTNode], int | None]) -> None:
    """Refuse loops that carry state from layer to layer besides the stream (it would not cross a stage).

    A name is carried when a statement of the loop body reads it before any earlier statement of the
    body binds it, while the body does bind it (``x = f(x)``, ``state = layer(h, state)``), or when the
    body binds it and the code after the loop reads it. ``all_*`` accumulators (HF's old
    ``output_hidden_states``/``output_attentions`` tuples) are allowed: they only feed optional outputs,
    which an adapted stage does not promise.
    """
    loop = shape.loop
    own = {loop.stream, loop.layer_var, loop.index_var}
    body = list(_body_statements(loop.node.body))
    body_assigned = assigned_names(loop.node.body) - own
    after: set[str] = set()
    for stmt in stmts[loop.index + 1 :]:
        after |= read_names(stmt)
    carried = _reads_before_binding(body, set(), body_assigned)
    carried += sorted(body_assigned & after)
    for name in carried:
        if name.startswith("all_"):
            continue
        raise ShapeError(
            f"the layer loop carries `{name}` from layer to layer besides `{loop.stream}`: a stage boundary "
            "would drop it",
            line_of(loop.node),
        )


def _reads_before_binding(stmts: Sequence[cst.BaseStatement], bound: set[str], watched: set[str]) -> list[str]:
    """Names in ``watched`` that ``stmts`` read before binding them, statement by statement, into branches."""
    found: list[str] = []
    bound = set(bound)
    for stmt in stmts:
        if isinstance(stmt, (cst.If, cst.While)):
            found += sorted((read_names(stmt.test) & watched) - bound)
            found += _reads_before_binding(_body_statements(stmt.body), bound, watched)
            orelse = stmt.orelse
            while orelse is not None:
                if isinstance(orelse, cst.If):
                    found += sorted((read_names(orelse.test) & watched) - bound)
                    found += _reads_before_binding(_body_statements(orelse.body), bound, watched)
                    orelse = orelse.orelse
                else:
                    found += _reads_before_binding(_body_statements(orelse.body), bound, watched)
                    orelse = None
        elif isinstance(stmt, cst.With):
            found += sorted((set().union(*(read_names(i.item) for i in stmt.items)) & watched) - bound)
            found += _reads_before_binding(_body_statements(stmt.body), bound | set().union(*(assigned_names(i) for i in stmt.items)), watched)
        else:
            found += sorted((read_names(stmt) & watched) - bound)
        bound |= assigned_names(stmt)
    return found


def _body_statements(body: cst.BaseSuite) -> Sequence[cst.BaseStatement]:
    if isinstance(body, cst.IndentedBlock):
        return body.body
    assert isinstance(body, cst.SimpleStatementSuite)
    return [cst.SimpleStatementLine(body=body.body)]


def _find_norm(epilogue: Sequence[cst.BaseStatement], stream: str, norm_attr: str | None) -> str | None:
    """The final norm: the first ``self.<attr>(...)`` called on the stream after the loop."""
    for stmt in epilogue:
        for n in walk(stmt):
            if not isinstance(n, cst.Call):
                continue
            attr = self_attr(n.func)
            if attr is None:
                continue
            if norm_attr is not None:
                if attr == norm_attr:
                    return attr
                continue
            if n.args and stream in names_in(n.args[0].value):
                return attr
    return None
