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

from collections.abc import Callable, Sequence

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.scope import own_scope
from pipespec.codemods.vllm_forward_shape import names_in, self_attr
from pipespec.codemods.vllm_native_captures import (
    aux_names,
    before_layer_captures,
    conditional_residual,
    is_aux_return_guard,
    is_capture_stmt,
    is_sequence_parallel_epilogue,
    own_start_capture,
    own_value_captures,
    sent_stream,
)
from pipespec.codemods.vllm_native_layers import layer_classes
from pipespec.codemods.vllm_native_loop import (
    RANK,
    ClassLookup,
    Decline,
    ForwardPlan,
    Loop,
    fresh,
    layer_call_at,
    methods,
    params_of,
    parse_loop,
    stage_aliases,
    stage_loops,
)
from pipespec.codemods.vllm_native_names import line_breaks_in, snippet_of
from pipespec.codemods.vllm_native_qualified import UNBOUND, VllmNames
from pipespec.codemods.vllm_native_residual import unsent_stale_residual


def forward_plan(cls: cst.ClassDef, line_of: Callable[[cst.CSTNode], int],
                 lookup: ClassLookup | None = None, names: VllmNames = UNBOUND) -> ForwardPlan:
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
        _decline_nested(cls, fn, body, loop)
    return plan_loop(cls, fn, body, loop, line_of, lookup, names)


def plan_loop(cls: cst.ClassDef, fn: cst.FunctionDef, body: list[cst.BaseStatement], loop: cst.For,
              line_of: Callable[[cst.CSTNode], int], lookup: ClassLookup | None, names: VllmNames = UNBOUND) -> ForwardPlan:
    """The plan of one loop over this stage's layers, ``loop`` a statement of ``body``: forward's own body,
    or the statements one path through forward runs (vllm_native_branches: one per config branch).
    ``names``: the file's names for vLLM's (``IntermediateTensors`` of the non-last return)."""
    if loop.orelse is not None:
        raise Decline("the layer loop has an else branch", loop)
    scope = own_scope(fn)
    jumps = _loop_jumps(loop)
    if jumps:
        raise Decline(f"the layer loop uses `{snippet_of(jumps[0])}`: a layer skipped or left early would skip its capture", jumps[0])
    yields = [j for j in scope.jumps if isinstance(j, cst.Yield)]
    if yields:
        raise Decline("forward yields: only a function that returns is understood", yields[0])
    used = names_in(fn)
    parsed = parse_loop(loop, used, stage_aliases(fn))
    on_path = {r for st in body for r in m.findall(st, m.Return())}
    nonlast, last = _returns(cls, fn, body, loop, [r for r in scope.returns if r in on_path], line_of, names)
    if not nonlast:
        raise Decline("forward never returns IntermediateTensors({...}) for non-last ranks: it does not support "
                      "pipeline parallelism", fn)
    hidden, residual = sent_stream(body, nonlast)
    fold = folded_residual(body, loop, parsed, hidden, nonlast) if residual is None else None
    if fold is not None:  # the residual travels inside the tensor sent as hidden_states
        residual = fold[0]
    aux = aux_names(fn)
    remove: list[cst.CSTNode] = []
    for stmt in [*body, *cst.ensure_type(loop.body, cst.IndentedBlock).body]:
        if stmt is loop:
            continue
        if is_capture_stmt(stmt, aux, hidden, residual) or is_aux_return_guard(stmt, aux):
            remove.append(stmt)
    removed = set(remove)
    start = own_start_capture(body, loop, aux)
    if start is not None:
        after = body[body.index(start) + 1: next(i for i, s in enumerate(body) if s is loop)]
        changed = next((s for s in after if bound_names(s) & ({hidden} | ({residual} if residual else set()))), None)
        if changed is not None:
            raise Decline(f"`{snippet_of(changed)}` changes the stream between the model's own id start_layer capture "
                          "and the layer loop", changed)
    residual_arg = conditional_residual(remove, residual) if residual is not None else None
    own = own_value_captures(loop, parsed, aux, removed)
    ahead, end = before_layer_captures(body, loop, parsed, aux, removed) if not own else (None, None)
    if ahead is not None and end is not None:
        own = [ahead, end]
        remove.append(end)
        removed.add(end)
    gather = None
    if not own:
        stale = unsent_stale_residual(cls, fn, loop, parsed, hidden, residual, lookup)
        cache = _cache_check(cls, parsed, lookup)
        _check_layer_call(fn, body, loop, hidden, residual or stale, nonlast, cache)
        gather = _check_after_loop(fn, body, loop, hidden, residual, nonlast, fold[1] if fold is not None else None)
    kept_start = {start} if start is not None and not own else set()  # with the model's own captures: declined
    _check_aux_uses(body, loop, aux, removed, set(own) | kept_start, bool(own))
    for ret in last:
        if isinstance(ret.value, cst.Tuple) and not any(r is ret for g in remove for r in m.findall(g, m.Return())):
            raise Decline(f"the last rank already returns a tuple (`{snippet_of(ret)}`)", ret)
    last = [r for r in last if not any(r is x for g in remove for x in m.findall(g, m.Return()))]
    if not last:
        raise Decline("forward has no last-rank return of the hidden states", fn)
    for ret in last:
        _check_return_placement(fn, ret)
    before = body[: next(i for i, s in enumerate(body) if s is loop)]
    bound = residual is not None and any(residual in bound_names(s) for s in before)
    rank_check = bool(m.findall(fn, RANK))
    aux_name = "aux_hidden_states" if "aux_hidden_states" in aux or "aux_hidden_states" not in used else fresh("aux_hidden_states", used)
    if own:
        aux_name = next(iter(aux))
    return ForwardPlan(parsed, hidden, residual, bound, tuple(nonlast), tuple(last), tuple(remove), aux_name,
                       rank_check, bool(own) and ahead is None, ahead, end,
                       start_capture=start if not own else None, residual_arg=residual_arg, gather=gather)


def _decline_nested(cls: cst.ClassDef, fn: cst.FunctionDef, body: list[cst.BaseStatement], loop: cst.For) -> None:
    """``Decline`` for the layer loop nested in another statement, saying what it is nested in."""
    try:
        parsed: Loop | None = parse_loop(loop, names_in(fn), stage_aliases(fn))
        runs = layer_call_at(loop, parsed) is not None  # type: ignore[arg-type]
    except Decline:
        parsed, runs = None, True
    if not runs:
        attr = parsed.layers_attr if parsed is not None else "layers"
        helpers = [name for name, meth in methods(cls).items() if name != "forward"
                   and m.findall(meth, m.Call(func=m.Subscript(value=self_attr(attr))))]
        where = (f"; they run in helper methods ({', '.join(helpers)}), which keep their captures otherwise than"
                 if helpers else ", and no helper method of this class runs them in")
        raise Decline(f"forward's only loop over this stage's layers (`for ... in {snippet_of(loop.iter)}`, nested "
                      f"in another statement) does not call them{where} the one helper form the rewrite follows "
                      "(a loop over a range forward passes, capturing into a dict keyed by layer id that forward "
                      "turns into the list its last rank returns)", loop)
    outer = next((st for st in body if any(x is loop for x in m.findall(st, m.For()))), None)
    if isinstance(outer, (cst.For, cst.While)):
        head = f"for ... in {snippet_of(outer.iter)}" if isinstance(outer, cst.For) else f"while {snippet_of(outer.test)}"
        raise Decline(f"the layer loop `for ... in {snippet_of(loop.iter)}` runs inside `{head}`: every layer "
                      "runs once per outer iteration, so a layer boundary (an aux id) names several states and no "
                      "one capture is the stream there", loop)
    raise Decline(f"the layer loop `for ... in {snippet_of(loop.iter)}` is nested inside another statement "
                  "(only a loop at forward's top level is understood)", loop)


def _returns(cls: cst.ClassDef, fn: cst.FunctionDef, body: list[cst.BaseStatement], loop: cst.For,
             returns: Sequence[cst.Return], line_of: Callable[[cst.CSTNode], int],
             names: VllmNames = UNBOUND) -> tuple[list[cst.Return], list[cst.Return]]:
    """(non-last-rank ``return IntermediateTensors(...)``, last-rank returns), after the layer loop;
    ``Decline`` for a return before or inside it (except on a path no drafter runs) or a bare one."""
    loop_end = line_of(loop) + line_breaks_in(loop)
    nonlast, last = [], []
    never_drafted = _fast_prefill_returns(cls, body, loop)
    for ret in returns:
        if ret in never_drafted:
            continue  # left as it is: that path runs without any drafter
        if line_of(ret) < line_of(loop):
            owner = next((s for s in body if any(x is ret for x in m.findall(s, m.Return()))), None)
            where = f" in `{snippet_of(owner.test)}`" if isinstance(owner, cst.If) else ""
            raise Decline(f"forward returns before its layer loop (`{snippet_of(ret)}`{where}): that path would hand "
                          "on no aux states and pack none for the next rank", ret)
        if line_of(ret) < loop_end:
            raise Decline(f"forward returns inside its layer loop (`{snippet_of(ret)}`)", ret)
        if m.matches(ret.value, m.Call(func=names.ref("IntermediateTensors"))):
            nonlast.append(ret)
        elif ret.value is None:
            raise Decline("forward has a bare `return`: the last rank must return the hidden states", ret)
        else:
            last.append(ret)
    return nonlast, last


def _check_aux_uses(body: list[cst.BaseStatement], loop: cst.For, aux: set[str], removed: set[cst.CSTNode], kept: set[cst.CSTNode],
                    own: bool) -> None:
    """Every statement left that mentions the aux list or ids is one the rewrite removes or keeps;
    anything else captures something other than the stream: ``Decline`` naming it."""
    at = next(i for i, s in enumerate(body) if s is loop)
    epilogue = {s for s in body[at + 1:] if is_sequence_parallel_epilogue(s)}
    for name in aux | {"aux_hidden_state_layers", "_maybe_add_hidden_state"}:
        for stmt in [*body, *cst.ensure_type(loop.body, cst.IndentedBlock).body]:
            if stmt is loop or stmt in removed or stmt in kept or (stmt in epilogue and name in aux):
                continue
            if own and name == "aux_hidden_state_layers" and not (names_in(stmt) & aux):
                continue  # reads the ids only (e.g. reuses the last capture's reconstruction), captures nothing
            if name in names_in(stmt):
                gathers = sorted(n for n in names_in(stmt) if "gather" in n)
                if gathers:
                    raise Decline(f"`{snippet_of(stmt)}`: the existing capture gathers sequence-parallel shards "
                                  f"({', '.join(gathers)}) before keeping a state; the contract's capture of the "
                                  "stage's own tensors would keep shards", stmt)
                raise Decline(f"`{snippet_of(stmt)}` uses {name} in a way the rewrite does not understand (it "
                              "captures something other than hidden_states (+ residual) at a layer boundary)", stmt)


#: A cache option vLLM refuses together with every EAGLE-family method (``VllmConfig.__post_init__``:
#: "Fast prefill optimization for KV sharing is not compatible with EAGLE"): a forward path taken only
#: under it never runs with a drafter, so it captures and relays nothing.
NO_DRAFTER_OPTION = "kv_sharing_fast_prefill"


def _fast_prefill_returns(cls: cst.ClassDef, body: Sequence[cst.BaseStatement], loop: cst.For) -> set[cst.CSTNode]:
    """Returns inside ``if self.<flag>:`` branches before the layer loop, where ``__init__`` sets
    ``self.<flag>`` from ``NO_DRAFTER_OPTION`` (Gemma4's fast-prefill forward)."""
    init = methods(cls).get("__init__")
    if init is None:
        return set()
    flags = {cst.ensure_type(cst.ensure_type(a, cst.Assign).targets[0].target, cst.Attribute).attr.value
             for a in m.findall(init, m.Assign(targets=[m.AssignTarget(self_attr())]))
             if NO_DRAFTER_OPTION in names_in(cst.ensure_type(a, cst.Assign).value)}
    out: set[cst.CSTNode] = set()
    for stmt in body:
        if stmt is loop:
            break
        if isinstance(stmt, cst.If) and stmt.orelse is None and flags and m.matches(
                stmt.test, m.Attribute(value=m.Name("self"), attr=m.OneOf(*(m.Name(f) for f in flags)))):
            out |= set(m.findall(stmt.body, m.Return()))
    return out



def bound_names(stmt: cst.CSTNode) -> set[str]:
    """The names ``stmt`` (re)binds: plain, annotated and augmented assignments (``x += y`` changes ``x``
    as much as ``x = x + y``; missing it once let a stream changed after the layer loop through)."""
    out: set[str] = set()
    for t in m.findall(stmt, m.AssignTarget() | m.AnnAssign() | m.AugAssign()):
        target = t.target  # type: ignore[attr-defined]
        out |= {n.value for n in m.findall(target, m.Name())}
    return out


def _check_layer_call(fn: cst.FunctionDef, top: list[cst.BaseStatement], loop: cst.For, hidden: str,
                      residual: str | None, nonlast: Sequence[cst.Return],
                      cache: Callable[[cst.Call, str], bool] = lambda call, name: False) -> None:
    """Every assignment in the loop that binds the hidden stream binds only it and the residual; anything
    else a layer hands to the next layer (deferred adds, recurrent state) is not in the captured stream,
    except a cache: a value every stage starts again from None, that the hand-off neither sends nor folds
    in (``dropped_at_hand_off``) and that every layer class computes itself when given None (``cache``:
    Beam's next-norm ``normalized_states``)."""
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
            value = cst.ensure_type(assign, cst.Assign).value
            extra = [n for n in plain if n not in (hidden, residual, "_") and n in read
                     and not (isinstance(value, cst.Call) and dropped_at_hand_off(top, loop, n, nonlast)
                              and cache(value, n))]
            if extra or len(plain) != len(names):
                carried = ", ".join(f"`{n}`" for n in extra) if extra else f"`{snippet_of(t.target)}`"
                sent = f"`{hidden}`" + (f" and `{residual}`" if residual else "")
                raise Decline(f"the layer call assigns `{snippet_of(t.target)}`: {carried} "
                              f"{'is' if len(extra) == 1 else 'are'} carried from layer to layer but the next stage "
                              f"receives only {sent}, so the stream at a layer boundary is not hidden_states "
                              "(+ residual)", assign)
    if hidden not in {n.value for t in m.findall(body, m.AssignTarget()) for n in m.findall(t, m.Name())}:
        raise Decline(f"the layer loop never assigns `{hidden}` (the tensor sent to the next stage)", loop)


def running_loops(fn: cst.FunctionDef, loops: list[cst.For]) -> list[cst.For]:
    """The loops of ``loops`` that call the layers they visit (a loop whose header cannot be read counts)."""
    used, aliases = names_in(fn), stage_aliases(fn)

    def calls(loop: cst.For) -> bool:
        try:
            return layer_call_at(loop, parse_loop(loop, used, aliases)) is not None
        except Decline:
            return True

    return [lp for lp in loops if calls(lp)]


def _running_loops(fn: cst.FunctionDef, loops: list[cst.For], line_of: Callable[[cst.CSTNode], int]) -> list[cst.For]:
    """The one loop over this stage's layers that calls them; the others only visit the layer modules
    (DeepSeek-V4.1's engram ``prepare_embeddings`` before the real loop) and stay as they are. ``Decline``
    when more than one calls them (one loop per config branch is vllm_native_branches', tried first)."""
    running = running_loops(fn, loops)
    if len(running) == 1:
        return running
    lines = ", ".join(str(line_of(lp)) for lp in running or loops)
    raise Decline(f"forward has {len(running) or len(loops)} loops that run this stage's layers (lines {lines}) and "
                  "they are not one per config branch in the form the rewrite follows (each directly in a top-level "
                  "`if` or `else` block that ends in a return, or after such `if`s), the form in which it can tell "
                  "that no path through forward runs two", (running or loops)[1])



def _check_after_loop(fn: cst.FunctionDef, body: list[cst.BaseStatement], loop: cst.For, hidden: str,
                      residual: str | None, nonlast: list[cst.Return], fold: cst.CSTNode | None = None) -> cst.If | None:
    """Nothing between the loop and a non-last return changes what is sent (but ``fold``, which adds the
    residual into it): the last layer's capture must be what the next stage receives. Returns the one
    sequence-parallel gather of the stream there (``shard_gather``), which the rewrite applies to each
    captured state too."""
    at = next(i for i, s in enumerate(body) if s is loop)
    stream = {hidden} | ({residual} if residual else set())
    gather: cst.If | None = None
    for stmt in body[at + 1:]:
        if stmt is fold:
            continue
        if gather is None and shard_gather(stmt, hidden, residual):
            gather = cst.ensure_type(stmt, cst.If)
            continue
        if any(r is x for r in nonlast for x in m.findall(stmt, m.Return())):
            inner = stmt.body.body if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock) else ()
            for s in inner:
                if s is not fold and bound_names(s) & stream:
                    raise Decline(f"`{snippet_of(s)}` changes `{'/'.join(sorted(bound_names(s) & stream))}` after the "
                                  "layer loop, before the non-last-rank return: the stream sent on is not the last "
                                  "layer's output", s)
            return gather
        if bound_names(stmt) & stream:
            if _gathers_shards(stmt):
                raise Decline(f"`{snippet_of(stmt)}` gathers the stream after the layer loop, before the non-last-rank "
                              "return, in a form other than one `hidden_states = <gather of hidden_states>`: under "
                              "sequence parallelism the layers run on token shards, so a capture after each layer "
                              "would keep a shard, not the stream the next stage receives", stmt)
            raise Decline(f"`{snippet_of(stmt)}` changes the stream after the layer loop, before the non-last-rank return", stmt)
    return gather


def _gathers_shards(stmt: cst.CSTNode) -> bool:
    """``if <...sequence_parallel...>: x = <...gather...>(x)``: sequence-parallel shards made whole again."""
    return (isinstance(stmt, cst.If) and any("sequence_parallel" in n for n in names_in(stmt.test))
            and any("gather" in n for n in names_in(stmt.body)))


def shard_gather(stmt: cst.CSTNode, hidden: str, residual: str | None) -> bool:
    """``if <...sequence_parallel...>: hidden = <...gather...>(hidden)[...]`` and nothing else, the value
    reading the stream through ``hidden`` alone (Step5): the stage's token shards made whole before the
    hand-off, a transformation the rewrite can apply to each captured state as well."""
    if not _gathers_shards(stmt) or cst.ensure_type(stmt, cst.If).orelse is not None:
        return False
    inner = cst.ensure_type(cst.ensure_type(stmt, cst.If).body, cst.IndentedBlock).body
    if len(inner) != 1 or not m.matches(inner[0], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(hidden))])])):
        return False
    value = cst.ensure_type(cst.ensure_type(inner[0], cst.SimpleStatementLine).body[0], cst.Assign).value
    return hidden in names_in(value) and (residual is None or residual not in names_in(value))


def folded_residual(body: list[cst.BaseStatement], loop: cst.For, parsed: Loop, hidden: str,
                    nonlast: Sequence[cst.Return]) -> tuple[str, cst.BaseStatement] | None:
    """(the residual name, the statement that folds it into the hidden stream) where the layers hand on
    ``hidden, R`` and the non-last path adds ``R`` into ``hidden`` before sending ``hidden`` alone, every
    stage starting from ``R = None`` (DeepSeek-V3.2 0.34: ``hidden_states = residual +
    tensor_model_parallel_all_reduce(hidden_states)``; Step5: ``if residual is not None: hidden_states =
    layer._add_for_residual(hidden_states, residual)``). The stream at a layer boundary is then
    ``hidden + R``, exactly what a next stage receives."""
    at = layer_call_at(loop, parsed)
    if at is None:
        return None
    call_stmt = cst.ensure_type(loop.body, cst.IndentedBlock).body[at]
    pairs = [cst.ensure_type(a, cst.Assign).targets[0].target for a in m.findall(call_stmt, m.Assign(
        targets=[m.AssignTarget(m.Tuple([m.Element(m.Name(hidden)), m.Element(m.Name())]))]))]
    if len(pairs) != 1:
        return None
    res = cst.ensure_type(cst.ensure_type(pairs[0], cst.Tuple).elements[1].value, cst.Name).value
    start = next(i for i, s in enumerate(body) if s is loop)
    before = [s for s in body[:start] if res in bound_names(s)]
    none = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(res))], value=m.Name("None"))])
    if not before or not all(m.matches(s, none) for s in before):
        return None
    path: list[cst.BaseStatement] = []
    for stmt in body[start + 1:]:
        if any(r is x for r in nonlast for x in m.findall(stmt, m.Return())):
            inner = stmt.body.body if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock) else ()
            path += [s for s in inner if not any(r is x for r in nonlast for x in m.findall(s, m.Return()))]
            break
        path.append(stmt)
    reading = [s for s in path if res in names_in(s)]
    if len(reading) != 1 or not _is_fold(reading[0], hidden, res):
        return None
    return res, reading[0]


def _is_fold(stmt: cst.BaseStatement, hidden: str, res: str) -> bool:
    """``hidden = res + f(hidden)`` / ``f(hidden) + res``, or under ``if res is not None:`` one of those or
    ``hidden = <call>(hidden, res)`` (the model's own add)."""
    def assigns_fold(line: cst.BaseStatement, call_ok: bool) -> bool:
        if not m.matches(line, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(hidden))])])):
            return False
        value = cst.ensure_type(cst.ensure_type(line, cst.SimpleStatementLine).body[0], cst.Assign).value
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
            sides = (value.left, value.right)
            return (any(m.matches(x, m.Name(res)) for x in sides)
                    and any(hidden in names_in(x) and res not in names_in(x) for x in sides))
        return call_ok and isinstance(value, cst.Call) and len(value.args) == 2 and {
            snippet_of(a.value) for a in value.args} == {hidden, res}
    if isinstance(stmt, cst.If) and stmt.orelse is None and m.matches(stmt.test, m.Comparison(
            left=m.Name(res), comparisons=[m.ComparisonTarget(m.IsNot(), m.Name("None"))])):
        inner = cst.ensure_type(stmt.body, cst.IndentedBlock).body
        return len(inner) == 1 and assigns_fold(inner[0], True)
    return assigns_fold(stmt, False)


def _cache_check(cls: cst.ClassDef, parsed: Loop, lookup: ClassLookup | None) -> Callable[[cst.Call, str], bool]:
    """``check(call, name)``: every layer class of the loop, given ``name`` by ``call``, computes that value
    itself when it is None (``recomputed_when_none``), so a stage that starts it from None loses nothing."""
    def check(call: cst.Call, name: str) -> bool:
        slot = next(((a.keyword.value if a.keyword is not None else i) for i, a in enumerate(call.args)
                     if m.matches(a.value, m.Name(name))), None)
        found = layer_classes(cls, parsed.layers_attr, lookup) if lookup is not None and slot is not None else None
        if not isinstance(found, list) or not found or slot is None:  # not found from the source: not a cache
            return False
        return all(recomputed_when_none(layer, slot) for layer, _ in found)
    return check


def recomputed_when_none(layer: cst.ClassDef, slot: int | str) -> bool:
    """The layer's ``forward`` reads the parameter at ``slot`` only as ``<its own value> if p is None else p``
    (or ``p if p is not None else ...``): an optional precomputed input it computes itself when not given."""
    fn = methods(layer).get("forward")
    if fn is None:
        return False
    positional = [x.name.value for x in (*fn.params.posonly_params, *fn.params.params)][1:]
    name = positional[slot] if isinstance(slot, int) and slot < len(positional) else slot if isinstance(slot, str) else None
    if name is None or name not in params_of(fn):
        return False
    is_none = m.Comparison(left=m.Name(name), comparisons=[m.ComparisonTarget(m.Is(), m.Name("None"))])
    not_none = m.Comparison(left=m.Name(name), comparisons=[m.ComparisonTarget(m.IsNot(), m.Name("None"))])
    allowed: set[cst.CSTNode] = set()
    for node in m.findall(fn.body, m.IfExp(test=is_none, orelse=m.Name(name)) | m.IfExp(test=not_none, body=m.Name(name))):
        ifexp = cst.ensure_type(node, cst.IfExp)
        given = ifexp.orelse if m.matches(ifexp.test, is_none) else ifexp.body
        computed = ifexp.body if given is ifexp.orelse else ifexp.orelse
        if name in names_in(computed):
            continue
        allowed |= set(m.findall(ifexp.test, m.Name(name))) | {given}
    uses = m.findall(fn.body, m.Name(name))
    return bool(uses) and all(n in allowed for n in uses)


def dropped_at_hand_off(body: list[cst.BaseStatement], loop: cst.For, name: str, nonlast: Sequence[cst.Return]) -> bool:
    """``name`` is carried from layer to layer, but every stage starts it again from None (bound only to
    None before the loop, at forward's top level) and nothing between the loop and the non-last return
    reads it: the model's own hand-off drops it at every stage boundary, and since any layer boundary can be
    a stage boundary, the layers need only the stream sent there (Beam's ``normalized_states``, the next
    layer's input norm computed early, which a layer given None computes itself)."""
    start = next((i for i, s in enumerate(body) if s is loop), None)
    if start is None:
        return False
    before = [s for s in body[:start] if name in bound_names(s)]
    none = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(name))], value=m.Name("None"))
                                       | m.AnnAssign(target=m.Name(name), value=m.Name("None"))])
    if not before or not all(m.matches(s, none) for s in before):
        return False
    for stmt in body[start + 1:]:
        if any(r is x for r in nonlast for x in m.findall(stmt, m.Return())):
            inner = stmt.body.body if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock) else ()
            for s in inner:
                if any(r is x for r in nonlast for x in m.findall(s, m.Return())):
                    return name not in names_in(s)
                if name in names_in(s):
                    return False
            return True
        if name in names_in(stmt):
            return False
    return False


def _check_return_placement(fn: cst.FunctionDef, ret: cst.Return) -> None:
    for line in m.findall(fn, m.SimpleStatementSuite()):
        if any(x is ret for x in m.findall(line, m.Return())):
            raise Decline(f"the last-rank return `{snippet_of(ret)}` is on one line with its `if`/`else`", ret)
    for line in m.findall(fn, m.SimpleStatementLine()):
        if any(x is ret for x in cst.ensure_type(line, cst.SimpleStatementLine).body) and len(line.body) > 1:  # type: ignore[attr-defined]
            raise Decline(f"the last-rank return `{snippet_of(ret)}` shares its line with other statements", ret)


class _Reads(cst.CSTVisitor):
    """Names read (not only assigned) in a subtree."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.targets: set[cst.CSTNode] = set()

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.targets |= {n for n in m.findall(node.target, m.Name())
                         if not any(n is x for a in m.findall(node.target, m.Attribute() | m.Subscript())
                                    for x in m.findall(a, m.Name()))}

    def visit_Name(self, node: cst.Name) -> None:
        if node not in self.targets:
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




__all__ = ["bound_names", "forward_plan", "plan_loop", "running_loops"]
