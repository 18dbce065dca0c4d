"""``RelayAuxStatesCommand``: an SGLang decoder's ``forward`` captures on every rank and relays over PP.

SGLang's decoders collect EAGLE3 aux states while they loop over ``range(self.start_layer,
self.end_layer)`` (``capture_output=aux.capture if i in self.layers_to_capture else None``) and a non-last
rank returns ``residual_batch.to_pp(hidden_states, forward_batch)`` without them, so everything captured
before the last stage is lost. The rewrite follows pipespec's contract (docs/aux-ids.md): ids are sorted
and deduplicated (slot = position, key ``aux_hidden_states_{slot}``); stage s produces the ids L with
``start_s < L <= end_s`` (stage 0 also id 0).

Before (llama.py, ``LlamaModel.forward``)::

    aux_hidden_states = AuxHiddenStateList()
    for i in range(self.start_layer, self.end_layer):
        hidden_states = self.layers[i](..., capture_output=aux_hidden_states.capture
                                       if i in self.layers_to_capture else None)
    if not self.pp_group.is_last_rank:
        return residual_batch.to_pp(hidden_states, forward_batch)

After::

    aux_layer_ids = sorted(set(self.layers_to_capture))
    aux_hidden_states = AuxHiddenStateList()
    if not self.pp_group.is_first_rank:
        aux_upstream = len([aux_id for aux_id in aux_layer_ids if aux_id <= self.start_layer])
        for aux_slot in range(aux_upstream):
            ...  # the upstream states, in slot order; a missing key names the keys present
            aux_hidden_states.append(pp_proxy_tensors[aux_key])
    for i in range(self.start_layer, self.end_layer):
        hidden_states = self.layers[i](..., capture_output=aux_hidden_states.capture
                                       if i in self.layers_to_capture
                                       and (i > self.start_layer or self.pp_group.is_first_rank) else None)
    if self.end_layer in aux_layer_ids:
        aux_hidden_states.append(residual_batch.snapshot(hidden_states, forward_batch))
    if not self.pp_group.is_last_rank:
        pp_hand_off = residual_batch.to_pp(hidden_states, forward_batch)
        for aux_slot, aux_hidden in enumerate(aux_hidden_states):
            pp_hand_off.tensors[f"aux_hidden_states_{aux_slot}"] = aux_hidden
        return pp_hand_off

The capture at layer i's entry is SGLang's own (id i); the entry of a non-first stage's first layer is
skipped (that id was its upstream stage's last output), and the stage's last output (id ``end_layer``,
the pre-norm stream on the last rank) is read with ``residual_batch.snapshot``, the stream value the next
layer's entry capture would see. A packer decoder (``AuxHiddenStatePacker``, deepseek_v2) keeps its packed
buffer on the last rank and collects into an ``AuxHiddenStateList`` elsewhere (a non-last rank sends
one key per slot). The last rank's list or buffer reaches the logits processor where it did before.

Names are matched by qualified name (``QualifiedNameProvider``): the collectors of
``sglang.srt.layers.aux_hidden_states``, ``residual.batch.to_pp`` and ``PPProxyTensors``. A shape it
cannot rewrite is a decline naming the construct and its line. Idempotent: a forward that already
computes ``aux_layer_ids`` is left alone. Parses source only; imports libcst and the outcome types.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from pipespec.codemods.sglang_outcome import CaptureForm, DecoderOutcome, SglangStatus
from pipespec.contract.names import AUX_KEY_PREFIX, AUX_OVER_PP_FLAG

AUX_MODULE = "sglang.srt.layers.aux_hidden_states"
LIST_NAME = "AuxHiddenStateList"
COLLECTORS = {f"{AUX_MODULE}.{LIST_NAME}": CaptureForm.LIST,
              f"{AUX_MODULE}.AuxHiddenStatePacker": CaptureForm.PACKER,
              f"{AUX_MODULE}.AuxHiddenStatePacker.for_batch": CaptureForm.PACKER}
TO_PP = "sglang.srt.layers.layer_boundary.residual.batch.to_pp"
PROXY = "sglang.srt.model_executor.forward_batch_info.PPProxyTensors"
IDS_VAR = "aux_layer_ids"
HAND_OFF_VAR = "pp_hand_off"
PROXY_PARAM = "pp_proxy_tensors"

SELF_PP = m.Attribute(value=m.Name("self"), attr=m.Name("pp_group"))
NOT_LAST = m.UnaryOperation(operator=m.Not(), expression=m.Attribute(value=SELF_PP, attr=m.Name("is_last_rank")))
IDS_STMT = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(IDS_VAR))])])


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node).strip()


def _stmt(text: str) -> cst.BaseStatement:
    return cst.parse_statement(text)


def _comment(text: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment(f"# pipespec: {text}"))


def is_pp_loop(node: cst.CSTNode) -> bool:
    """A ``for`` over ``range(...)`` bounded by the stage's layers (``self.start_layer`` / ``end_layer``, or a
    local named for them such as deepseek_v2's ``normal_start_layer``)."""
    if not m.matches(node, m.For(iter=m.Call(func=m.Name("range")))):
        return False
    bounds = m.findall(cst.ensure_type(node, cst.For).iter, m.Name() | m.Attribute())
    for bound in bounds:
        name = bound.attr.value if isinstance(bound, cst.Attribute) else cst.ensure_type(bound, cst.Name).value
        if name.endswith(("start_layer", "end_layer")):
            return True
    return False


def pp_forward(cls: cst.ClassDef) -> cst.FunctionDef | None:
    """The class's own ``forward`` when it has a pipeline layer loop (the class is then a decoder), else None."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    forwards = [s for s in body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
    if not forwards:
        return None
    forward = cst.ensure_type(forwards[-1], cst.FunctionDef)
    return forward if any(is_pp_loop(n) for n in own_nodes(forward, m.For())) else None


def own_nodes(fn: cst.FunctionDef, matcher: m.BaseMatcherNode) -> list[cst.CSTNode]:
    """The nodes of ``fn``'s own code matching ``matcher`` (nested ``def``s and classes left out)."""
    nested = [n for n in m.findall(fn.body, m.FunctionDef() | m.ClassDef())]
    inner = {id(x) for n in nested for x in m.findall(n, matcher)}
    return [n for n in m.findall(fn.body, matcher) if id(n) not in inner]


@dataclass(frozen=True)
class HandOff:
    """What a non-last rank returns: the proxy expression, the stream's value for a capture, and
    how the return statement becomes one that carries the aux keys."""

    stream: cst.BaseExpression
    rewrite: Callable[[Sequence[cst.BaseStatement]], list[cst.BaseStatement]]


class Decline(Exception):
    """A construct the dialect cannot rewrite: ``reason`` names it, ``node`` gives the line."""

    def __init__(self, reason: str, node: cst.CSTNode | None = None, form: CaptureForm = CaptureForm.LIST) -> None:
        super().__init__(reason)
        self.reason, self.node, self.form = reason, node, form


class RelayAuxStatesCommand(VisitorBasedCodemodCommand):
    """Rewrite every decoder class (a ``forward`` with a pipeline layer loop) of an SGLang model file."""

    DESCRIPTION = "SGLang decoders capture EAGLE3 aux states on every PP rank and relay them in PPProxyTensors."
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, context: CodemodContext, outcomes: list[DecoderOutcome],
                 classes: Collection[str] | None = None, line_offsets: Mapping[str, int] | None = None) -> None:
        super().__init__(context)
        self.outcomes = outcomes
        self.classes = None if classes is None else set(classes)
        #: Added to a class's lines: the command may run on a module of the file's imports and decoder classes
        #: only (``adapt_sglang``), and reports the lines of the whole file.
        self.line_offsets = dict(line_offsets or {})
        self._offset = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._offset = self.line_offsets.get(node.name.value, 0)

    # -- helpers reading metadata of the original tree

    def _line(self, node: cst.CSTNode | None) -> int:
        if node is None:
            return 0
        return self.get_metadata(PositionProvider, node).start.line + self._offset

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _collector_form(self, node: cst.CSTNode) -> CaptureForm | None:
        if not isinstance(node, cst.Call):
            return None
        for name in self._qualified(node.func):
            if name in COLLECTORS:
                return COLLECTORS[name]
        return None

    def _calls(self, node: cst.CSTNode | None, qualified: str) -> bool:
        return isinstance(node, cst.Call) and qualified in self._qualified(node.func)

    # -- the class

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        name = original_node.name.value
        if self.classes is not None and name not in self.classes:
            return updated_node
        body = original_node.body.body if isinstance(original_node.body, cst.IndentedBlock) else ()
        forwards = [s for s in body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
        if not forwards:
            return updated_node
        forward = cst.ensure_type(forwards[-1], cst.FunctionDef)
        loops = [n for n in own_nodes(forward, m.For()) if is_pp_loop(n)]
        if not loops:
            return updated_node
        try:
            new_forward, form = self._adapt(forward, cst.ensure_type(loops[0], cst.For))
        except Decline as why:
            line = self._line(why.node)
            where = f" (line {line})" if line else ""
            self.outcomes.append(DecoderOutcome(cls=name, status=SglangStatus.DECLINED, reason=f"{why.reason}{where}",
                                                capture_form=why.form, line=line))
            return updated_node
        if new_forward is None:
            self.outcomes.append(DecoderOutcome(cls=name, status=SglangStatus.UNCHANGED, capture_form=form,
                                                reason="forward already relays aux states over PP",
                                                line=self._line(forward)))
            return updated_node
        self.outcomes.append(DecoderOutcome(cls=name, status=SglangStatus.ADAPTED, capture_form=form,
                                            reason="captures on every rank; relays aux states in PPProxyTensors",
                                            line=self._line(forward)))
        new_body = [new_forward if s is forward else s for s in body]
        if not any(m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(AUX_OVER_PP_FLAG))])]))
                   for s in new_body):
            flag = _stmt(f"{AUX_OVER_PP_FLAG} = True\n").with_changes(
                leading_lines=[_comment("forward captures on every rank and relays aux states (adapt_sglang)")])
            at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else 0
            if at < len(new_body) and not new_body[at].leading_lines:
                new_body[at] = new_body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            new_body.insert(at, flag)
        return original_node.with_changes(body=cst.ensure_type(original_node.body, cst.IndentedBlock)
                                          .with_changes(body=new_body))

    # -- the forward

    def _adapt(self, forward: cst.FunctionDef, loop: cst.For) -> tuple[cst.FunctionDef | None, CaptureForm]:
        block = cst.ensure_type(forward.body, cst.IndentedBlock)
        body = list(block.body)
        collectors = [n for n in own_nodes(forward, m.Call()) if self._collector_form(n) is not None]
        if not collectors:
            raise Decline("captures no aux states: no AuxHiddenStateList or AuxHiddenStatePacker in forward",
                          loop, CaptureForm.NONE)
        form = self._collector_form(collectors[0])
        assert form is not None
        if any(m.matches(s, IDS_STMT) for s in body):
            return None, form
        at_top = [i for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine(
            body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call())]))
            and self._collector_form(cst.ensure_type(cst.ensure_type(s, cst.SimpleStatementLine).body[0], cst.Assign)
                                     .value) is not None]
        if len(at_top) != 1 or len(collectors) != 1:
            raise Decline(f"{len(collectors)} aux collectors in forward, {len(at_top)} of them assigned at its top "
                          "level (one is rewritable)", collectors[0], form)
        c = at_top[0]
        assign = cst.ensure_type(cst.ensure_type(body[c], cst.SimpleStatementLine).body[0], cst.Assign)
        aux = cst.ensure_type(assign.targets[0].target, cst.Name).value
        holders = [i for i, s in enumerate(body) if i > c and (s is loop or any(x is loop for x in m.findall(s, m.For())))]
        if not holders:
            raise Decline(f"the layer loop `{_code(loop.iter)}` does not come after the collector in forward", loop, form)
        i_loop = holders[0]
        if not isinstance(loop.target, cst.Name):
            raise Decline(f"the layer loop binds `{_code(loop.target)}`, not one index name", loop, form)
        index = loop.target.value
        if not m.findall(loop.body, capture_choice(aux)):
            raise Decline(f"the layer loop does not pass `{aux}` to its layers as `... if <test> else None`", loop, form)
        params = [p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)]
        if PROXY_PARAM not in params:
            raise Decline(f"forward takes no `{PROXY_PARAM}` (the states received from upstream)", forward, form)
        ifs = [i for i, s in enumerate(body) if i > i_loop and m.matches(s, m.If(test=NOT_LAST))]
        if not ifs:
            raise Decline("no `if not self.pp_group.is_last_rank:` hand-off at forward's top level after the layer loop",
                          loop, form)
        handoff_if = cst.ensure_type(body[ifs[0]], cst.If)
        handoff = self._hand_off(handoff_if, aux, form)

        new_loop = body[i_loop].visit(_GuardFirstLayer(aux, index))
        assert isinstance(new_loop, cst.BaseStatement)
        collector = body[c]
        if form is CaptureForm.PACKER:
            AddImportsVisitor.add_needed_import(self.context, AUX_MODULE, LIST_NAME)
            packer = assign.value
            collector = cst.ensure_type(collector, cst.SimpleStatementLine).with_changes(body=[assign.with_changes(
                value=cst.IfExp(test=cst.parse_expression("self.pp_group.is_last_rank"), body=packer,
                                orelse=cst.parse_expression(f"{LIST_NAME}()")))])
        ids = _stmt(f"{IDS_VAR} = sorted(set(self.layers_to_capture))\n").with_changes(
            leading_lines=[*body[c].leading_lines,
                           _comment("aux ids sorted and deduplicated; slot = position, key aux_hidden_states_{slot}")])
        collector = collector.with_changes(leading_lines=())
        seed = _stmt(
            "if not self.pp_group.is_first_rank:\n"
            "    # pipespec: ids up to start_layer were captured upstream and arrive in slot order\n"
            f"    aux_upstream = len([aux_id for aux_id in {IDS_VAR} if aux_id <= self.start_layer])\n"
            "    for aux_slot in range(aux_upstream):\n"
            f"        aux_key = f\"{AUX_KEY_PREFIX}{{aux_slot}}\"\n"
            f"        if aux_key not in {PROXY_PARAM}.tensors:\n"
            "            raise KeyError(\n"
            "                f\"{aux_key} is missing from the pipeline hand-off; \"\n"
            f"                f\"keys present: {{sorted({PROXY_PARAM}.tensors)}}\"\n"
            "            )\n"
            f"        {aux}.append({PROXY_PARAM}[aux_key])\n")
        last = cst.Module(body=[]).code_for_node(handoff.stream)
        capture_last = _stmt(f"if self.end_layer in {IDS_VAR}:\n    {aux}.append({last})\n").with_changes(
            leading_lines=[*body[ifs[0]].leading_lines,
                           _comment("the stage's last output (id end_layer) is this stage's to capture")])
        new_if = handoff_if.with_changes(leading_lines=(), body=cst.ensure_type(handoff_if.body, cst.IndentedBlock)
                                         .with_changes(body=handoff.rewrite(handoff_if.body.body)))
        new_body = [*body[:c], ids, collector, seed, *body[c + 1:i_loop], new_loop, *body[i_loop + 1:ifs[0]],
                    capture_last, new_if, *body[ifs[0] + 1:]]
        return forward.with_changes(body=block.with_changes(body=new_body)), form

    def _hand_off(self, handoff_if: cst.If, aux: str, form: CaptureForm) -> HandOff:
        stmts = list(cst.ensure_type(handoff_if.body, cst.IndentedBlock).body)
        ret = stmts[-1] if stmts else None
        if not m.matches(ret, m.SimpleStatementLine(body=[m.Return(value=m.DoNotCare())])):
            raise Decline("the non-last rank's branch does not end in a `return`", handoff_if, form)
        value = cst.ensure_type(cst.ensure_type(ret, cst.SimpleStatementLine).body[0], cst.Return).value
        relay = (f"for aux_slot, aux_hidden in enumerate({aux}):\n"
                 f"    {{proxy}}.tensors[f\"{AUX_KEY_PREFIX}{{{{aux_slot}}}}\"] = aux_hidden\n")
        call: cst.BaseExpression | None = value
        named: str | None = None
        if isinstance(value, cst.Name):
            named = value.value
            sources = [cst.ensure_type(cst.ensure_type(s, cst.SimpleStatementLine).body[0], cst.Assign).value
                       for s in stmts if m.matches(s, m.SimpleStatementLine(
                           body=[m.Assign(targets=[m.AssignTarget(m.Name(named))])]))]
            call = sources[0] if len(sources) == 1 else None
        if self._calls(call, TO_PP):
            to_pp = cst.ensure_type(call, cst.Call)
            if len(to_pp.args) != 2 or any(a.keyword or a.star for a in to_pp.args):
                raise Decline(f"`{_code(to_pp)}` is not to_pp(hidden_states, forward_batch)", to_pp, form)
            module = cst.ensure_type(to_pp.func, cst.Attribute).value if isinstance(to_pp.func, cst.Attribute) else None
            if module is None:
                raise Decline(f"`{_code(to_pp)}`: to_pp is not called through its module (residual.batch)", to_pp, form)
            stream = cst.parse_expression(f"{_code(module)}.snapshot({_code(to_pp.args[0].value)}, "
                                          f"{_code(to_pp.args[1].value)})")
        elif self._calls(call, PROXY):
            stream = self._dict_stream(cst.ensure_type(call, cst.Call), stmts, form)
        else:
            raise Decline(f"the non-last rank returns `{_code(value)}`, not a PPProxyTensors hand-off", ret, form)

        def rewrite(old: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
            head, tail = list(old[:-1]), old[-1]
            if named is not None:
                return [*head, _stmt(relay.format(proxy=named)), tail]
            bind = _stmt(f"{HAND_OFF_VAR} = {_code(value)}\n").with_changes(leading_lines=tail.leading_lines)
            return [*head, bind, _stmt(relay.format(proxy=HAND_OFF_VAR)), _stmt(f"return {HAND_OFF_VAR}\n")]

        return HandOff(stream=stream, rewrite=rewrite)

    def _dict_stream(self, call: cst.Call, stmts: Sequence[cst.BaseStatement], form: CaptureForm) -> cst.BaseExpression:
        """``PPProxyTensors({"hidden_states": h, "residual": r})``: the stream is ``h + r`` (``h`` when ``r`` is None),
        read before the branch, so ``h`` and ``r`` must be plain names the branch does not rebind."""
        entries: dict[str, cst.BaseExpression] = {}
        arg = call.args[0].value if len(call.args) == 1 else None
        if isinstance(arg, cst.Dict):
            for el in arg.elements:
                if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
                    entries[el.key.evaluated_value if isinstance(el.key.evaluated_value, str) else ""] = el.value
        hidden, residual = entries.get("hidden_states"), entries.get("residual")
        rebound = {cst.ensure_type(t.target, cst.Name).value for s in stmts
                   for t in m.findall(s, m.AssignTarget(target=m.Name()))}
        names = [x for x in (hidden, residual) if x is not None]
        if hidden is None or not all(isinstance(x, cst.Name) and x.value not in rebound for x in names):
            raise Decline(f"`{_code(call)}`: not a dict of hidden_states/residual names read before the branch", call, form)
        h = _code(hidden)
        if residual is None:
            return cst.parse_expression(f"{h}.clone()")
        r = _code(residual)
        return cst.parse_expression(f"{h}.clone() if {r} is None else {h} + {r}")


def capture_choice(aux: str) -> m.IfExp:
    """``<collector or its method> if <test> else None``: how a layer is told to capture (SGLang's
    ``capture_output=aux.capture if i in self.layers_to_capture else None``, qwen2_moe's
    ``captured_last_layer_outputs=aux if getattr(layer, "_is_layer_to_capture", False) else None``)."""
    return m.IfExp(body=m.Name(aux) | m.Attribute(value=m.Name(aux)), orelse=m.Name("None"))


class _GuardFirstLayer(cst.CSTTransformer):
    """``<collector> if <test> else None`` → ``... if <test> and (i > self.start_layer or
    self.pp_group.is_first_rank) else None``: a non-first stage's first layer entry is the upstream
    stage's last output, captured there."""

    def __init__(self, aux: str, index: str) -> None:
        super().__init__()
        self.aux, self.index = aux, index

    def leave_IfExp(self, original_node: cst.IfExp, updated_node: cst.IfExp) -> cst.BaseExpression:
        if not m.matches(original_node, capture_choice(self.aux)):
            return updated_node
        guard = cst.parse_expression(f"({self.index} > self.start_layer or self.pp_group.is_first_rank)")
        return updated_node.with_changes(test=cst.BooleanOperation(left=updated_node.test, operator=cst.And(),
                                                                   right=guard))
