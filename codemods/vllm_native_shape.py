"""Read a vLLM model file's decoder stacks the way ``adapt_vllm_native`` needs them, without running it.

A *PP decoder* is a top-level class whose ``forward`` takes ``intermediate_tensors`` and runs one loop over
this stage's layers in one of the forms vLLM uses::

    for layer in islice(self.layers, self.start_layer, self.end_layer):              # or self.layers[s:e]
    for i, layer in enumerate(islice(...)[, start=self.start_layer]):                 # enumerate of either
    for i, layer in islice(enumerate(self.layers), self.start_layer, self.end_layer):
    for i in range(self.start_layer, self.end_layer):  ... self.layers[i](...) / layer = self.layers[i]

``forward_plan`` reads what the rewrite needs (the loop, its global index, the names sent to the next
stage, the returns, an existing PP=1-only capture to remove) or raises ``Decline`` with the construct and
the node it is about (the caller turns the node into a line). Pure libcst; imports no vLLM and no torch.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import is_docstring, names_in, own_scope, self_attr

FLAG = "supports_aux_hidden_states_over_pp"
CAPTURE_CALLS = ("_maybe_add_hidden_state",)
START, END = self_attr("start_layer"), self_attr("end_layer")
_ISLICE = m.Call(func=m.Name("islice") | m.Attribute(attr=m.Name("islice")),
                 args=[m.Arg(self_attr()), m.Arg(START), m.Arg(END)])
_SLICE = m.Subscript(value=self_attr(), slice=[m.SubscriptElement(m.Slice(lower=START, upper=END, step=None))])
STAGE_LAYERS = _ISLICE | _SLICE
_ENUMERATE = m.Call(func=m.Name("enumerate"), args=[m.Arg(STAGE_LAYERS, keyword=None), m.ZeroOrMore()])
_ISLICE_ENUM = m.Call(func=m.Name("islice") | m.Attribute(attr=m.Name("islice")),
                      args=[m.Arg(m.Call(func=m.Name("enumerate"), args=[m.Arg(self_attr())])), m.Arg(START), m.Arg(END)])
_RANGE = m.Call(func=m.Name("range"), args=[m.Arg(START), m.Arg(END)])
STAGE_LOOP_ITER = STAGE_LAYERS | _ENUMERATE | _ISLICE_ENUM | _RANGE
_INTERMEDIATE = m.Call(func=m.Name("IntermediateTensors") | m.Attribute(attr=m.Name("IntermediateTensors")))
RANK = m.Attribute(value=m.Call(func=m.Name("get_pp_group"), args=[]), attr=m.Name("is_first_rank") | m.Name("is_last_rank"))


class Decline(Exception):
    """The decoder cannot be rewritten safely: ``reason`` names the construct, ``node`` where it is."""

    def __init__(self, reason: str, node: cst.CSTNode) -> None:
        super().__init__(reason)
        self.reason, self.node = reason, node


def code_of(node: cst.CSTNode) -> str:
    """One-line source text of a node, for messages."""
    text = cst.Module([]).code_for_node(node).strip()
    text = " ".join(text.split())
    return text if len(text) <= 90 else text[:87] + "..."


def params_of(fn: cst.FunctionDef) -> set[str]:
    p = fn.params
    return {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}


def methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """The class's own methods by name (the last definition wins, as in Python)."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    return {s.name.value: s for s in body if isinstance(s, cst.FunctionDef)}


def own_flag(cls: cst.ClassDef) -> cst.SimpleStatementLine | None:
    """The class-body line ``supports_aux_hidden_states_over_pp = ...``, if the class sets it itself."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    for stmt in body:
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(FLAG))])
                                                      | m.AnnAssign(target=m.Name(FLAG))])):
            return cst.ensure_type(stmt, cst.SimpleStatementLine)
    return None


def stage_loops(fn: cst.FunctionDef) -> list[cst.For]:
    return [loop for loop in own_scope(fn).loops if m.matches(loop.iter, STAGE_LOOP_ITER)]


def is_pp_decoder(cls: cst.ClassDef) -> bool:
    """A forward that takes ``intermediate_tensors`` and loops over this stage's layers."""
    forward = methods(cls).get("forward")
    return forward is not None and "intermediate_tensors" in params_of(forward) and bool(stage_loops(forward))


@dataclass(frozen=True)
class Loop:
    """The layer loop, how to read its global index, and what to rewrite in its header."""

    node: cst.For
    layers_attr: str
    next_id: cst.BaseExpression  # the aux id after this iteration's layer: ``idx + 1`` with a global idx
    new_iter: cst.BaseExpression | None
    new_target: cst.BaseAssignTargetExpression | None


@dataclass(frozen=True)
class ForwardPlan:
    """Everything the rewrite of one decoder's forward needs."""

    loop: Loop
    hidden: str
    residual: str | None  # the name sent as ``"residual"`` to the next stage (None: no separate residual)
    residual_bound_before_loop: bool
    nonlast: tuple[cst.Return, ...]  # ``return IntermediateTensors({...})``
    last: tuple[cst.Return, ...]  # the last rank's ``return <hidden>``
    remove: tuple[cst.CSTNode, ...]  # the old PP=1-only capture: statements to drop
    aux: str  # the name of the local aux list
    has_rank_check: bool  # forward already asks get_pp_group() (else the rewrite adds the first-rank check)
    own_capture: bool = False  # the loop keeps the model's own after-layer capture (see _own_value_captures)
    before_capture: cst.If | None = None  # the model's own capture before each layer, kept and guarded ...
    end_capture: cst.If | None = None  # ... and its `self.end_layer` capture, moved before the non-last return
    stale_residual: bool = False  # the layers rebind the residual they are passed: the stream is hidden alone
    #: (layer variable, classes that rebind it): the layer classes disagree (picked by config: Molmo's
    #: norm_after), so each capture after a layer asks which class just ran
    stale_for: tuple[str, tuple[str, ...]] | None = None


def _loop(loop: cst.For, used: set[str]) -> Loop:
    it, target = loop.iter, loop.target
    one = cst.Integer("1")

    def plus_one(idx: str) -> cst.BaseExpression:
        return cst.BinaryOperation(cst.Name(idx), cst.Add(), one)

    if m.matches(it, _RANGE):
        if not isinstance(target, cst.Name):
            raise Decline(f"the range loop's target `{code_of(target)}` is not one name", loop)
        idx = target.value
        subs = m.findall(loop.body, m.Subscript(value=self_attr(), slice=[m.SubscriptElement(m.Index(m.Name(idx)))]))
        attrs = {cst.ensure_type(cst.ensure_type(s, cst.Subscript).value, cst.Attribute).attr.value for s in subs}
        if len(attrs) != 1:
            raise Decline(f"the range loop indexes {len(attrs)} module lists with `{idx}` (expected one: self.layers[{idx}])", loop)
        return Loop(loop, attrs.pop(), plus_one(idx), None, None)
    if m.matches(it, _ISLICE_ENUM):
        inner = cst.ensure_type(cst.ensure_type(it, cst.Call).args[0].value, cst.Call)
        attr = cst.ensure_type(inner.args[0].value, cst.Attribute).attr.value
        if not m.matches(target, m.Tuple([m.Element(m.Name()), m.Element()])):
            raise Decline(f"the islice(enumerate(...)) loop's target `{code_of(target)}` is not `index, layer`", loop)
        idx = cst.ensure_type(cst.ensure_type(target, cst.Tuple).elements[0].value, cst.Name).value
        return Loop(loop, attr, plus_one(idx), None, None)
    enumerated = m.matches(it, _ENUMERATE)
    args = cst.ensure_type(it, cst.Call).args if enumerated else ()
    stage_layers = args[0].value if enumerated else it
    attr = cst.ensure_type(m.findall(stage_layers, self_attr())[0], cst.Attribute).attr.value
    if not enumerated:
        idx = _fresh("idx", used)
        new_iter = cst.Call(cst.Name("enumerate"), [
            cst.Arg(stage_layers, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
            cst.Arg(START_EXPR(), keyword=cst.Name("start"), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))])
        new_target = cst.Tuple([cst.Element(cst.Name(idx), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                                cst.Element(target)], lpar=[], rpar=[])
        return Loop(loop, attr, plus_one(idx), new_iter, new_target)
    if not m.matches(target, m.Tuple([m.Element(m.Name()), m.Element()])):
        raise Decline(f"the enumerate loop's target `{code_of(target)}` is not `index, layer`", loop)
    idx = cst.ensure_type(cst.ensure_type(target, cst.Tuple).elements[0].value, cst.Name).value
    if len(args) == 1:  # counts from 0 on every stage: the global id is start_layer + idx + 1
        return Loop(loop, attr, cst.parse_expression(f"self.start_layer + {idx} + 1"), None, None)
    if len(args) == 2 and m.matches(args[1].value, START) and (args[1].keyword is None or args[1].keyword.value == "start"):
        return Loop(loop, attr, plus_one(idx), None, None)
    raise Decline(f"the enumerate loop counts from `{code_of(args[1].value)}`, not self.start_layer", loop)


def START_EXPR() -> cst.Attribute:  # noqa: N802 - reads like the constant it builds
    return cst.Attribute(cst.Name("self"), cst.Name("start_layer"))


def _fresh(base: str, used: set[str]) -> str:
    name, n = base, 1
    while name in used:
        name, n = f"{base}_{n}", n + 1
    return name


def sent_stream(body: Sequence[cst.BaseStatement], nonlast: Sequence[cst.Return]) -> tuple[str, str | None]:
    """The names every non-last-rank return sends as ``"hidden_states"`` and ``"residual"`` (None: no
    residual). ``Decline`` when a branch sends something else (a reshaped tensor, another residual):
    then no one capture is what the next stage receives on every branch."""
    sent_hidden: set[str] = set()
    sent_residual: set[str | None] = set()
    for ret in nonlast:
        entry = _dict_entries(ret, body)
        value = entry.get("hidden_states")
        if not isinstance(value, cst.Name):
            shown = code_of(value) if value is not None else "no hidden_states"
            raise Decline(f"a non-last-rank return sends `{shown}` as \"hidden_states\" (`{code_of(ret)}`), not the "
                          "stream the layers produce: a capture of that branch would not be what the next stage receives", ret)
        sent_hidden.add(value.value)
        res = entry.get("residual")
        if res is not None and not isinstance(res, cst.Name):
            raise Decline(f"a non-last-rank return sends `{code_of(res)}` as \"residual\", not a name the layers assign", ret)
        sent_residual.add(res.value if isinstance(res, cst.Name) else None)
    if len(sent_hidden) != 1 or len(sent_residual) != 1:
        raise Decline("the non-last-rank returns send different tensors (`"
                      + "`, `".join(code_of(r) for r in nonlast) + "`): the captured stream differs by branch", nonlast[1])
    return sent_hidden.pop(), sent_residual.pop()


def _dict_entries(ret: cst.Return, body: Sequence[cst.BaseStatement]) -> dict[str, cst.BaseExpression]:
    """The entries of ``IntermediateTensors({...})``, or of ``IntermediateTensors(name)`` where ``name`` is
    assigned (or annotated with) one dict literal in forward (later ``name[...] = ...`` / ``name.update(...)`` add more)."""
    call = cst.ensure_type(ret.value, cst.Call)
    table: cst.BaseExpression | None = call.args[0].value if len(call.args) == 1 and call.args[0].keyword is None else None
    if isinstance(table, cst.Name):
        bind = m.Assign(targets=[m.AssignTarget(m.Name(table.value))]) | m.AnnAssign(target=m.Name(table.value))
        found = [a for s in body for a in m.findall(s, bind)]
        value = getattr(found[0], "value", None) if len(found) == 1 else None
        table = value if isinstance(value, cst.BaseExpression) else None
    if not isinstance(table, cst.Dict):
        raise Decline(f"the non-last-rank return `{code_of(ret)}` is not IntermediateTensors({{...}}) with a dict "
                      "literal (or a name bound once to one)", ret)
    out: dict[str, cst.BaseExpression] = {}
    for el in table.elements:
        if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
            out[el.key.evaluated_value if isinstance(el.key.evaluated_value, str) else ""] = el.value
        elif isinstance(el, cst.StarredDictElement):
            if m.matches(el.value, m.Call(func=m.Attribute(attr=m.Name("pack_local_aux_hidden_states")))):
                raise Decline("already packs aux states (pack_local_aux_hidden_states) but the class does not set "
                              f"{FLAG} = True itself: review it and add that line", ret)
    return out


def _aux_names(fn: cst.FunctionDef) -> set[str]:
    """Names of lists an existing capture fills: the first argument of ``_maybe_add_hidden_state`` or the
    receiver of ``.append`` under an ``aux_hidden_state_layers`` check, plus ``aux_hidden_states``."""
    names = {"aux_hidden_states"} & names_in(fn)
    for call in m.findall(fn, m.Call(func=m.Attribute(attr=m.Name("_maybe_add_hidden_state")), args=[m.Arg(m.Name()), m.ZeroOrMore()])):
        names.add(cst.ensure_type(cst.ensure_type(call, cst.Call).args[0].value, cst.Name).value)
    for assign in m.findall(fn, m.Assign(targets=[m.AssignTarget(m.Name())],
                                         value=m.Call(func=m.Attribute(attr=m.Name("_maybe_add_hidden_state"))))):
        names.add(cst.ensure_type(cst.ensure_type(assign, cst.Assign).targets[0].target, cst.Name).value)
    return names


def _is_capture_stmt(stmt: cst.CSTNode, aux: set[str], hidden: str, residual: str | None) -> bool:
    """A statement of an existing PP=1-only capture, whose meaning the contract's capture replaces."""
    aux_m = m.OneOf(*(m.Name(n) for n in aux)) if aux else m.Name("aux_hidden_states")
    stream = {hidden} | ({residual} if residual else set())
    if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(aux_m)], value=m.List([]))
                                                  | m.AnnAssign(target=aux_m, value=m.List([]))])):
        return True
    capture = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_maybe_add_hidden_state")))
    if m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(capture) | m.Assign(targets=[m.AssignTarget(aux_m)], value=capture)])):
        return True
    if isinstance(stmt, cst.If) and stmt.orelse is None and "aux_hidden_state_layers" in names_in(stmt.test):
        return all(_is_append(s, aux_m, stream) for s in cst.ensure_type(stmt.body, cst.IndentedBlock).body)
    return False


def _is_append(stmt: cst.BaseStatement, aux_m: m.BaseMatcherNode, stream: set[str]) -> bool:
    """``aux.append(<hidden/residual arithmetic>)`` or ``tmp = <that>`` (a value the contract captures too)."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    value: cst.BaseExpression
    if m.matches(small, m.Expr(m.Call(func=m.Attribute(value=aux_m, attr=m.Name("append")), args=[m.Arg()]))):
        value = cst.ensure_type(cst.ensure_type(small, cst.Expr).value, cst.Call).args[0].value
    elif m.matches(small, m.Assign(targets=[m.AssignTarget(m.Name())])):
        value = cst.ensure_type(small, cst.Assign).value
    else:
        return False
    return _is_stream_value(value, stream | {n.value for n in _tmp_names(stmt)})


def _tmp_names(stmt: cst.SimpleStatementLine) -> list[cst.Name]:
    small = stmt.body[0]
    return [t.target for t in small.targets if isinstance(t.target, cst.Name)] if isinstance(small, cst.Assign) else []


def _is_stream_value(value: cst.BaseExpression, stream: set[str]) -> bool:
    if isinstance(value, cst.Name):
        return value.value in stream
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
        return _is_stream_value(value.left, stream) and _is_stream_value(value.right, stream)
    if isinstance(value, cst.IfExp):  # `hidden if residual is None else hidden + residual`
        return _is_stream_value(value.body, stream) and _is_stream_value(value.orelse, stream)
    return False


def is_sequence_parallel_epilogue(stmt: cst.CSTNode) -> bool:
    """``if self.use_sequence_parallel: ...`` after the loop: gathers the last rank's shards, aux list
    included. vLLM does not run sequence parallelism with PP (its kimi_k3 asserts "Currently, SP is not
    supported with PP"), so there the list holds only this stage's own states and the block stays as is."""
    return isinstance(stmt, cst.If) and any("sequence_parallel" in n for n in names_in(stmt.test))


def _is_aux_return_guard(stmt: cst.CSTNode, aux: set[str]) -> bool:
    """``if len(aux) > 0: return hidden, aux`` / ``if aux: return hidden, aux`` (the PP=1-only last return)."""
    if not isinstance(stmt, cst.If) or stmt.orelse is not None or not (names_in(stmt.test) & aux):
        return False
    body = cst.ensure_type(stmt.body, cst.IndentedBlock).body if isinstance(stmt.body, cst.IndentedBlock) else ()
    return len(body) == 1 and m.matches(body[0], m.SimpleStatementLine(body=[m.Return(m.Tuple([m.Element(), m.Element(m.OneOf(*(m.Name(n) for n in aux)))]))]))


def forward_plan(cls: cst.ClassDef, line_of: Callable[[cst.CSTNode], int],
                 lookup: ClassLookup | None = None) -> ForwardPlan:
    """Read the decoder's forward (see the module docstring); ``Decline`` for what it cannot rewrite.
    ``lookup`` finds the layer classes (see ``residual_read``): with it, a residual the layers hand on but
    the next stage is not sent is accepted where every layer rebinds it before reading it (Gemma4)."""
    fn = methods(cls)["forward"]
    loops = stage_loops(fn)
    if len(loops) > 1:
        loops = _running_loops(fn, loops, line_of)
    loop = loops[0]
    body = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
    if not any(s is loop for s in body):
        try:
            runs = _layer_call_at(loop, _loop(loop, names_in(fn))) is not None
        except Decline:
            runs = True
        if not runs:
            raise Decline(f"forward's only loop over this stage's layers (`for ... in {code_of(loop.iter)}`, nested "
                          "in another statement) does not call them: the layers run elsewhere (a helper method), "
                          "which this rewrite does not follow", loop)
        outer = next((st for st in body if any(x is loop for x in m.findall(st, m.For()))), None)
        if isinstance(outer, (cst.For, cst.While)):
            head = f"for ... in {code_of(outer.iter)}" if isinstance(outer, cst.For) else f"while {code_of(outer.test)}"
            raise Decline(f"the layer loop `for ... in {code_of(loop.iter)}` runs inside `{head}`: every layer "
                          "runs once per outer iteration, so a layer boundary (an aux id) names several states and no "
                          "one capture is the stream there", loop)
        raise Decline(f"the layer loop `for ... in {code_of(loop.iter)}` is nested inside another statement "
                      "(only a loop at forward's top level is understood)", loop)
    if loop.orelse is not None:
        raise Decline("the layer loop has an else branch", loop)
    scope = own_scope(fn)
    jumps = _loop_jumps(loop)
    if jumps:
        raise Decline(f"the layer loop uses `{code_of(jumps[0])}`: a layer skipped or left early would skip its capture", jumps[0])
    yields = [j for j in scope.jumps if isinstance(j, cst.Yield)]
    if yields:
        raise Decline("forward yields: only a function that returns is understood", yields[0])
    used = names_in(fn)
    parsed = _loop(loop, used)
    loop_end = line_of(loop) + code_of_lines(loop)
    nonlast, last = [], []
    never_drafted = _fast_prefill_returns(cls, body, loop)
    for ret in scope.returns:
        if id(ret) in never_drafted:
            continue  # left as it is: that path runs without any drafter
        if line_of(ret) < line_of(loop):
            owner = next((s for s in body if any(x is ret for x in m.findall(s, m.Return()))), None)
            where = f" in `{code_of(owner.test)}`" if isinstance(owner, cst.If) else ""
            raise Decline(f"forward returns before its layer loop (`{code_of(ret)}`{where}): that path would hand "
                          "on no aux states and pack none for the next rank", ret)
        if line_of(ret) < loop_end:
            raise Decline(f"forward returns inside its layer loop (`{code_of(ret)}`)", ret)
        if m.matches(ret.value, _INTERMEDIATE):
            nonlast.append(ret)
        elif ret.value is None:
            raise Decline("forward has a bare `return`: the last rank must return the hidden states", ret)
        else:
            last.append(ret)
    if not nonlast:
        raise Decline("forward never returns IntermediateTensors({...}) for non-last ranks: it does not support "
                      "pipeline parallelism", fn)
    hidden, residual = sent_stream(body, nonlast)
    aux = _aux_names(fn)
    remove: list[cst.CSTNode] = []
    for stmt in [*body, *cst.ensure_type(loop.body, cst.IndentedBlock).body]:
        if stmt is loop:
            continue
        if _is_capture_stmt(stmt, aux, hidden, residual) or _is_aux_return_guard(stmt, aux):
            remove.append(stmt)
    removed = {id(n) for n in remove}
    own = _own_value_captures(loop, parsed, aux, removed)
    ahead, end = _before_layer_captures(body, loop, parsed, aux, removed) if not own else (None, None)
    if ahead is not None and end is not None:
        own = [ahead, end]
        remove.append(end)
        removed.add(id(end))
    if not own:
        stale = _unsent_stale_residual(cls, fn, loop, parsed, hidden, residual, lookup)
        _check_layer_call(fn, loop, hidden, residual or stale)
        _check_after_loop(fn, body, loop, hidden, residual, nonlast)
    kept = {id(s) for s in own}
    at = next(i for i, s in enumerate(body) if s is loop)
    epilogue = {id(s) for s in body[at + 1:] if is_sequence_parallel_epilogue(s)}
    for name in aux | {"aux_hidden_state_layers", "_maybe_add_hidden_state"}:
        for stmt in [*body, *cst.ensure_type(loop.body, cst.IndentedBlock).body]:
            if stmt is loop or id(stmt) in removed or id(stmt) in kept or (id(stmt) in epilogue and name in aux):
                continue
            if own and name == "aux_hidden_state_layers" and not (names_in(stmt) & aux):
                continue  # reads the ids only (e.g. reuses the last capture's reconstruction), captures nothing
            if name in names_in(stmt):
                gathers = sorted(n for n in names_in(stmt) if "gather" in n)
                if gathers:
                    raise Decline(f"`{code_of(stmt)}`: the existing capture gathers sequence-parallel shards "
                                  f"({', '.join(gathers)}) before keeping a state; the contract's capture of the "
                                  "stage's own tensors would keep shards", stmt)
                raise Decline(f"`{code_of(stmt)}` uses {name} in a way the rewrite does not understand (it "
                              "captures something other than hidden_states (+ residual) at a layer boundary)", stmt)
    for ret in last:
        if isinstance(ret.value, cst.Tuple) and not any(r is ret for g in remove for r in m.findall(g, m.Return())):
            raise Decline(f"the last rank already returns a tuple (`{code_of(ret)}`)", ret)
    last = [r for r in last if not any(r is x for g in remove for x in m.findall(g, m.Return()))]
    if not last:
        raise Decline("forward has no last-rank return of the hidden states", fn)
    for ret in last:
        _check_return_placement(fn, ret)
    before = body[: next(i for i, s in enumerate(body) if s is loop)]
    bound = residual is not None and any(residual in _bound_names(s) for s in before)
    rank_check = bool(m.findall(fn, RANK))
    aux_name = "aux_hidden_states" if "aux_hidden_states" in aux or "aux_hidden_states" not in used else _fresh("aux_hidden_states", used)
    if own:
        aux_name = next(iter(aux))
    return ForwardPlan(parsed, hidden, residual, bound, tuple(nonlast), tuple(last), tuple(remove), aux_name,
                       rank_check, bool(own) and ahead is None, ahead, end)


#: A cache option vLLM refuses together with every EAGLE-family method (``VllmConfig.__post_init__``:
#: "Fast prefill optimization for KV sharing is not compatible with EAGLE"): a forward path taken only
#: under it never runs with a drafter, so it captures and relays nothing.
NO_DRAFTER_OPTION = "kv_sharing_fast_prefill"


def _fast_prefill_returns(cls: cst.ClassDef, body: Sequence[cst.BaseStatement], loop: cst.For) -> set[int]:
    """Returns inside ``if self.<flag>:`` branches before the layer loop, where ``__init__`` sets
    ``self.<flag>`` from ``NO_DRAFTER_OPTION`` (Gemma4's fast-prefill forward)."""
    init = methods(cls).get("__init__")
    if init is None:
        return set()
    flags = {cst.ensure_type(cst.ensure_type(a, cst.Assign).targets[0].target, cst.Attribute).attr.value
             for a in m.findall(init, m.Assign(targets=[m.AssignTarget(self_attr())]))
             if NO_DRAFTER_OPTION in names_in(cst.ensure_type(a, cst.Assign).value)}
    out: set[int] = set()
    for stmt in body:
        if stmt is loop:
            break
        if isinstance(stmt, cst.If) and stmt.orelse is None and flags and m.matches(
                stmt.test, m.Attribute(value=m.Name("self"), attr=m.OneOf(*(m.Name(f) for f in flags)))):
            out |= {id(r) for r in m.findall(stmt.body, m.Return())}
    return out


def _layer_call_at(loop: cst.For, parsed: Loop) -> int | None:
    """Index, in the loop body, of the statement that calls the layer (``layer(...)`` / ``self.layers[i](...)``)."""
    target = loop.target
    names = {cst.ensure_type(target.elements[-1].value, cst.Name).value} if (
        isinstance(target, cst.Tuple) and isinstance(target.elements[-1].value, cst.Name)) else set()
    if isinstance(target, cst.Name) and not m.matches(loop.iter, _RANGE):  # `for layer in islice(...)`
        names.add(target.value)
    body = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    indexed = m.Subscript(value=self_attr(parsed.layers_attr))
    for stmt in body:  # `layer = self.layers[i]` in a range loop
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=indexed)])):
            names.add(cst.ensure_type(cst.ensure_type(stmt.body[0], cst.Assign).targets[0].target, cst.Name).value)  # type: ignore[attr-defined]
    call = m.Call(func=m.OneOf(*(m.Name(n) for n in names)) | indexed) if names else m.Call(func=indexed)
    for i, stmt in enumerate(body):
        if m.findall(stmt, m.Assign(value=call)):
            return i
    return None


def _before_layer_captures(body: list[cst.BaseStatement], loop: cst.For, parsed: Loop, aux: set[str],
                           removed: set[int]) -> tuple[cst.If | None, cst.If | None]:
    """The model's own capture *before* each layer (``if idx in self.aux_hidden_state_layers:`` ahead of
    the layer call: id ``idx`` is what enters layer ``idx``) and its last id after the loop (``if
    self.end_layer in self.aux_hidden_state_layers:``), e.g. DeepSeek-V2's, which all-gathers
    sequence-parallel shards. Kept as the model computes them; the rewrite guards id ``start_layer`` to
    the first rank and moves the ``end_layer`` capture before the non-last return, so every rank
    captures exactly its own ids."""
    if len(aux) != 1 or not m.matches(parsed.next_id, m.BinaryOperation(left=m.Name(), operator=m.Add(), right=m.Integer("1"))):
        return None, None
    idx = cst.ensure_type(cst.ensure_type(parsed.next_id, cst.BinaryOperation).left, cst.Name).value
    layer_at = _layer_call_at(loop, parsed)
    if layer_at is None:
        return None, None
    layers = m.Attribute(value=m.Name("self"), attr=m.Name("aux_hidden_state_layers"))
    inside = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    before = [s for s in inside[:layer_at] if id(s) not in removed and isinstance(s, cst.If) and s.orelse is None
              and m.matches(s.test, m.Comparison(left=m.Name(idx), comparisons=[m.ComparisonTarget(m.In(), layers)]))
              and names_in(s.body) & aux]
    at = next(i for i, s in enumerate(body) if s is loop)
    end = [s for s in body[at + 1:] if isinstance(s, cst.If) and s.orelse is None and names_in(s.body) & aux
           and m.matches(s.test, m.Comparison(left=self_attr("end_layer"), comparisons=[m.ComparisonTarget(m.In(), layers)]))]
    if len(before) != 1 or len(end) != 1 or idx in names_in(before[0].body):
        return None, None
    return before[0], end[0]


def _own_value_captures(loop: cst.For, parsed: Loop, aux: set[str], removed: set[int]) -> list[cst.If]:
    """The loop's own captures that compute a model-specific value after the layer, kept as they are.

    ``if (idx + 1) in self.aux_hidden_state_layers: <value>; aux.append(<value>)`` after the layer call,
    with the loop's global index: the id convention is already the contract's, and the value (e.g.
    DeepSeek-V4's reconstructed mHC stream averaged over its channels) is the model's to define. vLLM's
    own PP-correct DeepSeek-V4 keeps exactly such a capture and captures no id ``start_layer``: the
    rewrite then adds collect / pack / the last rank's concatenation around it, and no first-rank capture.
    """
    if len(aux) != 1 or not m.matches(parsed.next_id, m.BinaryOperation(left=m.Name(), operator=m.Add(), right=m.Integer("1"))):
        return []
    idx = cst.ensure_type(cst.ensure_type(parsed.next_id, cst.BinaryOperation).left, cst.Name).value
    body = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    test = m.Comparison(left=m.BinaryOperation(left=m.Name(idx), operator=m.Add(), right=m.Integer("1")),
                        comparisons=[m.ComparisonTarget(m.In(), m.Attribute(value=m.Name("self"),
                                                                               attr=m.Name("aux_hidden_state_layers")))])
    out: list[cst.If] = []
    seen_call = False
    for stmt in body:
        if id(stmt) in removed:
            continue
        if not seen_call and m.findall(stmt, m.Assign(targets=[m.AssignTarget(m.Tuple() | m.Name())], value=m.Call())):
            seen_call = True
            continue
        if isinstance(stmt, cst.If) and names_in(stmt) & aux:
            if not (seen_call and m.matches(stmt.test, test) and stmt.orelse is None):
                return []
            out.append(stmt)
    return out


def code_of_lines(node: cst.CSTNode) -> int:
    return cst.Module([]).code_for_node(node).strip("\n").count("\n")


def _bound_names(stmt: cst.CSTNode) -> set[str]:
    out: set[str] = set()
    for t in m.findall(stmt, m.AssignTarget() | m.AnnAssign()):
        target = t.target  # type: ignore[attr-defined]
        out |= {n.value for n in m.findall(target, m.Name())}
    return out


def _check_layer_call(fn: cst.FunctionDef, loop: cst.For, hidden: str, residual: str | None) -> None:
    """Every assignment in the loop that binds the hidden stream binds only it and the residual; anything
    else a layer hands to the next layer (deferred adds, recurrent state) is not in the captured stream."""
    body = cst.ensure_type(loop.body, cst.IndentedBlock)
    read = _read_names(fn)
    for assign in m.findall(body, m.Assign()):
        for t in cst.ensure_type(assign, cst.Assign).targets:
            if not isinstance(t.target, (cst.Tuple, cst.List)):
                continue
            names = [e.value for e in t.target.elements]
            plain = [n.value for n in names if isinstance(n, cst.Name)]
            if hidden not in plain:
                continue
            extra = [n for n in plain if n not in (hidden, residual, "_") and n in read]
            if extra or len(plain) != len(names):
                carried = ", ".join(f"`{n}`" for n in extra) if extra else f"`{code_of(t.target)}`"
                sent = f"`{hidden}`" + (f" and `{residual}`" if residual else "")
                raise Decline(f"the layer call assigns `{code_of(t.target)}`: {carried} "
                              f"{'is' if len(extra) == 1 else 'are'} carried from layer to layer but the next stage "
                              f"receives only {sent}, so the stream at a layer boundary is not hidden_states "
                              "(+ residual)", assign)
    if hidden not in {n.value for t in m.findall(body, m.AssignTarget()) for n in m.findall(t, m.Name())}:
        raise Decline(f"the layer loop never assigns `{hidden}` (the tensor sent to the next stage)", loop)


def _running_loops(fn: cst.FunctionDef, loops: list[cst.For], line_of: Callable[[cst.CSTNode], int]) -> list[cst.For]:
    """The one loop over this stage's layers that calls them; the others only visit the layer modules
    (DeepSeek-V4.1's engram ``prepare_embeddings`` before the real loop) and stay as they are. ``Decline``
    when more than one calls them (one loop per config branch, each with its own returns)."""
    used = names_in(fn)

    def calls(loop: cst.For) -> bool:
        try:
            return _layer_call_at(loop, _loop(loop, used)) is not None
        except Decline:
            return True

    running = [lp for lp in loops if calls(lp)]
    if len(running) == 1:
        return running
    lines = ", ".join(str(line_of(lp)) for lp in running or loops)
    raise Decline(f"forward has {len(running) or len(loops)} loops that run this stage's layers (lines {lines}), "
                  "e.g. one per config branch with its own returns; the rewrite handles one", (running or loops)[1])


def _unsent_stale_residual(cls: cst.ClassDef, fn: cst.FunctionDef, loop: cst.For, parsed: Loop, hidden: str,
                           residual: str | None, lookup: ClassLookup | None) -> str | None:
    """The name the layer call binds after ``hidden`` when the next stage is sent no residual and every
    layer class rebinds that parameter before reading it (``residual = hidden_states`` first; Gemma4's
    layers return ``(hidden_states, None)``): nothing is carried in it, so the stream is ``hidden`` alone."""
    if residual is not None or lookup is None:
        return None
    at = _layer_call_at(loop, parsed)
    inside = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    if at is None:
        return None
    for assign in m.findall(inside[at], m.Assign(targets=[m.AssignTarget(m.Tuple())], value=m.Call())):
        names = [e.value for e in cst.ensure_type(cst.ensure_type(assign, cst.Assign).targets[0].target, cst.Tuple).elements]
        if len(names) == 2 and m.matches(names[0], m.Name(hidden)) and isinstance(names[1], cst.Name):
            carried = names[1].value
            plan = ForwardPlan(parsed, hidden, carried, False, (), (), (), "", False)
            try:
                return None if residual_read(cls, plan, lookup) is True else carried
            except Decline:  # the layer classes cannot be read: `carried` may carry state (declined below)
                return None
    return None


def _check_after_loop(fn: cst.FunctionDef, body: list[cst.BaseStatement], loop: cst.For, hidden: str,
                      residual: str | None, nonlast: list[cst.Return]) -> None:
    """Nothing between the loop and a non-last return changes what is sent: the last layer's capture must
    be what the next stage receives."""
    at = next(i for i, s in enumerate(body) if s is loop)
    stream = {hidden} | ({residual} if residual else set())
    for stmt in body[at + 1:]:
        if any(r is x for r in nonlast for x in m.findall(stmt, m.Return())):
            inner = stmt.body.body if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock) else ()
            for s in inner:
                if _bound_names(s) & stream:
                    raise Decline(f"`{code_of(s)}` changes `{'/'.join(sorted(_bound_names(s) & stream))}` after the "
                                  "layer loop, before the non-last-rank return: the stream sent on is not the last "
                                  "layer's output", s)
            return
        if _bound_names(stmt) & stream:
            raise Decline(f"`{code_of(stmt)}` changes the stream after the layer loop, before the non-last-rank return", stmt)


def _check_return_placement(fn: cst.FunctionDef, ret: cst.Return) -> None:
    for line in m.findall(fn, m.SimpleStatementSuite()):
        if any(x is ret for x in m.findall(line, m.Return())):
            raise Decline(f"the last-rank return `{code_of(ret)}` is on one line with its `if`/`else`", ret)
    for line in m.findall(fn, m.SimpleStatementLine()):
        if any(x is ret for x in cst.ensure_type(line, cst.SimpleStatementLine).body) and len(line.body) > 1:  # type: ignore[attr-defined]
            raise Decline(f"the last-rank return `{code_of(ret)}` shares its line with other statements", ret)


class _Reads(cst.CSTVisitor):
    """Names read (not only assigned) in a subtree."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.targets: set[int] = set()

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.targets |= {id(n) for n in m.findall(node.target, m.Name())
                         if not any(n is x for a in m.findall(node.target, m.Attribute() | m.Subscript())
                                    for x in m.findall(a, m.Name()))}

    def visit_Name(self, node: cst.Name) -> None:
        if id(node) not in self.targets:
            self.names.add(node.value)


def _read_names(fn: cst.FunctionDef) -> set[str]:
    reads = _Reads()
    fn.body.visit(reads)
    return reads.names


class _Jumps(cst.CSTVisitor):
    """``break``/``continue`` that leave or skip an iteration of the loop visited (not of nested loops)."""

    def __init__(self, loop: cst.For) -> None:
        self.loop = loop
        self.found: list[cst.CSTNode] = []

    def visit_For(self, node: cst.For) -> bool:
        return node is self.loop

    def visit_While(self, node: cst.While) -> bool:
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_Break(self, node: cst.Break) -> None:
        self.found.append(node)

    def visit_Continue(self, node: cst.Continue) -> None:
        self.found.append(node)


def _loop_jumps(loop: cst.For) -> list[cst.CSTNode]:
    visitor = _Jumps(loop)
    loop.visit(visitor)
    return visitor.found


# ------------------------------------------------------------------ does a layer read the residual?
_NOT_LAYERS = frozenset({"make_layers", "maybe_prefix", "extract_layer_index", "PPMissingLayer", *dir(builtins)})
# name, the class whose module sees it -> the classes it means there (one; several for a module-level
# table such as Jamba's ALL_DECODER_LAYER_TYPES = {"attention": A, "mamba": B}), each with the lookup of
# its own module; [] where the source does not say
ClassLookup = Callable[[str, "cst.ClassDef | None"], "list[tuple[cst.ClassDef, ClassLookup]]"]


def residual_read(cls: cst.ClassDef, plan: ForwardPlan, lookup: ClassLookup,
                  own_classes: set[str] | None = None) -> bool | tuple[str, tuple[str, ...]]:
    """Whether the decoder's layers read the residual the loop passes them.

    False where every layer class's ``forward`` rebinds that parameter before reading it (post-norm and
    parallel blocks: ``residual = hidden_states`` first): the ``residual`` they return is stale and the
    stream at a layer boundary is the returned hidden states alone. ``lookup(name, context)`` finds a
    class by name as the module that defines ``context`` sees it (its own classes and its imports), with
    the lookup that applies inside the class found. ``Decline`` where the layer classes or their
    ``forward`` cannot be found from the source, or where they disagree. Given ``own_classes`` (the file's
    top-level class names), disagreeing classes that ``isinstance`` on the loop's layer variable tells
    apart are answered ``(layer variable, the classes that rebind it)`` instead (Molmo)."""
    assert plan.residual is not None
    loop = plan.loop.node
    at = _layer_call_at(loop, plan.loop)
    inside = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    calls = [] if at is None else [cst.ensure_type(cst.ensure_type(a, cst.Assign).value, cst.Call)
                                   for a in m.findall(inside[at], m.Assign(value=m.Call()))]
    if not calls:
        raise Decline("cannot find the layer call in the layer loop, so whether a layer reads the residual it is "
                      "passed cannot be told", loop)
    call = calls[0]
    slot: int | str | None = None
    for i, arg in enumerate(call.args):
        if m.matches(arg.value, m.Name(plan.residual)):
            slot = arg.keyword.value if arg.keyword is not None else i
    if slot is None:  # the layers are not passed the residual: they cannot read it
        return False
    found = _layer_classes(cls, plan.loop.layers_attr, lookup)
    if isinstance(found, cst.CSTNode):
        built = f"`{code_of(found)}`" if not isinstance(found, cst.Name) else f"{found.value} of {cls.name.value} or a base"
        raise Decline(f"the layer classes of self.{plan.loop.layers_attr} cannot be found from the source (built by "
                      f"{built}), so whether a layer reads the residual it returns cannot be told: "
                      "the stream at a layer boundary is hidden_states + residual only if it does", call)
    verdicts: dict[str, bool] = {}
    for layer, layer_lookup in found:
        verdicts[layer.name.value] = _forward_reads(layer, layer_lookup, slot, plan.residual, call)
    if len(set(verdicts.values())) > 1 and own_classes is not None:
        stale = tuple(n for n, v in verdicts.items() if not v)
        if _told_apart(call, found, verdicts, own_classes):
            return cst.ensure_type(call.func, cst.Name).value, stale
    if len(set(verdicts.values())) > 1:
        reads = ", ".join(n for n, v in verdicts.items() if v)
        not_reads = ", ".join(n for n, v in verdicts.items() if not v)
        raise Decline(f"the layer classes disagree on the residual: {reads} read it, {not_reads} rebind it before "
                      "reading it, so whether the stream at a layer boundary includes the residual depends on the "
                      "layer (or the config) and no one capture is right", call)
    return next(iter(verdicts.values()))


def _told_apart(call: cst.Call, found: Sequence[tuple[cst.ClassDef, ClassLookup]], verdicts: dict[str, bool],
                own_classes: set[str]) -> bool:
    """``isinstance(<layer>, Stale...)`` is exactly "this layer rebinds the residual": the layer is called
    through a plain name, every class is the file's own (its name is bound in the module), and no class
    that reads the residual derives from one that rebinds it."""
    if not isinstance(call.func, cst.Name) or not set(verdicts) <= own_classes:
        return False
    stale = {n for n, v in verdicts.items() if not v}
    by_name = {c.name.value: c for c, _ in found}
    for name, reads in verdicts.items():
        if reads and _ancestors(by_name[name], by_name) & stale:
            return False
    return True


def _ancestors(cls: cst.ClassDef, by_name: dict[str, cst.ClassDef]) -> set[str]:
    out: set[str] = set()
    todo = [cls]
    while todo:
        for arg in todo.pop().bases:
            if isinstance(arg.value, cst.Name) and arg.value.value not in out:
                out.add(arg.value.value)
                if arg.value.value in by_name:
                    todo.append(by_name[arg.value.value])
    return out


def _forward_reads(layer: cst.ClassDef, lookup: ClassLookup, slot: int | str, residual: str, call: cst.Call) -> bool:
    seen = 0
    while "forward" not in methods(layer):
        bases = [a.value for a in layer.bases if a.keyword is None and isinstance(a.value, cst.Name)]
        nxt = None
        for base in bases:
            hits = lookup(base.value, layer)
            nxt = hits[0] if len(hits) == 1 else None
            if nxt is not None:
                break
        seen += 1
        if nxt is None or seen > 5:
            raise Decline(f"{layer.name.value} defines no forward and its bases cannot be found from the source, so "
                          "whether a layer reads the residual cannot be told", call)
        layer, lookup = nxt
    fn = methods(layer)["forward"]
    p = fn.params
    positional = [x.name.value for x in (*p.posonly_params, *p.params)][1:]  # without self
    if isinstance(slot, int):
        name = positional[slot] if slot < len(positional) else None
    else:
        name = slot if slot in params_of(fn) else None
    if name is None:
        raise Decline(f"{layer.name.value}.forward takes no parameter for the residual the loop passes "
                      f"(`{code_of(call)}`), so whether it reads it cannot be told", call)
    body = cst.ensure_type(fn.body, cst.IndentedBlock).body
    for stmt in body:
        if is_docstring(stmt) or name not in names_in(stmt):
            continue
        if (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)
                and any(m.matches(t.target, m.Name(name)) for t in stmt.body[0].targets)
                and name not in names_in(stmt.body[0].value)):
            return False  # rebound from something else before any read
        return True
    return False  # never used


def _layer_classes(cls: cst.ClassDef, attr: str, lookup: ClassLookup
                   ) -> list[tuple[cst.ClassDef, ClassLookup]] | cst.CSTNode:
    """The classes ``cls.__init__`` builds into ``self.<attr>`` (following an inherited ``__init__``), or
    the node that builds them where they cannot be found."""
    owner, own_lookup = cls, lookup
    overrides: dict[str, tuple[cst.ClassDef, ClassLookup]] = {}  # parameter -> class a subclass passes
    target = self_attr(attr)
    for _ in range(6):
        init = methods(owner).get("__init__")
        built: list[cst.BaseExpression] = []
        if init is not None:
            built = [cst.ensure_type(a, cst.Assign).value for a in m.findall(init, m.Assign())
                     if any(m.findall(t.target, target) for t in cst.ensure_type(a, cst.Assign).targets)]
            if built:
                break
            for other in methods(owner).values():  # built by a helper __init__ calls (MiniCPM's _init_layers)
                found_here = [cst.ensure_type(a, cst.Assign).value for a in m.findall(other, m.Assign())
                              if any(m.findall(t.target, target) for t in cst.ensure_type(a, cst.Assign).targets)]
                if found_here and m.findall(init, m.Call(func=self_attr(other.name.value))):
                    init, built = other, found_here
                    break
            if built:
                break
            sup = m.findall(init, m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__"))))
            if not sup:
                return init.name
            p = init.params
            defaults = {x.name.value: x.default for x in (*p.params, *p.kwonly_params) if x.default is not None}
            passed: dict[str, tuple[cst.ClassDef, ClassLookup]] = {}
            for arg in cst.ensure_type(sup[0], cst.Call).args:
                if arg.keyword is None or not isinstance(arg.value, cst.Name):
                    continue
                name = arg.value.value
                if name in overrides:
                    passed[arg.keyword.value] = overrides[name]
                    continue
                default = defaults.get(name)
                ref = default.value if isinstance(default, cst.Name) else name
                found = own_lookup(ref, owner)
                if len(found) == 1:
                    passed[arg.keyword.value] = found[0]
            overrides = passed
        bases = [a.value for a in owner.bases if a.keyword is None and isinstance(a.value, cst.Name)]
        nxt = next((x[0] for x in (own_lookup(b.value, owner) for b in bases) if len(x) == 1), None)
        if nxt is None:
            return init.name if init is not None else cls.name
        owner, own_lookup = nxt
    if len(built) != 1 or init is None:
        return cls.name
    value = built[0]
    locals_ = {s.name.value: s for s in m.findall(init.body, m.FunctionDef()) if isinstance(s, cst.FunctionDef)}
    assigned = {cst.ensure_type(cst.ensure_type(a, cst.Assign).targets[0].target, cst.Name).value: cst.ensure_type(a, cst.Assign).value
                for a in m.findall(init.body, m.Assign(targets=[m.AssignTarget(m.Name())]))}
    p = init.params
    defaults = {x.name.value: x.default for x in (*p.params, *p.kwonly_params) if x.default is not None}
    out: list[tuple[cst.ClassDef, ClassLookup]] = []

    def resolve(name: str, depth: int) -> bool:
        if depth > 4:
            return False
        if name in overrides:
            out.append(overrides[name])
            return True
        if name in defaults:
            d = defaults[name]
            return isinstance(d, cst.Name) and resolve(d.value, depth + 1)
        if name in locals_:
            return scan(locals_[name].body, depth + 1)
        if name in assigned:  # `layer_class = A if c else B`, `= TABLE[key]`, `= types or TABLE`, `= types[key]`
            names = _class_refs(assigned[name]) - {name}
            none_default = {n for n, d in defaults.items() if m.matches(d, m.Name("None"))}
            upper = [n for n in names if n[:1].isupper() and n not in ("None", "True", "False")]
            chained = [n for n in names - set(upper) - none_default if n in assigned or n in locals_ or n in defaults]
            if not all(resolve(n, depth + 1) for n in upper):
                return False
            got = bool(upper)
            for n in chained:
                got = resolve(n, depth + 1) or got
            return got
        found = own_lookup(name, owner)
        out.extend(found)
        return bool(found)

    def scan(node: cst.CSTNode, depth: int) -> bool:
        ok = False
        for ref in {n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name)} & set(locals_):
            if not m.findall(node, m.Call(func=m.Name(ref))):  # a local builder passed by name (make_layers(n, get_layer))
                if not resolve(ref, depth):
                    return False
                ok = True
        for c in m.findall(node, m.Call()):
            func = cst.ensure_type(c, cst.Call).func
            if isinstance(func, cst.Name):
                if func.value in _NOT_LAYERS:
                    continue
                if not resolve(func.value, depth):
                    return False
                ok = True
            elif m.matches(func, m.Attribute(value=m.Name("self"))):
                ref = cst.ensure_type(func, cst.Attribute).attr.value
                value = _class_attr(owner, ref)
                if not isinstance(value, cst.Name) or not resolve(value.value, depth + 1):
                    return False
                ok = True
        return ok

    return out if scan(value, 0) and out else value


def _class_attr(cls: cst.ClassDef, name: str) -> cst.BaseExpression | None:
    """The value of ``name = ...`` / ``name: T = ...`` in the class body itself."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    for stmt in body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Assign) and any(m.matches(t.target, m.Name(name)) for t in small.targets):
                return small.value
            if isinstance(small, cst.AnnAssign) and m.matches(small.target, m.Name(name)):
                return small.value
    return None


def _class_refs(expr: cst.BaseExpression) -> set[str]:
    """Names in the positions where an expression's value *is* that name: ``A``, ``A if c else B``,
    ``x or A``, ``A[key]`` (a table of classes); not call arguments, annotations or attribute bases."""
    if isinstance(expr, cst.Name):
        return {expr.value}
    if isinstance(expr, cst.IfExp):
        return _class_refs(expr.body) | _class_refs(expr.orelse)
    if isinstance(expr, cst.BooleanOperation):
        return _class_refs(expr.left) | _class_refs(expr.right)
    if isinstance(expr, cst.Subscript):
        return _class_refs(expr.value)
    return set()
