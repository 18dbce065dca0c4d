"""The layer loop of a vLLM PP decoder and the plan of its rewrite, as data: the loop forms vLLM uses
(``islice(self.layers, self.start_layer, self.end_layer)``, a slice, ``enumerate`` of either,
``islice(enumerate(...))``, ``range(start, end)``), how to read the loop's global layer index, the
``ForwardPlan`` record and ``Decline``. Pure libcst; imports no vLLM and, of the
vllm_native_* modules, only vllm_native_names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.scope import own_scope
from pipespec.codemods.vllm_forward_shape import (
    END,
    ENUMERATE,
    RANGE,
    STAGE_LAYERS,
    START,
    self_attr,
)
from pipespec.codemods.vllm_native_names import snippet_of
from pipespec.contract.names import AUX_OVER_PP_FLAG

CAPTURE_CALLS = ("_maybe_add_hidden_state",)
_ISLICE_ENUM = m.Call(func=m.Name("islice") | m.Attribute(attr=m.Name("islice")),
                      args=[m.Arg(m.Call(func=m.Name("enumerate"), args=[m.Arg(self_attr())])), m.Arg(START), m.Arg(END)])
STAGE_LOOP_ITER = STAGE_LAYERS | ENUMERATE | _ISLICE_ENUM | RANGE
#: forward asks ``get_pp_group()`` by that spelling, which the generated rank checks then use without an import
#: (vLLM's names are otherwise matched by what they are bound to: vllm_native_qualified)
RANK = m.Attribute(value=m.Call(func=m.Name("get_pp_group"), args=[]), attr=m.Name("is_first_rank") | m.Name("is_last_rank"))


class Decline(Exception):
    """The decoder cannot be rewritten safely: ``reason`` names the construct, ``node`` where it is."""

    def __init__(self, reason: str, node: cst.CSTNode) -> None:
        super().__init__(reason)
        self.reason, self.node = reason, node


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
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(AUX_OVER_PP_FLAG))])
                                                      | m.AnnAssign(target=m.Name(AUX_OVER_PP_FLAG))])):
            return cst.ensure_type(stmt, cst.SimpleStatementLine)
    return None


def stage_aliases(fn: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    """Local names forward binds, once, to this stage's layers (MiniMax-M3 AMD: ``layers =
    self.layers[self.start_layer : self.end_layer]`` before loops inside ``if``/``try``)."""
    binds: dict[str, list[cst.BaseExpression | None]] = {}
    for node in m.findall(fn.body, m.Assign() | m.AnnAssign() | m.AugAssign()):
        targets = ([t.target for t in node.targets] if isinstance(node, cst.Assign)  # type: ignore[attr-defined]
                   else [node.target])  # type: ignore[attr-defined]
        value = node.value if isinstance(node, (cst.Assign, cst.AnnAssign)) else None  # type: ignore[attr-defined]
        for target in targets:
            for name in m.findall(target, m.Name()):
                binds.setdefault(cst.ensure_type(name, cst.Name).value, []).append(
                    value if isinstance(target, cst.Name) else None)
    return {name: values[0] for name, values in binds.items()
            if len(values) == 1 and values[0] is not None and m.matches(values[0], STAGE_LAYERS)}


def _alias_iter(it: cst.BaseExpression, aliases: dict[str, cst.BaseExpression]) -> bool:
    """``layers`` / ``enumerate(layers, ...)`` with ``layers`` one of ``aliases``."""
    inner = it.args[0].value if m.matches(it, m.Call(func=m.Name("enumerate"), args=[m.Arg(keyword=None), m.ZeroOrMore()])) else it  # type: ignore[attr-defined]
    return isinstance(inner, cst.Name) and inner.value in aliases


def conditional_iter(it: cst.BaseExpression) -> cst.IfExp | None:
    """``<this stage's layers> if c else <other>`` (or the reverse), alone or enumerated: the loop runs the
    stage's layers on one branch only (MuseSpark AMD runs them through ``mono`` on the other)."""
    inner = it.args[0].value if m.matches(it, m.Call(func=m.Name("enumerate"), args=[m.Arg(keyword=None), m.ZeroOrMore()])) else it  # type: ignore[attr-defined]
    if isinstance(inner, cst.IfExp) and (m.matches(inner.body, STAGE_LAYERS) or m.matches(inner.orelse, STAGE_LAYERS)):
        return inner
    return None


def stage_loops(fn: cst.FunctionDef) -> list[cst.For]:
    """forward's own loops over this stage's layers: the forms of ``STAGE_LOOP_ITER``, a local name for
    them (``stage_aliases``), or a conditional expression with them on one branch (``conditional_iter``)."""
    aliases = stage_aliases(fn)
    return [loop for loop in own_scope(fn).loops
            if m.matches(loop.iter, STAGE_LOOP_ITER) or _alias_iter(loop.iter, aliases) or conditional_iter(loop.iter)]


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
    own_capture: bool = False  # the loop keeps the model's own after-layer capture (see own_value_captures)
    before_capture: cst.If | None = None  # the model's own capture before each layer, kept and guarded ...
    end_capture: cst.If | None = None  # ... and its `self.end_layer` capture, moved before the non-last return
    stale_residual: bool = False  # the layers rebind the residual they are passed: the stream is hidden alone
    #: (layer variable, classes that rebind it): the layer classes disagree (picked by config: Molmo's
    #: norm_after), so each capture after a layer asks which class just ran
    stale_for: tuple[str, tuple[str, ...]] | None = None
    #: a layer class returns None for the residual (MiniCPM, Molmo's norm-after layers) and the next stage's
    #: first layer rebinds the one it is given whenever that happens (vllm_native_residual.zero_is_none):
    #: the non-last hand-off sends zeros in place of None, which vLLM's runners cannot copy
    zero_none_residual: bool = False
    #: the model's own capture of id ``start_layer`` before the loop (``if self.start_layer in
    #: self.aux_hidden_state_layers: ...``, Cohere2-MoE's clone of the embedding), kept on the first rank
    start_capture: cst.If | None = None
    #: the residual argument of the model's own capture after each layer where it picks by config
    #: (``residual if self.uses_rms_norm else None``): the model says when the residual is in the stream
    residual_arg: str | None = None
    #: ``if self.use_sequence_parallel: hidden_states = sp_all_gather(hidden_states)[...]`` between the loop
    #: and the non-last return (Step5): the same gather is applied to each captured state after it
    gather: cst.If | None = None


def parse_loop(loop: cst.For, used: set[str], aliases: dict[str, cst.BaseExpression] | None = None) -> Loop:
    """How to read the loop's global index. ``aliases`` (``stage_aliases``) stand for the layers they name."""
    it, target = loop.iter, loop.target
    one = cst.Integer("1")
    aliased: cst.Name | None = None
    conditional = conditional_iter(it)
    if conditional is not None:
        raise Decline(f"the layer loop runs over a conditional expression (`{snippet_of(conditional)}`): on its other "
                      "branch this stage's layers run elsewhere, which the rewrite does not follow", loop)
    if aliases and _alias_iter(it, aliases):
        name = cst.ensure_type(it.args[0].value if isinstance(it, cst.Call) else it, cst.Name)
        real = aliases[name.value]
        aliased = name
        it = it.with_changes(args=[it.args[0].with_changes(value=real), *it.args[1:]]) if isinstance(it, cst.Call) else real

    def plus_one(idx: str) -> cst.BaseExpression:
        return cst.BinaryOperation(cst.Name(idx), cst.Add(), one)

    if m.matches(it, RANGE):
        if not isinstance(target, cst.Name):
            raise Decline(f"the range loop's target `{snippet_of(target)}` is not one name", loop)
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
            raise Decline(f"the islice(enumerate(...)) loop's target `{snippet_of(target)}` is not `index, layer`", loop)
        idx = cst.ensure_type(cst.ensure_type(target, cst.Tuple).elements[0].value, cst.Name).value
        return Loop(loop, attr, plus_one(idx), None, None)
    enumerated = m.matches(it, ENUMERATE)
    args = cst.ensure_type(it, cst.Call).args if enumerated else ()
    stage_layers = args[0].value if enumerated else it
    attr = cst.ensure_type(m.findall(stage_layers, self_attr())[0], cst.Attribute).attr.value
    if not enumerated:
        idx = fresh("idx", used)
        new_iter = cst.Call(cst.Name("enumerate"), [
            cst.Arg(aliased or stage_layers, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
            cst.Arg(START_EXPR(), keyword=cst.Name("start"), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))])
        new_target = cst.Tuple([cst.Element(cst.Name(idx), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                                cst.Element(target)], lpar=[], rpar=[])
        return Loop(loop, attr, plus_one(idx), new_iter, new_target)
    if not m.matches(target, m.Tuple([m.Element(m.Name()), m.Element()])):
        raise Decline(f"the enumerate loop's target `{snippet_of(target)}` is not `index, layer`", loop)
    idx = cst.ensure_type(cst.ensure_type(target, cst.Tuple).elements[0].value, cst.Name).value
    if len(args) == 1:  # counts from 0 on every stage: the global id is start_layer + idx + 1
        return Loop(loop, attr, cst.parse_expression(f"self.start_layer + {idx} + 1"), None, None)
    if len(args) == 2 and m.matches(args[1].value, START) and (args[1].keyword is None or args[1].keyword.value == "start"):
        return Loop(loop, attr, plus_one(idx), None, None)
    raise Decline(f"the enumerate loop counts from `{snippet_of(args[1].value)}`, not self.start_layer", loop)


def START_EXPR() -> cst.Attribute:  # noqa: N802 - reads like the constant it builds
    return cst.Attribute(cst.Name("self"), cst.Name("start_layer"))


def fresh(base: str, used: set[str]) -> str:
    name, n = base, 1
    while name in used:
        name, n = f"{base}_{n}", n + 1
    return name



def layer_call_at(loop: cst.For, parsed: Loop) -> int | None:
    """Index, in the loop body, of the statement that calls the layer (``layer(...)`` / ``self.layers[i](...)``)."""
    target = loop.target
    names = {cst.ensure_type(target.elements[-1].value, cst.Name).value} if (
        isinstance(target, cst.Tuple) and isinstance(target.elements[-1].value, cst.Name)) else set()
    if isinstance(target, cst.Name) and not m.matches(loop.iter, RANGE):  # `for layer in islice(...)`
        names.add(target.value)
    body = list(cst.ensure_type(loop.body, cst.IndentedBlock).body)
    indexed = m.Subscript(value=self_attr(parsed.layers_attr))
    for stmt in body:  # `layer = self.layers[i]` in a range loop
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=indexed)])):
            names.add(cst.ensure_type(cst.ensure_type(stmt.body[0], cst.Assign).targets[0].target, cst.Name).value)  # type: ignore[attr-defined]
    layer = m.OneOf(*(m.Name(n) for n in names)) | indexed if names else indexed
    # `(kernel or layer)(...)`: a specialized kernel standing in for the layer, same inputs and outputs
    # (Kimi-K3 AMD, MiniMax-M3 AMD under their specialized decode)
    call = m.Call(func=layer | m.BooleanOperation(operator=m.Or(), right=layer) | m.BooleanOperation(operator=m.Or(), left=layer))
    for i, stmt in enumerate(body):
        if m.findall(stmt, m.Assign(value=call)):
            return i
    return None




# name, the class whose module sees it -> the classes it means there (one; several for a module-level
# table such as Jamba's ALL_DECODER_LAYER_TYPES = {"attention": A, "mamba": B}), each with the lookup of
# its own module; [] where the source does not say
ClassLookup = Callable[[str, "cst.ClassDef | None"], "list[tuple[cst.ClassDef, ClassLookup]]"]

