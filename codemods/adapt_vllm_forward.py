"""Adapt a vLLM-style decoder stack so it captures, relays and collects aux hidden states over PP.

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

* the class inherits ``pipespec.mixin.AuxHiddenStatesMixin`` and carries the own-dict marker
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
parses source: it never imports or executes the code it transforms.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, SkipFile, VisitorBasedCodemodCommand
from libcst.helpers import get_full_name_for_node, parse_template_expression, parse_template_statement
from libcst.metadata import PositionProvider

from pipespec.spec import AdapterSpec

GENERATOR = "adapt_vllm_forward"
GENERATOR_VERSION = 1
ALREADY_ADAPTED = "already adapted"
MARKER = "supports_aux_hidden_states_over_pp"
MARKER_ATTR = "pipespec_generated_by"  # same attribute the HF codemod writes: generator, version, source, spec
MIXIN_MODULE, MIXIN = "pipespec.mixin", "AuxHiddenStatesMixin"
AUX, REMOTE = "aux_hidden_states", "remote_aux_hidden_states"
# Attributes the mixin owns as read-only properties: source that assigns them cannot keep doing so.
MIXIN_PROPERTIES = ("start_layer", "end_layer", "is_first_stage", "is_last_stage", "aux_hidden_state_layers",
                    "pipespec_layout", "pipespec_stage", "aux_hidden_state_relay_keys")
RANK_CHECKS = {"is_first_rank": "is_first_stage", "is_last_rank": "is_last_stage"}


def _self_attr(name: str | None = None) -> m.Attribute:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name) if name else m.Name())


_START, _END = _self_attr("start_layer"), _self_attr("end_layer")
_ISLICE = m.Call(func=m.Name("islice") | m.Attribute(attr=m.Name("islice")),
                 args=[m.Arg(_self_attr()), m.Arg(_START), m.Arg(_END)])
_SLICE = m.Subscript(value=_self_attr(), slice=[m.SubscriptElement(m.Slice(lower=_START, upper=_END, step=None))])
_STAGE_LAYERS = _ISLICE | _SLICE
_ENUMERATE = m.Call(func=m.Name("enumerate"), args=[m.Arg(_STAGE_LAYERS, keyword=None), m.ZeroOrMore()])
_RANGE = m.Call(func=m.Name("range"), args=[m.Arg(_START), m.Arg(_END)])
_GET_PP_GROUP = m.Call(func=m.Name("get_pp_group"), args=[])
_MARKER_LINE = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(MARKER))])])


def marker_text(source: str, spec: AdapterSpec | None) -> str:
    """The ``pipespec_generated_by`` value: generator and version, source class, spec."""
    return f"{GENERATOR} v{GENERATOR_VERSION}; source {source}; spec {spec.name if spec else 'detected from source'}"


def class_is_marked(node: cst.ClassDef) -> bool:
    """True when the class body assigns the support marker (what adapted code carries)."""
    return isinstance(node.body, cst.IndentedBlock) and any(m.matches(s, _MARKER_LINE) for s in node.body.body)


class _Names(cst.CSTVisitor):
    """Every ``Name`` used in a subtree."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)


def _names(node: cst.CSTNode) -> set[str]:
    visitor = _Names()
    node.visit(visitor)
    return visitor.names


def _leaves(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The names/attributes an assignment target binds (tuple and list targets unpacked)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return [leaf for e in target.elements for leaf in _leaves(e.value)]
    return [target]


def _fresh(base: str, used: set[str]) -> str:
    name, n = base, 1
    while name in used:
        name, n = f"{base}_{n}", n + 1
    return name


class _Find(cst.CSTVisitor):
    """Collect nodes of forward's own scope (nested functions and classes are not its code)."""

    def __init__(self) -> None:
        self.depth = 0
        self.returns: list[cst.Return] = []
        self.jumps: list[cst.CSTNode] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.depth += 1
        return self.depth == 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.depth -= 1

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Return(self, node: cst.Return) -> None:
        self.returns.append(node)

    def visit_Break(self, node: cst.Break) -> None:
        self.jumps.append(node)

    def visit_Continue(self, node: cst.Continue) -> None:
        self.jumps.append(node)

    def visit_Yield(self, node: cst.Yield) -> None:
        self.jumps.append(node)


class _RewriteForward(cst.CSTTransformer):
    """Rewrite returns and pp-group rank checks inside forward (not inside nested defs)."""

    def __init__(self, nonlast: set[int], last: set[int], aux_value: cst.BaseExpression,
                 tensors_param: str) -> None:
        self.nonlast, self.last, self.aux_value, self.tensors_param = nonlast, last, aux_value, tensors_param
        self.depth = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.depth += 1
        return self.depth == 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self.depth -= 1
        return updated_node

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

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
        return _add_mixin_import(_drop_unused_import(updated_node, "get_pp_group"))

    # ------------------------------------------------------------------ class
    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False  # the class is rewritten as a whole in leave_ClassDef, from the original node

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if original_node.name.value != self.class_name:
            return updated_node
        self.found = True
        cls = original_node
        if class_is_marked(cls):
            raise SkipFile(f"{ALREADY_ADAPTED}: {self.class_name} carries {MARKER} = True")
        if self.spec is not None and self.spec.dialect != "vllm":
            raise self._skip(cls, f"spec {self.spec.name} ({self.spec.source}) is for the {self.spec.dialect} dialect, "
                                  "not vLLM-style model code")
        if self.spec is not None and not self.spec.supported:
            raise self._skip(cls, f"spec {self.spec.name} ({self.spec.source}) marks it unsupported: {self.spec.reason}")
        if any(m.matches(a.value, m.Name(MIXIN) | m.Attribute(attr=m.Name(MIXIN))) for a in cls.bases):
            raise self._skip(cls, f"inherits {MIXIN} but has no `{MARKER} = True`: hand-adapted? "
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
        markers = [f"{MARKER} = True  # pipespec: this class's own forward handles aux hidden states\n",
                   f"pipespec_has_residual = {residual}\n",
                   f"{MARKER_ATTR} = {json.dumps(marker_text(self.source, self.spec))}\n"]
        if self.spec is not None and self.spec.num_layers_key != "num_hidden_layers":
            markers.append(f"pipespec_num_layers_key = {self.spec.num_layers_key!r}\n")
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else 0
        if at < len(body) and not body[at].leading_lines:
            body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        lines = [cst.parse_statement(text) for text in markers]
        if at:  # a blank line between the class docstring and the markers
            lines[0] = lines[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body[at:at] = lines
        bases = [cst.Arg(cst.Name(MIXIN), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *cls.bases]
        if not cls.bases:
            bases = [cst.Arg(cst.Name(MIXIN))]
        return cls.with_changes(
            bases=bases, lpar=cst.LeftParen(), rpar=cst.RightParen(), body=cls.body.with_changes(body=body)
        )

    # ------------------------------------------------------------------ other methods
    def _refuse_mixin_writes(self, node: cst.CSTNode, allowed: Sequence[cst.CSTNode] = (), class_level: bool = False) -> None:
        """Decline code that assigns what the mixin owns: it would raise (no setter) or shadow the plan."""
        for target in m.findall(node, m.AssignTarget() | m.AugAssign() | m.AnnAssign()):
            if any(target is a for a in allowed):
                continue
            for leaf in _leaves(target.target):  # type: ignore[attr-defined]
                if m.matches(leaf, _self_attr()):
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
        layer_range = m.Tuple(elements=[m.ZeroOrMore(), m.Element(_START), m.Element(_END), m.ZeroOrMore()])
        line = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(layer_range)])])
        hits = m.findall(fn, line)
        allowed = [t for h in hits for t in h.body[0].targets]  # type: ignore[attr-defined]
        self._refuse_mixin_writes(fn, allowed)
        if not hits:
            return fn
        used = _names(fn)
        start, end = _fresh("built_start_layer", used), _fresh("built_end_layer", used)
        hit_ids = {id(h) for h in hits}

        class _Rename(cst.CSTTransformer):
            def leave_Element(self, original: cst.Element, updated: cst.Element) -> cst.Element:
                if m.matches(original.value, _START):
                    return updated.with_changes(value=cst.Name(start))
                if m.matches(original.value, _END):
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
        used = _names(fn)
        for hand in (AUX, REMOTE, "collect_remote_aux_hidden_states", "aux_hidden_state_layers"):
            if hand in used:
                raise self._skip(fn, f"forward already uses `{hand}`: aux states are handled by hand; review it and add "
                                     f"`{MARKER} = True` to the class, or remove that code and regenerate")
        stmts = list(cst.ensure_type(fn.body, cst.IndentedBlock).body)
        loop_at = self._find_loop(fn, stmts)
        loop = cst.ensure_type(stmts[loop_at], cst.For)
        layer_attr, idx, new_iter, new_target, hidden, residual = self._loop_shape(loop, used)
        if self.spec is not None:
            self._check_spec(loop, layer_attr, residual)
        capture_sum = residual is not None and (self.spec is None or self.spec.capture == "hidden + residual")
        after = f"{hidden} + {residual}" if capture_sum else hidden
        first = f"{hidden} if {residual} is None else {hidden} + {residual}" if capture_sum else hidden
        nonlast, last = self._classify_returns(fn, loop)

        capture = parse_template_statement(
            "if {idx} in self.aux_capture_after_layers:\n    self.capture_aux_hidden_state(" + AUX + ", {value})\n",
            idx=cst.Name(idx), value=cst.parse_expression(after))
        capture = capture.with_changes(body=capture.body.with_changes(header=cst.TrailingWhitespace(
            whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(f"# pipespec: aux id {idx} + 1"))))
        loop_body = cst.ensure_type(loop.body, cst.IndentedBlock)
        new_loop = loop.with_changes(iter=new_iter or loop.iter, target=new_target or loop.target,
                                     body=loop_body.with_changes(body=[*loop_body.body, capture]), leading_lines=())
        id0 = parse_template_statement(
            "if self.aux_capture_input:  # pipespec: aux id 0 (what enters layer 0), first stage\n    "
            "self.capture_aux_hidden_state(" + AUX + ", {value})\n", value=cst.parse_expression(first))
        collect = [
            cst.parse_statement("# pipespec: aux states from upstream stages (last stage only; elsewhere [])\n"
                                f"{REMOTE} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n"),
            cst.parse_statement(f"{AUX} = []  # pipespec: this stage's own aux states, in id order\n"),
        ]
        doc = 1 if stmts and m.matches(stmts[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else 0
        new_stmts = [*stmts[:doc], *collect, *stmts[doc:loop_at], id0.with_changes(leading_lines=loop.leading_lines),
                     new_loop, *stmts[loop_at + 1:]]
        rewritten = fn.with_changes(body=fn.body.with_changes(body=new_stmts)).visit(
            _RewriteForward(nonlast, last, cst.parse_expression(f"{REMOTE} + {AUX}"), "intermediate_tensors"))
        checks = m.findall(fn, m.Attribute(value=_GET_PP_GROUP, attr=m.Name("is_first_rank") | m.Name("is_last_rank")))
        if checks:
            lines = ", ".join(str(self._line(c)) for c in checks)
            self.warn(f"line {lines}: forward's get_pp_group() rank checks now read the stage plan "
                      "(self.is_first_stage / self.is_last_stage)")
        return cst.ensure_type(rewritten, cst.FunctionDef), residual is not None

    def _classify_returns(self, fn: cst.FunctionDef, loop: cst.For) -> tuple[set[int], set[int]]:
        """ids of the non-last returns (``IntermediateTensors({...})``) and of the last-rank returns."""
        finder = _Find()
        fn.visit(finder)
        if finder.jumps:
            raise self._skip(finder.jumps[0], "forward breaks, continues or yields: only a straight layer loop is understood")
        loop_end = self.get_metadata(PositionProvider, loop).end.line
        nonlast, last = set(), set()
        for ret in finder.returns:
            if self._line(ret) <= loop_end:
                raise self._skip(ret, "forward returns before its layer loop ends: only a straight layer loop is understood")
            if m.matches(ret.value, m.Call(func=m.Name("IntermediateTensors"))):
                call = cst.ensure_type(ret.value, cst.Call)
                if len(call.args) != 1 or call.args[0].keyword is not None or not isinstance(call.args[0].value, cst.Dict):
                    raise self._skip(ret, "the non-last-rank return is not `IntermediateTensors({...})` with a dict literal")
                nonlast.add(id(ret))
            elif ret.value is None:
                raise self._skip(ret, "forward has a bare `return`: the last rank must return the hidden states")
            else:
                last.add(id(ret))
        if not nonlast:
            raise self._skip(fn, "forward never returns `IntermediateTensors({...})` for non-last ranks: it does not "
                                 "support pipeline parallelism yet")
        if not last:
            raise self._skip(fn, "forward has no last-rank return of the hidden states")
        return nonlast, last

    def _find_loop(self, fn: cst.FunctionDef, stmts: list[cst.BaseStatement]) -> int:
        top = [i for i, s in enumerate(stmts) if isinstance(s, cst.For) and self._is_stage_loop(s)]
        if len(top) == 1:
            return top[0]
        if len(top) > 1:
            raise self._skip(stmts[top[1]], "forward has more than one layer loop")
        for loop in m.findall(fn, m.For()):
            assert isinstance(loop, cst.For)
            if self._is_stage_loop(loop):
                raise self._skip(loop, "the layer loop is nested inside another statement: only a top-level loop is understood")
            if m.findall(loop.iter, _self_attr()):
                raise self._skip(loop, f"loop `for ... in {cst.Module([]).code_for_node(loop.iter)}` is not over this "
                                       "stage's layers (islice(self.layers, self.start_layer, self.end_layer), a "
                                       "slice of it, enumerate of either, or range(self.start_layer, self.end_layer))")
        raise self._skip(fn, "forward has no layer loop over islice(self.<layers>, self.start_layer, self.end_layer)")

    @staticmethod
    def _is_stage_loop(loop: cst.For) -> bool:
        return m.matches(loop.iter, _STAGE_LAYERS | _ENUMERATE | _RANGE)

    def _loop_shape(self, loop: cst.For, used: set[str]) -> tuple[
        str | None, str, cst.BaseExpression | None, cst.BaseAssignTargetExpression | None, str, str | None
    ]:
        """(layers attr, absolute index name, new iter, new target (None: keep), hidden name, residual name)."""
        if loop.orelse is not None:
            raise self._skip(loop, "the layer loop has an else branch")
        body = cst.ensure_type(loop.body, cst.IndentedBlock)
        it, target = loop.iter, loop.target
        new_iter: cst.BaseExpression | None = None
        new_target: cst.BaseAssignTargetExpression | None = None
        layer_attr: str | None = None
        if m.matches(it, _RANGE):
            if not isinstance(target, cst.Name):
                raise self._skip(loop, "the range loop's target is not a single name")
            idx = target.value
            call = m.Call(func=m.Subscript(value=_self_attr(), slice=[m.SubscriptElement(m.Index(m.Name(idx)))]))
        else:
            enumerated = m.matches(it, _ENUMERATE)
            args = cst.ensure_type(it, cst.Call).args if enumerated else ()
            stage_layers = args[0].value if enumerated else it
            layer_attr = cst.ensure_type(m.findall(stage_layers, _self_attr())[0], cst.Attribute).attr.value
            absolute = parse_template_expression("enumerate({layers}, start=self.start_layer)", layers=stage_layers)
            if not enumerated:
                if not isinstance(target, cst.Name):
                    raise self._skip(loop, "the layer loop's target is not a single name")
                layer, idx = target.value, _fresh("idx", used)
                new_iter = absolute
                new_target = cst.Tuple([cst.Element(cst.Name(idx)), cst.Element(cst.Name(layer))], lpar=[], rpar=[])
            else:
                if not m.matches(target, m.Tuple([m.Element(m.Name()), m.Element(m.Name())])):
                    raise self._skip(loop, "the enumerate loop's target is not `index, layer`")
                idx, layer = (cst.ensure_type(e.value, cst.Name).value for e in cst.ensure_type(target, cst.Tuple).elements)
                if not (len(args) == 2 and m.matches(args[1], m.Arg(_START, keyword=m.Name("start") | None))):
                    if idx in _names(body):
                        raise self._skip(loop, f"the loop index `{idx}` counts from 0 on every stage (enumerate without "
                                               "start=self.start_layer) and the body uses it: a stage > 0 reads the wrong "
                                               "layer's entry; fix the source with start=self.start_layer, then regenerate")
                    new_iter = absolute
                    self.warn(f"line {self._line(loop)}: the loop index `{idx}` now counts layers globally "
                              "(start=self.start_layer)")
            call = m.Call(func=m.Name(layer))
        assigns = [s for s in body.body if m.matches(s, m.SimpleStatementLine(body=[m.Assign(value=call)]))]
        if len(assigns) != 1:
            raise self._skip(loop, "the loop body must call the layer exactly once as `hidden_states[, residual] = layer(...)`")
        targets = cst.ensure_type(cst.ensure_type(assigns[0], cst.SimpleStatementLine).body[0], cst.Assign).targets
        names = targets[0].target
        if len(targets) == 1 and isinstance(names, cst.Name):
            return layer_attr, idx, new_iter, new_target, names.value, None
        if len(targets) == 1 and m.matches(names, m.Tuple([m.Element(m.Name()), m.Element(m.Name())])):
            hidden, residual = (cst.ensure_type(e.value, cst.Name).value for e in cst.ensure_type(names, cst.Tuple).elements)
            return layer_attr, idx, new_iter, new_target, hidden, residual
        shown = cst.Module([]).code_for_node(names)
        raise self._skip(assigns[0], f"the layer call assigns `{shown}`: only `hidden_states` or `hidden_states, residual` "
                                     "is understood (a layer that carries recurrent state across layers is declined)")

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


def _drop_unused_import(module: cst.Module, name: str) -> cst.Module:
    """Remove ``name`` from top-level ``from X import ...`` lines when nothing else uses it any more
    (forward's rank checks were its only use); a line left empty goes, its blank lines kept."""
    imported = m.ImportAlias(name=m.Name(name), asname=None)
    imports = [s for s in module.body if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom()]))
               and m.findall(s, imported)]
    uses = len(m.findall(module, m.Name(name))) - sum(len(m.findall(s, imported)) for s in imports)
    if not imports or uses:
        return module
    body: list[cst.BaseStatement] = []
    carry: Sequence[cst.EmptyLine] = ()
    for stmt in module.body:
        if any(stmt is s for s in imports):
            node = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.ImportFrom)
            aliases = list(cst.ensure_type(node.names, Sequence))
            names = [a for a in aliases if not m.matches(a, imported)]
            if not names:
                carry = stmt.leading_lines
                continue
            if m.matches(aliases[-1], imported):  # the new last name takes over the removed one's comma
                names[-1] = names[-1].with_changes(comma=aliases[-1].comma)
            stmt = stmt.with_changes(body=[node.with_changes(names=names)])
        if carry:
            lines = [*carry, *stmt.leading_lines]
            lines = [x for i, x in enumerate(lines) if x.comment or i == 0 or lines[i - 1].comment]
            stmt = stmt.with_changes(leading_lines=lines)
            carry = ()
        body.append(stmt)
    return module.with_changes(body=body)


def _add_mixin_import(module: cst.Module) -> cst.Module:
    """Add ``from pipespec.mixin import AuxHiddenStatesMixin`` unless the name is imported already.

    Placed where isort puts a first-party import: next to other ``pipespec`` imports, else as its own
    block after the last top-level import (before relative imports).
    """
    body = list(module.body)
    header = []
    for i, stmt in enumerate(body):
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()])):
            header.append(i)
        elif not (i == 0 and m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))):
            break
    for i in header:
        node = cst.ensure_type(body[i], cst.SimpleStatementLine).body[0]
        if isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
            if any(a.evaluated_name == MIXIN and a.evaluated_alias in (None, MIXIN) for a in node.names):
                return module
    new = cst.parse_statement(f"from {MIXIN_MODULE} import {MIXIN}\n")

    def module_of(i: int) -> tuple[str, bool]:
        node = cst.ensure_type(body[i], cst.SimpleStatementLine).body[0]
        if isinstance(node, cst.ImportFrom):
            return (get_full_name_for_node(node.module) or "" if node.module else ""), bool(node.relative)
        return get_full_name_for_node(cst.ensure_type(node, cst.Import).names[0].name) or "", False

    ours = [i for i in header if module_of(i)[0].split(".")[0] == "pipespec" and not module_of(i)[1]]
    relative = [i for i in header if module_of(i)[1]]
    if ours:
        after = [i for i in ours if module_of(i)[0] > MIXIN_MODULE]
        at = after[0] if after else ours[-1] + 1
        if after:
            new = new.with_changes(leading_lines=body[at].leading_lines)
            body[at] = body[at].with_changes(leading_lines=())
    elif relative:
        at = relative[0]
        new = new.with_changes(leading_lines=body[at].leading_lines or [cst.EmptyLine()])
        body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine()])
    elif header:
        at = header[-1] + 1
        new = new.with_changes(leading_lines=[cst.EmptyLine()])
    else:
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else 0
        new = new.with_changes(leading_lines=[cst.EmptyLine()] if at else [])
    body.insert(at, new)
    return module.with_changes(body=body)
