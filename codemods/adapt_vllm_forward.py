"""The ``pipespec`` dialect: adapt a vLLM-style decoder stack for pipespec's own runtime (it captures,
relays and collects aux hidden states over PP through ``pipespec.contract.mixin.AuxHiddenStatesMixin``).

Code for vLLM itself is the ``vllm`` dialect (``adapt_vllm_native``: vLLM's own EAGLE3-over-PP contract).

Input shape (one class, named by the caller)::

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        if get_pp_group().is_first_rank: hidden_states = <embed>; residual = None
        else: hidden_states = intermediate_tensors["hidden_states"]; residual = ...
        for layer in islice(self.layers, self.start_layer, self.end_layer):   # or enumerate(...), a
            hidden_states, residual = layer(positions, hidden_states, residual)  # slice, range(...)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

What the codemod does (docs/codemods.md, "vLLM dialect", has the full before/after):

* the class inherits ``pipespec.contract.mixin.AuxHiddenStatesMixin`` and carries the own-dict marker
  ``supports_aux_hidden_states_over_pp = True`` and ``pipespec_has_residual``;
* the stage plan is the source of truth: ``get_pp_group().is_first_rank`` / ``.is_last_rank`` in forward
  become ``self.is_first_stage`` / ``self.is_last_stage``, and ``self.start_layer, self.end_layer`` from
  ``make_layers`` in ``__init__`` are kept as ``self.pipespec_built_layer_range`` (the mixin owns
  ``start_layer``/``end_layer`` as properties and checks the two agree);
* forward collects upstream states first, captures id 0 before the loop (first stage), captures id
  ``idx + 1`` after layer ``idx`` with an absolute ``enumerate(..., start=self.start_layer)``, packs its
  own and relays upstream states into the non-last ``IntermediateTensors``, and returns
  ``(hidden_states, aux_hidden_states)`` on the last stage when aux ids are set.

Anything else raises ``SkipFile`` with the reason and line; a class that is already adapted raises
``SkipFile`` starting with ``ALREADY_ADAPTED`` (so running twice changes nothing). The codemod only
parses source: it never imports or executes the code it transforms. Imports libcst,
``pipespec.contract.spec`` and the codemods' own analysis modules; must not import vllm or torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, SkipFile, VisitorBasedCodemodCommand
from libcst.helpers import parse_template_statement
from libcst.metadata import PositionProvider

from pipespec.codemods.import_edits import add_first_party_import, drop_unused_import
from pipespec.codemods.scope import FunctionBodyTransformer
from pipespec.codemods.vllm_forward_shape import (
    END,
    START,
    LoopShape,
    ShapeError,
    assigned_leaves,
    classify_returns,
    find_layer_loop,
    fresh_name,
    is_docstring,
    loop_shape,
    names_in,
    self_attr,
)
from pipespec.codemods.vllm_native_captures import sent_stream
from pipespec.codemods.vllm_native_loop import Decline
from pipespec.contract.names import (
    AUX_MIXIN,
    AUX_MIXIN_MODULE,
    AUX_OVER_PP_FLAG,
    GENERATED_BY_ATTR,
    HAS_RESIDUAL_ATTR,
    NUM_LAYERS_KEY_ATTR,
)
from pipespec.contract.spec import AdapterSpec

GENERATOR = "adapt_vllm_forward"
GENERATOR_VERSION = 1
ALREADY_ADAPTED = "already adapted"
AUX, REMOTE = "aux_hidden_states", "remote_aux_hidden_states"
# Attributes the mixin owns as read-only properties: source that assigns them cannot keep doing so.
MIXIN_PROPERTIES = ("start_layer", "end_layer", "is_first_stage", "is_last_stage", "aux_hidden_state_layers",
                    "pipespec_layout", "pipespec_stage", "aux_hidden_state_relay_keys")
RANK_CHECKS = {"is_first_rank": "is_first_stage", "is_last_rank": "is_last_stage"}

_GET_PP_GROUP = m.Call(func=m.Name("get_pp_group"), args=[])
_MARKER_LINE = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(AUX_OVER_PP_FLAG))])])


def marker_text(source: str, spec: AdapterSpec | None) -> str:
    """The ``pipespec_generated_by`` value: generator and version, source class, spec."""
    return f"{GENERATOR} v{GENERATOR_VERSION}; source {source}; spec {spec.name if spec else 'detected from source'}"


def class_is_marked(node: cst.ClassDef) -> bool:
    """True when the class body assigns the support marker (what adapted code carries)."""
    return isinstance(node.body, cst.IndentedBlock) and any(m.matches(s, _MARKER_LINE) for s in node.body.body)


class _RewriteForward(FunctionBodyTransformer):
    """Rewrite returns and pp-group rank checks inside forward (not inside nested defs or classes)."""

    ENTER_LAMBDAS = True  # a rank check inside a lambda reads forward's own stage plan too

    def __init__(self, nonlast: set[int], last: set[int], aux_value: cst.BaseExpression,
                 tensors_param: str) -> None:
        super().__init__()
        self.nonlast, self.last, self.aux_value, self.tensors_param = nonlast, last, aux_value, tensors_param

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        attr = original_node.attr.value
        if attr in RANK_CHECKS and m.matches(original_node.value, _GET_PP_GROUP):
            return cst.Attribute(value=cst.Name("self"), attr=cst.Name(RANK_CHECKS[attr]))
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        ret = original_node.body[0] if len(original_node.body) == 1 else None
        if id(ret) in self.nonlast:
            assert isinstance(ret, cst.Return) and isinstance(ret.value, cst.Call)
            return updated_node.with_changes(body=[cst.Return(value=_packed_return(ret.value, self.tensors_param))])
        if id(ret) in self.last:
            assert isinstance(ret, cst.Return) and ret.value is not None
            value = updated_node.body[0].value  # type: ignore[attr-defined]
            branch = parse_template_statement(
                "if self.aux_hidden_state_layers:\n    return {value}, {aux}\n", value=value, aux=self.aux_value)
            return cst.FlattenSentinel([branch.with_changes(leading_lines=updated_node.leading_lines),
                                        updated_node.with_changes(leading_lines=())])
        return updated_node


def _packed_return(call: cst.Call, tensors_param: str) -> cst.BaseExpression:
    """``IntermediateTensors({...})`` → the same dict plus this stage's packed aux states, relayed states merged.

    Built as text (one dict entry per line) so the output reads like hand-written code; libcst keeps the
    continuation lines relative to the return statement's indentation.
    """
    code = cst.Module([]).code_for_node
    mapping = cst.ensure_type(call.args[0].value, cst.Dict)
    items = [code(e.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip() for e in mapping.elements]
    items.append(f"**self.pack_local_aux_hidden_states({AUX})")
    entries = "".join(f"        {item},\n" for item in items)
    return cst.parse_expression(
        f"self.relay_aux_hidden_states(\n    {tensors_param},\n    {code(call.func)}({{\n{entries}    }}),\n)"
    )


def _capturing_loop(shape: LoopShape, capture_sum: bool) -> tuple[cst.BaseStatement, cst.For]:
    """The id-0 capture before the loop and the loop with a global index capturing after each layer
    (``hidden + residual`` when ``capture_sum``, the residual stream as it enters the next layer)."""
    loop, idx, hidden, residual = shape.loop, shape.idx, shape.hidden, shape.residual
    after = f"{hidden} + {residual}" if capture_sum else hidden
    first = f"{hidden} if {residual} is None else {hidden} + {residual}" if capture_sum else hidden
    capture = parse_template_statement(
        "if {idx} in self.aux_capture_after_layers:\n    self.capture_aux_hidden_state(" + AUX + ", {value})\n",
        idx=cst.Name(idx), value=cst.parse_expression(after))
    capture = capture.with_changes(body=capture.body.with_changes(header=cst.TrailingWhitespace(
        whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(f"# pipespec: aux id {idx} + 1"))))
    loop_body = cst.ensure_type(loop.body, cst.IndentedBlock)
    new_loop = loop.with_changes(iter=shape.new_iter or loop.iter, target=shape.new_target or loop.target,
                                 body=loop_body.with_changes(body=[*loop_body.body, capture]), leading_lines=())
    id0 = parse_template_statement(
        "if self.aux_capture_input:  # pipespec: aux id 0 (what enters layer 0), first stage\n    "
        "self.capture_aux_hidden_state(" + AUX + ", {value})\n", value=cst.parse_expression(first))
    return id0, new_loop


class AdaptVllmForwardCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Make a vLLM-style decoder stack capture, relay and collect aux hidden states over pipeline parallelism."
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(
        self, context: CodemodContext, class_name: str, spec: AdapterSpec | None = None, source: str | None = None
    ) -> None:
        super().__init__(context)
        self.class_name = class_name
        self.spec = spec
        self.source = source or f"{context.full_module_name or context.filename or '<source>'}:{class_name}"
        self.found = False

    # ------------------------------------------------------------------ helpers
    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _skip(self, node: cst.CSTNode, reason: str) -> SkipFile:
        return SkipFile(f"{self.class_name} (line {self._line(node)}): {reason}")

    # ------------------------------------------------------------------ module
    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if not self.found:
            classes = [s.name.value for s in original_node.body if isinstance(s, cst.ClassDef)]
            raise SkipFile(f"no top-level class {self.class_name!r}; classes here: {', '.join(classes) or 'none'}")
        return add_first_party_import(drop_unused_import(updated_node, "get_pp_group"), AUX_MIXIN_MODULE, AUX_MIXIN)

    # ------------------------------------------------------------------ class
    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False  # the class is rewritten as a whole in leave_ClassDef, from the original node

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if original_node.name.value != self.class_name:
            return updated_node
        self.found = True
        cls = original_node
        if class_is_marked(cls):
            raise SkipFile(f"{ALREADY_ADAPTED}: {self.class_name} carries {AUX_OVER_PP_FLAG} = True")
        if self.spec is not None and self.spec.dialect != "pipespec":
            raise self._skip(cls, f"spec {self.spec.name} ({self.spec.source}) is for the {self.spec.dialect} dialect, "
                                  "not vLLM-style model code")
        if self.spec is not None and not self.spec.supported:
            raise self._skip(cls, f"spec {self.spec.name} ({self.spec.source}) marks it unsupported: {self.spec.reason}")
        if any(m.matches(a.value, m.Name(AUX_MIXIN) | m.Attribute(attr=m.Name(AUX_MIXIN))) for a in cls.bases):
            raise self._skip(cls, f"inherits {AUX_MIXIN} but has no `{AUX_OVER_PP_FLAG} = True`: hand-adapted? "
                                  "add the marker once its forward collects and packs aux states")
        assert isinstance(cls.body, cst.IndentedBlock)
        forwards = [s for s in cls.body.body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
        if not forwards:
            raise self._skip(cls, "defines no forward")
        forward = forwards[-1]
        assert isinstance(forward, cst.FunctionDef)
        self._refuse_mixin_writes(forward)
        new_forward, residual = self._adapt_forward(forward)
        body = []
        for stmt in cls.body.body:
            if stmt is forward:
                body.append(new_forward)
            elif isinstance(stmt, cst.FunctionDef):
                body.append(self._adapt_other_method(stmt))
            else:
                self._refuse_mixin_writes(stmt, class_level=True)
                body.append(stmt)
        markers = [f"{AUX_OVER_PP_FLAG} = True  # pipespec: this class's own forward handles aux hidden states\n",
                   f"{HAS_RESIDUAL_ATTR} = {residual}\n",
                   f"{GENERATED_BY_ATTR} = {json.dumps(marker_text(self.source, self.spec))}\n"]
        if self.spec is not None and self.spec.num_layers_key != "num_hidden_layers":
            markers.append(f"{NUM_LAYERS_KEY_ATTR} = {json.dumps(self.spec.num_layers_key)}\n")
        if self.spec is not None and self.spec.boundary_rule != "allow":  # the plan enforces it from the start
            markers.append(f"_pipespec_boundary_rule = {json.dumps(self.spec.boundary_rule)}\n")
        at = 1 if body and is_docstring(body[0]) else 0
        if at < len(body) and not body[at].leading_lines:
            body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        lines = [cst.parse_statement(text) for text in markers]
        if at:  # a blank line between the class docstring and the markers
            lines[0] = lines[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body[at:at] = lines
        bases = [cst.Arg(cst.Name(AUX_MIXIN), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *cls.bases]
        if not cls.bases:
            bases = [cst.Arg(cst.Name(AUX_MIXIN))]
        return cls.with_changes(
            bases=bases, lpar=cst.LeftParen(), rpar=cst.RightParen(), body=cls.body.with_changes(body=body)
        )

    # ------------------------------------------------------------------ other methods
    def _refuse_mixin_writes(self, node: cst.CSTNode, allowed: Sequence[cst.CSTNode] = (), class_level: bool = False) -> None:
        """Decline code that assigns what the mixin owns: it would raise (no setter) or shadow the plan."""
        for target in m.findall(node, m.AssignTarget() | m.AugAssign() | m.AnnAssign()):
            if any(target is a for a in allowed):
                continue
            for leaf in assigned_leaves(target.target):  # type: ignore[attr-defined]
                if m.matches(leaf, self_attr()):
                    name, shown = cst.ensure_type(leaf, cst.Attribute).attr.value, "self."
                elif class_level and isinstance(leaf, cst.Name):
                    name, shown = leaf.value, "class attribute "
                else:
                    continue
                if name in MIXIN_PROPERTIES:
                    raise self._skip(leaf, f"assigns {shown}{name}, which the mixin owns as a read-only property of "
                                           "the stage plan; remove that assignment (set_pipeline_stage decides it)")

    def _adapt_other_method(self, fn: cst.FunctionDef) -> cst.FunctionDef:
        """Keep ``make_layers``'s range under a new name: ``start_layer``/``end_layer`` are the mixin's."""
        assert isinstance(fn.body, cst.IndentedBlock)
        layer_range = m.Tuple(elements=[m.ZeroOrMore(), m.Element(START), m.Element(END), m.ZeroOrMore()])
        line = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(layer_range)])])
        hits = m.findall(fn, line)
        allowed = [t for h in hits for t in h.body[0].targets]  # type: ignore[attr-defined]
        self._refuse_mixin_writes(fn, allowed)
        if not hits:
            return fn
        used = names_in(fn)
        start, end = fresh_name("built_start_layer", used), fresh_name("built_end_layer", used)
        hit_ids = {id(h) for h in hits}

        class _Rename(cst.CSTTransformer):
            def leave_Element(self, original: cst.Element, updated: cst.Element) -> cst.Element:
                if m.matches(original.value, START):
                    return updated.with_changes(value=cst.Name(start))
                if m.matches(original.value, END):
                    return updated.with_changes(value=cst.Name(end))
                return updated

        class _Insert(cst.CSTTransformer):
            def leave_SimpleStatementLine(
                self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
            ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
                if id(original) not in hit_ids:
                    return updated
                keep = cst.parse_statement(f"self.pipespec_built_layer_range = ({start}, {end})\n")
                return cst.FlattenSentinel([cst.ensure_type(updated.visit(_Rename()), cst.SimpleStatementLine), keep])

        return cst.ensure_type(fn.visit(_Insert()), cst.FunctionDef)

    # ------------------------------------------------------------------ forward
    def _adapt_forward(self, fn: cst.FunctionDef) -> tuple[cst.FunctionDef, bool]:
        params = {p.name.value for p in (*fn.params.posonly_params, *fn.params.params, *fn.params.kwonly_params)}
        if "intermediate_tensors" not in params:
            raise self._skip(fn, "forward has no `intermediate_tensors` parameter: not a vLLM-style pipeline-parallel "
                                 "forward (for HF transformers modeling code use --dialect hf)")
        used = names_in(fn)
        for hand in (AUX, REMOTE, "collect_remote_aux_hidden_states", "aux_hidden_state_layers"):
            if hand in used:
                raise self._skip(fn, f"forward already uses `{hand}`: aux states are handled by hand; review it and add "
                                     f"`{AUX_OVER_PP_FLAG} = True` to the class, or remove that code and regenerate")
        stmts = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
        loop_at, shape, nonlast, last = self._read_forward(fn, stmts, used)
        loop = shape.loop
        if shape.made_absolute:
            self.warn(f"line {self._line(loop)}: the loop index `{shape.idx}` now counts layers globally (start=self.start_layer)")
        if self.spec is not None:
            self._check_spec(loop, shape.layers_attr, shape.residual)
        capture_sum = shape.residual is not None and (self.spec is None or self.spec.capture == "hidden + residual")
        id0, new_loop = _capturing_loop(shape, capture_sum)
        collect = [
            cst.parse_statement("# pipespec: aux states from upstream stages (last stage only; elsewhere [])\n"
                                f"{REMOTE} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n"),
            cst.parse_statement(f"{AUX} = []  # pipespec: this stage's own aux states, in id order\n"),
        ]
        doc = 1 if stmts and is_docstring(stmts[0]) else 0
        new_stmts = [*stmts[:doc], *collect, *stmts[doc:loop_at], id0.with_changes(leading_lines=loop.leading_lines),
                     new_loop, *stmts[loop_at + 1:]]
        rewritten = fn.with_changes(body=fn.body.with_changes(body=new_stmts)).visit(
            _RewriteForward(nonlast, last, cst.parse_expression(f"{REMOTE} + {AUX}"), "intermediate_tensors"))
        checks = m.findall(fn, m.Attribute(value=_GET_PP_GROUP, attr=m.Name("is_first_rank") | m.Name("is_last_rank")))
        if checks:
            lines = ", ".join(str(self._line(c)) for c in checks)
            self.warn(f"line {lines}: forward's get_pp_group() rank checks now read the stage plan "
                      "(self.is_first_stage / self.is_last_stage)")
        return cst.ensure_type(rewritten, cst.FunctionDef), shape.residual is not None

    def _read_forward(
        self, fn: cst.FunctionDef, stmts: Sequence[cst.BaseStatement], used: set[str]
    ) -> tuple[int, LoopShape, set[int], set[int]]:
        """The layer loop (its index in ``stmts`` and shape) and the ids of the non-last and last returns;
        declines a forward whose non-last return hands on another stream than the loop captures."""
        try:
            loop_at = find_layer_loop(fn)
            loop = cst.ensure_type(stmts[loop_at], cst.For)
            shape = loop_shape(loop, used)
            loop_end = self.get_metadata(PositionProvider, loop).end.line
            nonlast, last = classify_returns(fn, loop_end, self._line)
        except ShapeError as exc:
            raise self._skip(exc.node, exc.reason) from None
        returns = [r for r in m.findall(fn, m.Return()) if id(r) in nonlast]
        try:  # what the next stage receives must be what is captured, on every branch (inkling, hy_v4 iHC)
            sent_hidden, sent_residual = sent_stream(stmts, returns)  # type: ignore[arg-type]
        except Decline as exc:
            raise self._skip(exc.node, exc.reason) from None
        if (shape.hidden, shape.residual) != (sent_hidden, sent_residual):
            got = f"{shape.hidden}, {shape.residual}" if shape.residual else shape.hidden
            sends = f"{sent_hidden}" + (f" and {sent_residual} as residual" if sent_residual else " and no residual")
            raise self._skip(loop, f"the layer call assigns `{got}` but the next stage receives {sends}: the value "
                                   "captured at a layer boundary would not be the stream handed on")
        return loop_at, shape, nonlast, last

    def _check_spec(self, loop: cst.For, layer_attr: str | None, residual: str | None) -> None:
        spec = self.spec
        assert spec is not None
        if layer_attr is not None and layer_attr != spec.layers_attr:
            raise self._skip(loop, f"the loop runs self.{layer_attr} but spec {spec.name} ({spec.source}) says "
                                   f"model.layers_attr = {spec.layers_attr!r}: fix the spec")
        if (residual is not None) != spec.residual:
            has = f"carries a residual (`{residual}`)" if residual else "carries no residual"
            raise self._skip(loop, f"the loop {has} but spec {spec.name} ({spec.source}) says model.residual = "
                                   f"{str(spec.residual).lower()}: fix the spec")
