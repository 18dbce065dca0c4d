"""What a decoder's forward already does with aux states and what it sends on: the names every
non-last-rank return sends as ``hidden_states`` / ``residual``, an existing PP=1-only capture (to remove),
and the model's own captures that compute a value of their own (kept). Pure libcst; imports no vLLM."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import names_in, self_attr
from pipespec.codemods.vllm_native_loop import Decline, Loop, layer_call_at
from pipespec.codemods.vllm_native_names import snippet_of
from pipespec.contract.names import AUX_OVER_PP_FLAG


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
            shown = snippet_of(value) if value is not None else "no hidden_states"
            raise Decline(f"a non-last-rank return sends `{shown}` as \"hidden_states\" (`{snippet_of(ret)}`), not the "
                          "stream the layers produce: a capture of that branch would not be what the next stage receives", ret)
        sent_hidden.add(value.value)
        res = entry.get("residual")
        if res is not None and not isinstance(res, cst.Name):
            raise Decline(f"a non-last-rank return sends `{snippet_of(res)}` as \"residual\", not a name the layers assign", ret)
        sent_residual.add(res.value if isinstance(res, cst.Name) else None)
    if len(sent_hidden) != 1 or len(sent_residual) != 1:
        raise Decline("the non-last-rank returns send different tensors (`"
                      + "`, `".join(snippet_of(r) for r in nonlast) + "`): the captured stream differs by branch", nonlast[1])
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
        raise Decline(f"the non-last-rank return `{snippet_of(ret)}` is not IntermediateTensors({{...}}) with a dict "
                      "literal (or a name bound once to one)", ret)
    out: dict[str, cst.BaseExpression] = {}
    for el in table.elements:
        if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
            out[el.key.evaluated_value if isinstance(el.key.evaluated_value, str) else ""] = el.value
        elif isinstance(el, cst.StarredDictElement):
            if m.matches(el.value, m.Call(func=m.Attribute(attr=m.Name("pack_local_aux_hidden_states")))):
                raise Decline("already packs aux states (pack_local_aux_hidden_states) but the class does not set "
                              f"{AUX_OVER_PP_FLAG} = True itself: review it and add that line", ret)
    return out


def aux_names(fn: cst.FunctionDef) -> set[str]:
    """Names of lists an existing capture fills: the first argument of ``_maybe_add_hidden_state`` or the
    receiver of ``.append`` under an ``aux_hidden_state_layers`` check, plus ``aux_hidden_states``."""
    names = {"aux_hidden_states"} & names_in(fn)
    for call in m.findall(fn, m.Call(func=m.Attribute(attr=m.Name("_maybe_add_hidden_state")), args=[m.Arg(m.Name()), m.ZeroOrMore()])):
        names.add(cst.ensure_type(cst.ensure_type(call, cst.Call).args[0].value, cst.Name).value)
    for assign in m.findall(fn, m.Assign(targets=[m.AssignTarget(m.Name())],
                                         value=m.Call(func=m.Attribute(attr=m.Name("_maybe_add_hidden_state"))))):
        names.add(cst.ensure_type(cst.ensure_type(assign, cst.Assign).targets[0].target, cst.Name).value)
    return names


def is_capture_stmt(stmt: cst.CSTNode, aux: set[str], hidden: str, residual: str | None) -> bool:
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


def is_aux_return_guard(stmt: cst.CSTNode, aux: set[str]) -> bool:
    """``if len(aux) > 0: return hidden, aux`` / ``if aux: return hidden, aux`` (the PP=1-only last return)."""
    if not isinstance(stmt, cst.If) or stmt.orelse is not None or not (names_in(stmt.test) & aux):
        return False
    body = cst.ensure_type(stmt.body, cst.IndentedBlock).body if isinstance(stmt.body, cst.IndentedBlock) else ()
    returns_pair = m.Return(m.Tuple([m.Element(), m.Element(m.OneOf(*(m.Name(n) for n in aux)))]))
    return len(body) == 1 and m.matches(body[0], m.SimpleStatementLine(body=[returns_pair]))




def before_layer_captures(body: list[cst.BaseStatement], loop: cst.For, parsed: Loop, aux: set[str],
                           removed: set[cst.CSTNode]) -> tuple[cst.If | None, cst.If | None]:
    """The model's own capture *before* each layer (``if idx in self.aux_hidden_state_layers:`` ahead of
    the layer call: id ``idx`` is what enters layer ``idx``) and its last id after the loop (``if
    self.end_layer in self.aux_hidden_state_layers:``), e.g. DeepSeek-V2's, which all-gathers
    sequence-parallel shards. Kept as the model computes them; the rewrite guards id ``start_layer`` to
    the first rank and moves the ``end_layer`` capture before the non-last return, so every rank
    captures exactly its own ids."""
    if len(aux) != 1 or not m.matches(parsed.next_id, m.BinaryOperation(left=m.Name(), operator=m.Add(), right=m.Integer("1"))):
        return None, None
    idx = cst.ensure_type(cst.ensure_type(parsed.next_id, cst.BinaryOperation).left, cst.Name).value
    layer_at = layer_call_at(loop, parsed)
    if layer_at is None:
        return None, None
    layers = m.Attribute(value=m.Name("self"), attr=m.Name("aux_hidden_state_layers"))
    inside = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    before = [s for s in inside[:layer_at] if s not in removed and isinstance(s, cst.If) and s.orelse is None
              and m.matches(s.test, m.Comparison(left=m.Name(idx), comparisons=[m.ComparisonTarget(m.In(), layers)]))
              and names_in(s.body) & aux]
    at = next(i for i, s in enumerate(body) if s is loop)
    end = [s for s in body[at + 1:] if isinstance(s, cst.If) and s.orelse is None and names_in(s.body) & aux
           and m.matches(s.test, m.Comparison(left=self_attr("end_layer"), comparisons=[m.ComparisonTarget(m.In(), layers)]))]
    if len(before) != 1 or len(end) != 1 or idx in names_in(before[0].body):
        return None, None
    return before[0], end[0]


def own_value_captures(loop: cst.For, parsed: Loop, aux: set[str], removed: set[cst.CSTNode]) -> list[cst.If]:
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
        if stmt in removed:
            continue
        if not seen_call and m.findall(stmt, m.Assign(targets=[m.AssignTarget(m.Tuple() | m.Name())], value=m.Call())):
            seen_call = True
            continue
        if isinstance(stmt, cst.If) and names_in(stmt) & aux:
            if not (seen_call and m.matches(stmt.test, test) and stmt.orelse is None):
                return []
            out.append(stmt)
    return out




def own_start_capture(body: Sequence[cst.BaseStatement], loop: cst.For, aux: set[str]) -> cst.If | None:
    """The model's own capture of id ``start_layer`` before the loop: ``if self.start_layer in
    self.aux_hidden_state_layers:`` (no ``else``) whose last statement captures into the aux list with id
    ``self.start_layer`` (Cohere2-MoE clones the embedding first: a fused RMSNorm later updates it in
    place). Kept, on the first rank only."""
    layers = m.Attribute(value=m.Name("self"), attr=m.Name("aux_hidden_state_layers"))
    test = m.Comparison(left=self_attr("start_layer"), comparisons=[m.ComparisonTarget(m.In(), layers)])
    at = next(i for i, s in enumerate(body) if s is loop)
    found = [s for s in body[:at] if isinstance(s, cst.If) and s.orelse is None and m.matches(s.test, test)]
    if len(found) != 1:
        return None
    block = cst.ensure_type(found[0].body, cst.IndentedBlock).body
    capture = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_maybe_add_hidden_state")),
                     args=[m.Arg(m.OneOf(*(m.Name(n) for n in aux))), m.Arg(self_attr("start_layer")), m.ZeroOrMore()])
    if not block or not m.findall(block[-1], capture) or any(m.findall(s, capture) for s in block[:-1]):
        return None
    return found[0]


def conditional_residual(captures: Sequence[cst.CSTNode], residual: str) -> str | None:
    """The residual argument of the model's own capture after a layer where it is ``residual if c else
    None`` (or ``None if c else residual``): the model picks, by config, whether the residual is in the
    stream (Cohere2-MoE: fused RMSNorm layers read it, LayerNorm ones rebind it)."""
    args: set[str] = set()
    for node in captures:
        for call in m.findall(node, m.Call(func=m.Attribute(attr=m.Name("_maybe_add_hidden_state")))):
            call_args = cst.ensure_type(call, cst.Call).args
            if len(call_args) == 4 and not m.matches(call_args[1].value, self_attr("start_layer")):
                args.add(snippet_of(call_args[3].value) if isinstance(call_args[3].value, cst.IfExp) else "")
    if len(args) != 1:
        return None
    (arg,) = args
    expr = cst.parse_expression(arg) if arg else None
    if not isinstance(expr, cst.IfExp):
        return None
    pair = {snippet_of(expr.body), snippet_of(expr.orelse)}
    return arg if pair == {residual, "None"} and residual not in names_in(expr.test) else None
