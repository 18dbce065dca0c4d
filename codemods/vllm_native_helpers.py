"""A forward whose layers run in helper methods of the class, which capture the model's own aux states.

DeepSeek-V4.1's NVIDIA ``DeepseekV4Model`` is the form::

    aux_by_layer: dict[int, torch.Tensor] = {}
    hidden_states, ... = self._run_layers(range(self.start_layer, ...), ..., aux_by_layer, ...)
    ...  hidden_states = self._collapse(..., aux_by_layer, ...)        # more helpers filling it
    aux_hidden_states = [aux_by_layer[i] for i in self.aux_hidden_state_layers if i in aux_by_layer] + late
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({...})
    ...
    if len(aux_hidden_states) > 0:
        return hidden_states, aux_hidden_states
    return hidden_states

where ``_run_layers`` loops ``for idx in layer_ids: ... = self.layers[idx](...)`` and stores the model's
own value (a fused kernel's reconstruction) as ``aux_by_layer[idx]`` (what enters layer ``idx``) or
``[idx + 1]``, and a helper may store ``[self.end_layer]``. The helpers are read, not rewritten: every key
they store is a global layer id of this stage (forward passes ``range(self.start_layer, ...)``), and
forward assembles the list in the order of ``self.aux_hidden_state_layers``. The rewrite adds what vLLM's
contract needs around it, as vLLM's own PP-correct DeepSeek-V4 does around its in-loop capture:
``collect_remote_aux_hidden_states`` before the first helper call, the pack in the non-last return, the
last rank's ``remote + local``; where a helper keys by ``idx`` (the state entering a layer), the entry for
id ``start_layer`` is dropped on later ranks (that id is the previous stage's ``end_layer``). Like vLLM's
DeepSeek-V4 it captures no id ``start_layer`` on the first rank itself. Pure libcst; imports no vLLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.scope import own_scope
from pipespec.codemods.vllm_forward_shape import names_in, self_attr
from pipespec.codemods.vllm_native_captures import is_aux_return_guard
from pipespec.codemods.vllm_native_loop import (
    RANK,
    Decline,
    Loop,
    methods,
    params_of,
    stage_loops,
)
from pipespec.codemods.vllm_native_names import snippet_of
from pipespec.codemods.vllm_native_qualified import UNBOUND, VllmNames

_LAYERS_LIST = m.Attribute(value=m.Name("self"), attr=m.Name("aux_hidden_state_layers"))


@dataclass(frozen=True)
class Helpers:
    """What the rewrite of a forward whose layers run in helper methods needs."""

    loop: Loop  # the helper's layer loop (read only: its module list and where it is)
    hidden: str
    aux: str  # the list forward assembles and the last rank returns
    table: str  # the dict the helpers fill, keyed by global layer id
    collect_before: cst.BaseStatement  # forward's first statement calling a helper that runs the layers
    drop_start_before: cst.BaseStatement | None  # the list's assignment: drop id start_layer on later ranks before it
    nonlast: tuple[cst.Return, ...]
    last: tuple[cst.Return, ...]
    remove: tuple[cst.CSTNode, ...]  # the PP=1-only `if len(aux) > 0: return hidden, aux`
    has_rank_check: bool
    own_capture: bool = True


def helper_plan(cls: cst.ClassDef, line_of: Callable[[cst.CSTNode], int], names: VllmNames = UNBOUND) -> Helpers | None:
    """The plan for the form in the module docstring, or None where forward is not of it (the caller
    then declines as for any forward whose loop does not run the layers). ``Decline`` where it is of
    that form but a part cannot be read as safe (a key that is not a global id of this stage, ...)."""
    fn = methods(cls)["forward"]
    loops = stage_loops(fn)
    attrs = {a.attr.value for lp in loops for a in m.findall(lp.iter, self_attr()) if isinstance(a, cst.Attribute)}
    attrs -= {"start_layer", "end_layer"}
    if len(attrs) != 1:
        return None
    layers = attrs.pop()
    body = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
    guards = [s for s in body if is_aux_return_guard(s, names_in(s))]
    if len(guards) != 1:
        return None
    guard = cst.ensure_type(guards[0], cst.If)
    ret = cst.ensure_type(cst.ensure_type(cst.ensure_type(guard.body, cst.IndentedBlock).body[0],
                                          cst.SimpleStatementLine).body[0], cst.Return)
    pair = cst.ensure_type(ret.value, cst.Tuple)
    hidden, aux = (cst.ensure_type(e.value, cst.Name).value if isinstance(e.value, cst.Name) else "" for e in pair.elements)
    if not hidden:
        return None
    own = methods(cls)
    runners = {name: found for name, meth in own.items() if name != "forward" and (found := _runner(meth, layers))}
    calls = [(i, s, c) for i, s in enumerate(body) for c in m.findall(s, m.Call(func=m.Attribute(value=m.Name("self"))))
             if cst.ensure_type(cst.ensure_type(c, cst.Call).func, cst.Attribute).attr.value in runners]
    if not calls:
        return None
    first_name = cst.ensure_type(cst.ensure_type(calls[0][2], cst.Call).func, cst.Attribute).attr.value
    assigned = [(i, s) for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine(body=[
        m.Assign(targets=[m.AssignTarget(m.Name(aux))]) | m.AnnAssign(target=m.Name(aux), value=m.DoesNotMatch(None))]))]
    if len(assigned) != 1 or any(i > assigned[0][0] for i, _, _ in calls):
        raise Decline(f"forward assembles `{aux}` (the list its last rank returns) other than once at its top level "
                      "after the helpers that run the layers", guard)
    at, assign = assigned[0]
    value = cst.ensure_type(assign, cst.SimpleStatementLine).body[0].value  # type: ignore[attr-defined]
    table = _table_read(value)
    if table is None:
        raise Decline(f"`{snippet_of(assign)}` does not read the helpers' captures in the order of "
                      "self.aux_hidden_state_layers (`[table[i] for i in self.aux_hidden_state_layers if i in table]`)", assign)
    keyed_by_entry = False
    for _, _, call in calls:
        name = cst.ensure_type(cst.ensure_type(call, cst.Call).func, cst.Attribute).attr.value
        _, ids_param, table_param, entry = runners[name]
        args = _bind(own[name], cst.ensure_type(call, cst.Call))
        ids_arg, table_arg = args.get(ids_param), args.get(table_param)
        if not (m.matches(ids_arg, m.Call(func=m.Name("range"), args=[m.Arg(self_attr("start_layer")), m.Arg()])
                          | m.Call(func=m.Name("range"), args=[m.Arg(), m.Arg(self_attr("end_layer"))]))):
            raise Decline(f"`{snippet_of(call)}` runs the layers `{snippet_of(ids_arg) if ids_arg else 'of no range'}`, not "
                          "a range of this stage's (self.start_layer, ...) / (..., self.end_layer)", call)
        if not m.matches(table_arg, m.Name(table)):
            raise Decline(f"`{snippet_of(call)}` keeps its captures elsewhere than `{table}`, which forward returns", call)
        keyed_by_entry |= entry
    returns = own_scope(fn).returns
    early = [r for r in returns if line_of(r) < line_of(assign)]
    if early:
        raise Decline(f"forward returns before it assembles `{aux}` (`{snippet_of(early[0])}`): that path does not run "
                      "the helpers that run this stage's layers, so it would neither take the upstream ranks' aux "
                      "states nor pack this rank's for the next", early[0])
    intermediate = m.Call(func=names.ref("IntermediateTensors"))
    nonlast = tuple(r for r in returns if m.matches(r.value, intermediate))
    last = tuple(r for r in returns if not m.matches(r.value, intermediate) and r is not ret)
    if not nonlast or not last or any(isinstance(r.value, cst.Tuple) for r in last):
        return None
    init = _check_table(fn, body, own, table, set(runners))
    loop = Loop(runners[first_name][0], layers, cst.parse_expression("idx + 1"), None, None)
    return Helpers(loop, hidden, aux, table, init, body[at] if keyed_by_entry else None, nonlast, last,
                   (guard,), bool(m.findall(fn, RANK)))


def _runner(meth: cst.FunctionDef, layers: str) -> tuple[cst.For, str, str, bool] | None:
    """(loop, its ids parameter, the table parameter, keyed by the entering id) where ``meth`` loops over
    one of its parameters calling ``self.<layers>[idx](...)`` and stores captures as ``table[idx]`` or
    ``table[idx + 1]`` into a parameter ``table``."""
    params = params_of(meth)
    for loop in m.findall(meth, m.For(target=m.Name(), iter=m.Name())):
        loop = cst.ensure_type(loop, cst.For)
        idx, ids = cst.ensure_type(loop.target, cst.Name).value, cst.ensure_type(loop.iter, cst.Name).value
        if ids not in params or not m.findall(loop.body, m.Call(func=m.Subscript(
                value=self_attr(layers), slice=[m.SubscriptElement(m.Index(m.Name(idx)))]))):
            continue
        stores = [cst.ensure_type(cst.ensure_type(t, cst.AssignTarget).target, cst.Subscript)
                  for t in m.findall(loop.body, m.AssignTarget(m.Subscript(value=m.Name())))]
        names = {cst.ensure_type(s.value, cst.Name).value for s in stores} & params
        if len(names) != 1:
            continue
        table = names.pop()
        key = [s for s in stores if m.matches(s.value, m.Name(table))]
        entry = all(m.matches(k, _keyed(m.Name(idx))) for k in key)
        after = all(m.matches(k, _keyed(m.BinaryOperation(m.Name(idx), m.Add(), m.Integer("1")))) for k in key)
        inside = set(stores)
        elsewhere = [cst.ensure_type(cst.ensure_type(t, cst.AssignTarget).target, cst.Subscript)
                     for t in m.findall(meth, m.AssignTarget(m.Subscript(value=m.Name(table))))]
        outside_ok = all(m.matches(s, _keyed(self_attr("end_layer")))
                         for s in elsewhere if s not in inside)
        if (entry or after) and outside_ok:
            return loop, ids, table, entry
    return None


def _keyed(key: m.BaseExpressionMatcherNode) -> m.Subscript:
    """``<anything>[key]``."""
    return m.Subscript(slice=[m.SubscriptElement(m.Index(key))])


def _bind(meth: cst.FunctionDef, call: cst.Call) -> dict[str, cst.BaseExpression]:
    """Parameter name -> the argument ``call`` passes (positional after ``self``, or by keyword)."""
    positional = [p.name.value for p in (*meth.params.posonly_params, *meth.params.params)][1:]
    out: dict[str, cst.BaseExpression] = {}
    for i, arg in enumerate(a for a in call.args if a.keyword is None and not a.star):
        if i < len(positional):
            out[positional[i]] = arg.value
    out.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    return out


def _table_read(value: cst.BaseExpression) -> str | None:
    """``table`` where ``value`` is ``[table[i] for i in self.aux_hidden_state_layers if i in table]``,
    alone or followed by ``+ more`` (the model's own further states, appended after it)."""
    while isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
        value = value.left
    if not isinstance(value, cst.ListComp) or value.for_in.inner_for_in is not None:
        return None
    target, it = value.for_in.target, value.for_in.iter
    if not (isinstance(target, cst.Name) and m.matches(it, _LAYERS_LIST) and len(value.for_in.ifs) == 1):
        return None
    elt = value.elt
    if not (isinstance(elt, cst.Subscript) and isinstance(elt.value, cst.Name) and m.matches(elt, _keyed(m.Name(target.value)))):
        return None
    table = elt.value.value
    test = value.for_in.ifs[0].test
    if not m.matches(test, m.Comparison(left=m.Name(target.value), comparisons=[m.ComparisonTarget(m.In(), m.Name(table))])):
        return None
    return table


def _check_table(fn: cst.FunctionDef, body: list[cst.BaseStatement], own: dict[str, cst.FunctionDef], table: str,
                 runners: set[str]) -> cst.BaseStatement:
    """Forward binds ``table`` to ``{}`` once and otherwise only passes it to methods of the class (and
    reads it); every method it is passed to stores only ``[idx]`` / ``[idx + 1]`` in its layer loop (the
    runners) or ``[self.end_layer]``: each key is a global id of this stage."""
    inits = [s for s in body if m.matches(s, m.SimpleStatementLine(body=[
        m.Assign(targets=[m.AssignTarget(m.Name(table))], value=m.Dict([])) | m.AnnAssign(target=m.Name(table), value=m.Dict([]))]))]
    if len(inits) != 1:
        raise Decline(f"forward does not bind `{table}` (the helpers' captures) to {{}} exactly once", fn)
    for stmt in body:
        if stmt is inits[0] or table not in names_in(stmt):
            continue
        for target in m.findall(stmt, m.AssignTarget(m.Subscript(value=m.Name(table))) | m.AssignTarget(m.Name(table))):
            raise Decline(f"`{snippet_of(stmt)}` writes `{table}` in forward itself: only the helpers' captures are "
                          "understood", target)
        for call in m.findall(stmt, m.Call(args=[m.ZeroOrMore(), m.Arg(m.Name(table)), m.ZeroOrMore()])):
            func = cst.ensure_type(call, cst.Call).func
            name = func.attr.value if m.matches(func, m.Attribute(value=m.Name("self"))) else None  # type: ignore[attr-defined]
            if name is None or name not in own:
                raise Decline(f"`{snippet_of(call)}` passes `{table}` to code outside this class", call)
            if name in runners:
                continue
            meth = own[name]
            param = next((p for p, a in _bind(meth, cst.ensure_type(call, cst.Call)).items() if m.matches(a, m.Name(table))), None)
            for store in m.findall(meth, m.AssignTarget(m.Subscript(value=m.Name(param or "")))):
                sub = cst.ensure_type(cst.ensure_type(store, cst.AssignTarget).target, cst.Subscript)
                if not m.matches(sub, _keyed(self_attr("end_layer"))):
                    raise Decline(f"`{name}` stores `{snippet_of(sub)}`: a key other than a layer id of this stage "
                                  "(idx, idx + 1 in its layer loop, or self.end_layer)", sub)
    return inits[0]


__all__ = ["Helpers", "helper_plan"]
