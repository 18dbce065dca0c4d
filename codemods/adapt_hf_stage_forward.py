"""``AdaptHFStageForwardCommand``: make an HF transformers decoder ``forward`` a pipeline-stage forward.

Input: a transformers 5.x modeling module and the decoder class to adapt (``LlamaModel``, ``GPT2Model``
...). Output: the same module where that class

* inherits ``AuxHiddenStatesMixin`` and carries ``supports_aux_hidden_states_over_pp = True`` plus a
  ``pipespec_generated_by`` marker naming generator, version, source and spec;
* has a ``forward`` that takes ``intermediate_tensors``. A non-first stage feeds
  ``intermediate_tensors["hidden_states"]`` in as ``inputs_embeds`` (so masks, positions and rotary
  embeddings derive from it exactly as from user embeddings) and skips what the first stage does to
  the embeddings (scaling, position embeddings, dropout); the loop runs ``range(self.start_layer,
  self.end_layer)`` with global indices; id 0 is captured before the loop and id L after layer L-1; a
  non-last stage returns ``self.make_stage_output(...)`` before the final norm; the last stage collects
  the remote states, applies the norm and returns ``(output, aux)`` when aux ids are configured.

Decorators: ``@capture_outputs`` (and its ancestor ``@check_model_inputs``), ``@can_return_tuple`` and
``@auto_docstring`` are dropped from the stage forward. The first two post-process the return value as a
``ModelOutput`` (install recording hooks, call ``.to_tuple()``), which a stage that returns
``IntermediateTensors`` or ``(output, aux)`` is not; the aux list replaces ``output_hidden_states``.
``auto_docstring`` would document a signature that now has a pipespec argument. Everything else
(``@deprecate_kwarg``, ``@merge_with_config_defaults``) is kept, so the cache keyword stays whatever the
source uses (``cache`` in 5.24, ``past_key_values`` before).

Shapes it cannot adapt raise ``SkipFile`` with the reason (see ``hf_forward_shape``). Idempotent: a class
that carries the marker is left as it is.

Imports libcst, ``pipespec.contract.spec`` and the HF analysis (``hf_*``); must not import torch,
transformers or vllm: it parses the modeling source and never imports or executes it.
"""

from __future__ import annotations

import argparse
import json

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, SkipFile, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider

from pipespec.codemods.hf_decline import AlreadyStageAware, ShapeError
from pipespec.codemods.hf_forward_shape import ForwardShape, analyze_forward, find_forward, rotary_attrs
from pipespec.codemods.hf_layer_loop import LoopShape, loop_control
from pipespec.codemods.hf_names import assigned_names, names_in
from pipespec.codemods.scope import FunctionBodyTransformer
from pipespec.contract.names import (
    AUX_MIXIN,
    AUX_MIXIN_MODULE,
    AUX_OVER_PP_FLAG,
    GENERATED_BY_ATTR,
    HAS_RESIDUAL_ATTR,
    NUM_LAYERS_KEY_ATTR,
)
from pipespec.contract.spec import AdapterSpec, load_spec

GENERATOR = "adapt_hf_stage_forward"
GENERATOR_VERSION = 1
AUX_VAR = "pipespec_aux_hidden_states"
OUTPUT_VAR = "pipespec_output"
#: Decorators that treat the return value as a ModelOutput or document the old signature.
DROPPED_DECORATORS = ("capture_outputs", "check_model_inputs", "can_return_tuple", "auto_docstring")


def marker_text(source: str, spec: AdapterSpec) -> str:
    """The marker value written into the class: generator, version, source class and spec."""
    return f"{GENERATOR} v{GENERATOR_VERSION}; source {source}; spec {spec.name}"


def _stmt(text: str) -> cst.BaseStatement:
    return cst.parse_statement(text)


def _comment(text: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment(f"# {text}"))


def _as_block(body: cst.BaseSuite) -> cst.IndentedBlock:
    if isinstance(body, cst.IndentedBlock):
        return body
    assert isinstance(body, cst.SimpleStatementSuite)
    return cst.IndentedBlock(body=[cst.SimpleStatementLine(body=body.body)])


def _guard_first_stage(stmt: cst.BaseStatement, else_alias: str | None) -> cst.If:
    """``if self.is_first_stage: <stmt>`` (``else: <stream> = inputs_embeds`` when it binds the stream first)."""
    leading = stmt.leading_lines
    inner = stmt.with_changes(leading_lines=())
    orelse = None
    if else_alias is not None:
        orelse = cst.Else(body=cst.IndentedBlock(body=[_stmt(f"{else_alias} = inputs_embeds\n")]))
    return cst.If(
        test=cst.parse_expression("self.is_first_stage"),
        body=cst.IndentedBlock(body=[inner]),
        orelse=orelse,
        leading_lines=leading,
    )


class _ReturnRewriter(FunctionBodyTransformer):
    """``return X`` → bind X, return ``(X, aux)`` when aux ids are configured, else X.

    Run on statements of forward's body, so every ``def`` it meets is nested and left alone.
    """

    def __init__(self) -> None:
        super().__init__(inside_function=True)

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if len(updated_node.body) != 1 or not isinstance(updated_node.body[0], cst.Return):
            return updated_node
        ret = updated_node.body[0]
        assert isinstance(ret, cst.Return)
        value = ret.value if ret.value is not None else cst.Name("None")
        bind = cst.SimpleStatementLine(
            body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(OUTPUT_VAR))], value=value)],
            leading_lines=updated_node.leading_lines,
        )
        pair = _stmt(f"if self.aux_hidden_state_layers:\n    return {OUTPUT_VAR}, {AUX_VAR}\n")
        plain = _stmt(f"return {OUTPUT_VAR}\n")
        return cst.FlattenSentinel([bind, pair, plain])


class _CaptureBeforeContinue(cst.CSTTransformer):
    """Before each ``continue`` of the layer loop (LayerDrop), capture as the end of the body would.

    A skipped layer leaves the stream unchanged, so its output id is the stream as it stands. Which
    ``continue`` is the loop's own (not an inner loop's) is the analysis's ``loop_control``.
    """

    def __init__(self, capture: cst.BaseStatement, loop: cst.For) -> None:
        super().__init__()
        self.capture = capture
        self.continues = {id(n) for n in loop_control(loop.body) if isinstance(n, cst.Continue)}

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if any(id(s) in self.continues for s in original_node.body):
            capture = self.capture.with_changes(leading_lines=updated_node.leading_lines)
            return cst.FlattenSentinel([capture, updated_node.with_changes(leading_lines=())])
        return updated_node


def _stage_loop(loop: LoopShape, used: set[str]) -> list[cst.BaseStatement]:
    """The layer loop over this stage's layers with global ids, the captures around it and the non-last
    stage's early return; ``used`` are the names forward already uses."""
    stream = loop.stream
    index_var = loop.index_var
    if index_var is None:
        index_var = "layer_idx" if "layer_idx" not in used else "pipespec_layer_idx"
    capture = _stmt(f"if {index_var} in self.aux_capture_after_layers:\n    {AUX_VAR}.append({stream})\n")
    rewriter = _CaptureBeforeContinue(capture, loop.node)
    body = [stmt.visit(rewriter) for stmt in _as_block(loop.node.body).body]
    body = [x for item in body for x in (item.nodes if isinstance(item, cst.FlattenSentinel) else [item])]
    if loop.form != "range" and loop.layer_var is not None:
        body.insert(0, _stmt(f"{loop.layer_var} = self.{loop.layers_attr}[{index_var}]\n"))
    body.append(
        capture.with_changes(leading_lines=[_comment(f"pipespec: aux id {index_var} + 1 is the output of this layer")])
    )
    new_loop = loop.node.with_changes(
        target=cst.Name(index_var),
        iter=cst.parse_expression("range(self.start_layer, self.end_layer)"),
        body=_as_block(loop.node.body).with_changes(body=body),
        leading_lines=(),
    )
    before_loop = [
        _stmt(f"{AUX_VAR} = self.collect_remote_aux_hidden_states(intermediate_tensors)\n").with_changes(
            leading_lines=[
                *loop.node.leading_lines,
                _comment("pipespec: aux states from upstream stages (last stage only), then this stage's, in id order"),
            ]
        ),
        _stmt(f"if self.aux_capture_input:\n    {AUX_VAR}.append({stream})\n"),
    ]
    after_loop = _stmt(
        f"if not self.is_last_stage:\n    return self.make_stage_output({stream}, {AUX_VAR}, intermediate_tensors)\n"
    ).with_changes(
        leading_lines=[
            cst.EmptyLine(indent=False),
            _comment("pipespec: a non-last stage hands hidden + relayed + own aux states on, before the final norm"),
        ]
    )
    return [*before_loop, new_loop, after_loop]


def _stage_input() -> cst.BaseStatement:
    """The first statement of a stage forward: a later stage takes the received hidden states as its
    ``inputs_embeds``."""
    return _stmt(
        "if not self.is_first_stage:\n"
        "    if intermediate_tensors is None:\n"
        "        raise ValueError(\n"
        '            f"{type(self).__name__} is pipeline stage {self.pipespec_stage.rank}: "\n'
        '            "pass the previous stage\'s intermediate_tensors"\n'
        "        )\n"
        '    inputs_embeds = intermediate_tensors["hidden_states"]\n'
        "    input_ids = None\n"
    ).with_changes(
        leading_lines=[
            _comment("pipespec: a later stage starts from the hidden states it received; they stand in for"),
            _comment("inputs_embeds, so masks, positions and rotary embeddings derive from them"),
        ]
    )


class AdaptHFStageForwardCommand(VisitorBasedCodemodCommand):
    """Rewrite ``class_name.forward`` of an HF modeling module into a pipeline-stage forward."""

    DESCRIPTION = "Make an HF transformers decoder forward a pipeline stage that relays EAGLE3 aux hidden states."
    METADATA_DEPENDENCIES = (PositionProvider,)

    @staticmethod
    def add_args(arg_parser: argparse.ArgumentParser) -> None:
        """For ``python -m libcst.tool codemod``: the class to adapt and its spec file."""
        arg_parser.add_argument("--class-name", dest="class_name", required=True, help="decoder class to adapt")
        arg_parser.add_argument("--spec", dest="spec", required=True, help="adapter spec (adapters/<name>.toml)")

    def __init__(
        self,
        context: CodemodContext,
        class_name: str,
        spec: AdapterSpec | str,
        source: str | None = None,
        add_imports: bool = True,
    ) -> None:
        """``source`` names the origin in the marker (default ``<module>:<class_name>``); ``add_imports=False``
        skips the module import edits (``pipespec.adapt`` compiles the forward alone and supplies the names)."""
        super().__init__(context)
        self.add_imports = add_imports
        if isinstance(spec, str):
            spec = load_spec(spec)
        self.class_name = class_name
        self.spec = spec
        module = context.full_module_name or spec.decoder_module
        self.source = source or f"{module}:{class_name}"
        self.found = False
        #: The analysed shape of the last forward adapted (for callers such as ``pipespec.adapt``).
        self.shape: ForwardShape | None = None
        self.already_adapted = False

    # ------------------------------------------------------------------------------ helpers
    def _line(self, node: cst.CSTNode) -> int | None:
        try:
            return self.get_metadata(PositionProvider, node).start.line
        except KeyError:
            return None

    def _skip(self, reason: str) -> SkipFile:
        return SkipFile(f"{self.class_name}: {reason}")

    # ------------------------------------------------------------------------------ visitor
    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        # Nothing inside a class is rewritten node by node: the target class is rebuilt whole in
        # leave_ClassDef from the original nodes, so descending would only cost time.
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if original_node.name.value != self.class_name:
            return updated_node
        self.found = True
        spec = self.spec
        if spec.dialect != "hf":
            raise self._skip(f"spec {spec.name} ({spec.source}) is for the {spec.dialect} dialect, not HF transformers")
        if not spec.supported:
            raise self._skip(f"spec {spec.name} marks it unsupported: {spec.reason}")
        existing = self._existing_marker(original_node)
        if existing is not None:
            self.already_adapted = True
            if existing != marker_text(self.source, spec):
                self.warn(
                    f"line {self._line(original_node)}: {self.class_name} was adapted as {existing!r}; this run would "
                    f"write {marker_text(self.source, spec)!r}: regenerate from the original source to update it"
                )
            return updated_node
        func = find_forward(original_node)
        if func is None:
            raise self._skip("the class does not define forward (adapt the class that does)")
        try:
            shape = analyze_forward(
                func,
                layers_attr=spec.layers_attr,
                embed_attr=spec.embed_attr,
                norm_attr=spec.norm_attr,
                shape_only_attrs=rotary_attrs(original_node),
                line_of=self._line,
            )
        except AlreadyStageAware:
            raise self._skip(
                "forward already takes intermediate_tensors but carries no pipespec marker: it is a hand-written "
                "pipeline forward; register it with @pipespec.adapter once it collects and packs aux states"
            ) from None
        except ShapeError as exc:
            raise self._skip(str(exc)) from None
        if shape.residual or spec.residual:
            raise self._skip(
                "the layers hand a separate residual to each other; the HF codemod handles a single hidden-states "
                "stream (use the vLLM dialect codemod)"
            )
        self.shape = shape
        if shape.norm_attr is None:
            self.warn(
                f"line {self._line(shape.loop.node)}: no final norm self.{spec.norm_attr}(...) after the layer loop; "
                "the last stage returns what the source returns"
            )
        if shape.loop.num_layers_key and shape.loop.num_layers_key != spec.num_layers_key:
            self.warn(
                f"line {self._line(shape.loop.node)}: the loop bounds the stack by config.{shape.loop.num_layers_key} "
                f"but spec {spec.name} says num_layers_key = {spec.num_layers_key!r}; using {shape.loop.num_layers_key!r}"
            )
        new_func = self._stage_forward(shape)
        if self.add_imports:
            AddImportsVisitor.add_needed_import(self.context, "pipespec.contract.intermediate", "IntermediateTensors")
            AddImportsVisitor.add_needed_import(self.context, AUX_MIXIN_MODULE, AUX_MIXIN)
        return self._adapted_class(original_node, func, new_func, shape)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if not self.found:
            raise SkipFile(f"no class {self.class_name} in this module")
        return updated_node

    # ------------------------------------------------------------------------------ class level
    def _existing_marker(self, cls: cst.ClassDef) -> str | None:
        for stmt in cls.body.body:
            if m.matches(
                stmt,
                m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(GENERATED_BY_ATTR))], value=m.SimpleString())]),
            ):
                value = stmt.body[0].value  # type: ignore[attr-defined]
                return value.evaluated_value  # type: ignore[no-any-return]
        return None

    def _adapted_class(
        self, cls: cst.ClassDef, func: cst.FunctionDef, new_func: cst.FunctionDef, shape: ForwardShape
    ) -> cst.ClassDef:
        num_key = shape.loop.num_layers_key or self.spec.num_layers_key
        body = list(cls.body.body)
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])) else 0
        header = [
            _stmt(f"{AUX_OVER_PP_FLAG} = True\n").with_changes(
                leading_lines=[
                    *([cst.EmptyLine(indent=False)] if at else []),
                    _comment(
                        f"pipespec: adapted for pipeline stages by {GENERATOR} v{GENERATOR_VERSION} (spec {self.spec.name}); "
                        "do not edit by hand, regenerate with adapter-gen"
                    ),
                ]
            ),
            _stmt(f"{NUM_LAYERS_KEY_ATTR} = {json.dumps(num_key)}\n"),
            _stmt(f"{HAS_RESIDUAL_ATTR} = False\n"),
            _stmt(f"{GENERATED_BY_ATTR} = {json.dumps(marker_text(self.source, self.spec))}\n"),
        ]
        body = [new_func if s is func else s for s in body]
        following = body[at] if at < len(body) else None
        if following is not None and not (following.leading_lines and not following.leading_lines[0].comment):
            body[at] = following.with_changes(leading_lines=[cst.EmptyLine(indent=False), *following.leading_lines])
        body[at:at] = header
        bases = list(cls.bases)
        if not any(m.matches(b.value, m.Name(AUX_MIXIN)) for b in bases):
            if bases:
                last = bases[-1]
                bases[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            bases.append(cst.Arg(value=cst.Name(AUX_MIXIN)))
        changes: dict[str, object] = {"body": cls.body.with_changes(body=body), "bases": bases}
        if cls.lpar is cst.MaybeSentinel.DEFAULT or not cls.bases:
            changes["lpar"] = cst.LeftParen()
            changes["rpar"] = cst.RightParen()
        return cls.with_changes(**changes)

    # ------------------------------------------------------------------------------ forward
    def _stage_forward(self, shape: ForwardShape) -> cst.FunctionDef:
        func = shape.func
        stmts = list(func.body.body)  # type: ignore[union-attr]
        loop = shape.loop
        stream = loop.stream
        used = names_in(func)
        if AUX_VAR in used or OUTPUT_VAR in used:
            raise self._skip(f"forward already uses the name {AUX_VAR} or {OUTPUT_VAR}")

        # prologue: first-stage-only statements
        new: list[cst.BaseStatement | list[cst.BaseStatement]] = list(stmts)
        for i in shape.first_stage_only:
            alias = stream if i == shape.stream_first_assigned and stream != "inputs_embeds" else None
            new[i] = _guard_first_stage(stmts[i], alias)

        # the loop, then the epilogue
        new[loop.index] = _stage_loop(loop, used)
        if loop.index + 1 < len(stmts) and not stmts[loop.index + 1].leading_lines:
            stmts[loop.index + 1] = stmts[loop.index + 1].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        for j in range(loop.index + 1, len(stmts)):  # the epilogue: returns hand back the aux states too
            rewritten = stmts[j].visit(_ReturnRewriter())
            new[j] = list(rewritten.nodes) if isinstance(rewritten, cst.FlattenSentinel) else rewritten  # type: ignore[assignment]
        flat: list[cst.BaseStatement] = []
        for item in new:
            flat.extend(item if isinstance(item, list) else [item])
        flat.insert(shape.body_start, _stage_input())
        self._check_stream_bound(flat, stream)

        decorators = [d for d in func.decorators if not self._dropped(d)]
        return func.with_changes(
            params=self._with_intermediate_param(func.params),
            body=func.body.with_changes(body=flat),
            decorators=decorators,
            leading_lines=[
                *func.leading_lines,
                _comment(
                    f"pipespec: stage forward generated by {GENERATOR} v{GENERATOR_VERSION} from {self.source} "
                    f"(spec {self.spec.name}); do not edit, regenerate with adapter-gen"
                ),
            ],
        )

    @staticmethod
    def _dropped(dec: cst.Decorator) -> bool:
        node = dec.decorator.func if isinstance(dec.decorator, cst.Call) else dec.decorator
        name = node.attr.value if isinstance(node, cst.Attribute) else getattr(node, "value", "")
        return name in DROPPED_DECORATORS

    @staticmethod
    def _with_intermediate_param(params: cst.Parameters) -> cst.Parameters:
        param = cst.Param(
            name=cst.Name("intermediate_tensors"),
            annotation=cst.Annotation(cst.parse_expression("IntermediateTensors | None")),
            default=cst.Name("None"),
            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(" "), whitespace_after=cst.SimpleWhitespace(" ")),
        )
        if params.star_arg is not cst.MaybeSentinel.DEFAULT or params.kwonly_params:
            kw = list(params.kwonly_params)
            template = kw[-1] if kw else None
            if template is not None:
                param = param.with_changes(comma=template.comma, whitespace_after_param=template.whitespace_after_param)
            return params.with_changes(kwonly_params=[*kw, param])
        pos = list(params.params)
        template = pos[-1] if pos else None
        if template is not None:
            param = param.with_changes(comma=template.comma, whitespace_after_param=template.whitespace_after_param)
            if template.comma is cst.MaybeSentinel.DEFAULT:
                pos[-1] = template.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return params.with_changes(params=[*pos, param])

    def _check_stream_bound(self, stmts: list[cst.BaseStatement], stream: str) -> None:
        """Belt and braces: some unguarded statement (or the else alias) binds the stream before the loop."""
        for stmt in stmts:
            if isinstance(stmt, cst.For) and m.matches(stmt.iter, m.Call(func=m.Name("range"))):
                if m.matches(stmt.iter, m.Call(args=[m.Arg(m.Attribute(attr=m.Name("start_layer"))), m.DoNotCare()])):
                    raise self._skip(f"`{stream}` is not bound on every stage before the layer loop")
            if stream == "inputs_embeds":
                return
            if isinstance(stmt, cst.If) and m.matches(stmt.test, m.Attribute(value=m.Name("self"), attr=m.Name("is_first_stage"))):
                if stmt.orelse is not None and stream in assigned_names(stmt.orelse):
                    return
                continue
            if stream in assigned_names(stmt) and not isinstance(stmt, cst.If):
                return
