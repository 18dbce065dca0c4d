"""Adapt vLLM model files to vLLM's own EAGLE3-over-PP contract (vLLM >= 0.32), as its llama.py does.

``adapt_vllm_module(code, label=...)`` rewrites every PP decoder stack in a vLLM model file (or the ones
named) so that it runs in vLLM unchanged:

* the decoder inherits vLLM's ``EagleModelMixin`` and sets ``supports_aux_hidden_states_over_pp = True``
  on itself (plus ``pipespec_generated_by``, a plain string naming source, generator and version);
* ``forward`` calls ``collect_remote_aux_hidden_states(intermediate_tensors)`` before the layer loop,
  captures id ``self.start_layer`` on the first rank and ``idx + 1`` (global index) after each layer with
  ``_maybe_add_hidden_state``, packs ``**self.pack_local_aux_hidden_states(aux)`` into the non-last
  ``IntermediateTensors`` and returns ``(hidden, remote + local)`` on the last rank when there are any;
  an existing PP=1-only capture is replaced by this one; ``get_pp_group()`` rank checks stay;
* an embedding built on the first rank only is also built where ``spec_decode_needs_target_embed``
  says (the last rank, for an EAGLE drafter), and is reachable as ``embed_tokens`` for vLLM's drafter;
* the ``*ForCausalLM`` classes holding the decoder get ``SupportsEagle3`` and, where vLLM's protocol
  defaults cannot find the decoder (not at ``.model``), ``set_aux_hidden_state_layers`` /
  ``get_eagle3_default_aux_hidden_state_layers`` and a ``model`` property.

Files already PP-correct come back byte-identical (status ``unchanged``); a decoder this cannot rewrite
safely is ``declined`` with the construct and its line. Running on its own output changes nothing. The
generated code imports only vLLM and torch. This module parses source only: it never imports vLLM nor
executes the code it reads.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace as replace_plan

import libcst as cst

from pipespec.codemods.vllm_native_branches import Branches, forward_plans, with_plans
from pipespec.codemods.vllm_native_decoder import adapt_decoder
from pipespec.codemods.vllm_native_helpers import Helpers
from pipespec.codemods.vllm_native_holders import Holder, adapt_holder, find_holders, share_embed
from pipespec.codemods.vllm_native_imports import add_imports, stamp
from pipespec.codemods.vllm_native_index import ClassIndex, ModuleReader, default_reader
from pipespec.codemods.vllm_native_lines import LineIndex
from pipespec.codemods.vllm_native_loop import ClassLookup, Decline, ForwardPlan, is_pp_decoder
from pipespec.codemods.vllm_native_modules import ModuleSources
from pipespec.codemods.vllm_native_names import (
    GENERATOR,
    GENERATOR_VERSION,
    PP_DECODER,
    base_name,
    bases_of,
    has_base,
    module_names,
    nn_module_type,
)
from pipespec.codemods.vllm_native_residual import residual_read, zero_is_none
from pipespec.codemods.vllm_native_runner_surface import decoder_surface, wrapper_surface
from pipespec.codemods.vllm_native_support import DecoderStatus, judge
from pipespec.contract.names import VLLM_EAGLE3_INTERFACE
from pipespec.contract.spec import RESIDUAL_RULES, AdapterSpec
from pipespec.errors import UsageError


@dataclass(frozen=True)
class DecoderOutcome:
    """What happened to one decoder stack of the file."""

    class_name: str
    status: DecoderStatus
    reason: str  # "" when adapted; for declined: the construct and its line ("line 412: ...")
    causal_lm: tuple[str, ...]  # top-level classes of the file that hold this decoder
    decoder_attr: str | None  # the attribute of the *ForCausalLM holding it ("model", "transformer", ...)


@dataclass(frozen=True)
class VllmAdaptation:
    """The new module source (== the input byte for byte when nothing was adapted) and each decoder's fate."""

    code: str
    decoders: tuple[DecoderOutcome, ...]



def adapt_vllm_module(code: str, *, label: str, classes: Sequence[str] | None = None,
                      spec: AdapterSpec | None = None, absolute_imports: bool | None = None,
                      read_module: ModuleReader | None = None, residual_rule: str | None = None) -> VllmAdaptation:
    """Rewrite the PP decoders of one vLLM model file to vLLM's EAGLE3-over-PP contract.

    ``classes`` names decoders or the ``*ForCausalLM`` classes holding them (default: every PP decoder).
    ``absolute_imports``: the imports it adds are ``vllm.model_executor.models.*`` (True), ``.interfaces``
    style (False), or follow the file (None). Raises ``UsageError`` for a file without a PP decoder or an
    unknown class. ``read_module(dotted)`` returns the source of a module the file imports from
    (``"qwen3_moe"`` for ``from .qwen3_moe import``, or ``"vllm.model_executor.models.qwen3_moe"``), or
    None; it is how a layer class defined elsewhere is read. Default: the file's siblings where ``label``
    is a path, else the installed vLLM's source where ``label`` is a path inside it (``vllm/...``); pass
    ``ModuleSources(path)`` to resolve from a file's real place (its package, the vLLM tree it is in).
    ``residual_rule`` (``"reads"`` | ``"rebinds"``, else the spec's ``residual_rule``) says whether a layer
    reads the residual it is given, where the layer classes cannot be found from the source.
    Example::

        out = adapt_vllm_module(Path("gemma2.py").read_text(), label="gemma2.py")
        [(d.class_name, d.status) for d in out.decoders]   # [("Gemma2Model", DecoderStatus.ADAPTED)]
    """
    if "intermediate_tensors" not in code:  # no forward can take it: skip libcst's (slow) parse
        try:
            tree = ast.parse(code)
        except SyntaxError:
            pass  # libcst's parse below words the error
        else:
            present = ", ".join(s.name for s in tree.body if isinstance(s, ast.ClassDef)) or "none"
            raise UsageError(f"{label}: no PP decoder here ({PP_DECODER}; classes here: {present}); "
                             "pass a vLLM model file with one")
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        raise UsageError(f"{label}:{exc.raw_line}: cannot parse this source: {exc.message}; adapter-gen reads valid Python only") from None
    line_of = LineIndex(module, code)  # positions resolved per decoder class, where a line is asked

    top = [s for s in module.body if isinstance(s, cst.ClassDef)]
    decoders = [c for c in top if is_pp_decoder(c)]
    read = read_module if read_module is not None else default_reader(label)
    lookup = ClassIndex(module, read, package=read.package if isinstance(read, ModuleSources) else None).lookup
    rule = residual_rule if residual_rule is not None else (spec.residual_rule if spec is not None else None)
    if rule is not None and rule not in RESIDUAL_RULES:
        raise UsageError(f"residual rule {rule!r} is unknown: use one of {', '.join(RESIDUAL_RULES)}")
    if not decoders:
        present = ", ".join(c.name.value for c in top) or "none"
        raise UsageError(f"{label}: no PP decoder here ({PP_DECODER}; classes here: {present}); "
                         "pass a vLLM model file with one")
    holders = {d.name.value: find_holders(top, d.name.value) for d in decoders}
    chosen = _select(decoders, holders, classes, top, label)
    if spec is not None and len(chosen) > 1:
        spec_cls = spec.decoder_class_name
        chosen = [d for d in chosen if d.name.value == spec_cls] or chosen
    edit = _FileEdit(module, top, spec, label, line_of, lookup, rule)
    outcomes = [edit.decoder(dec, holders[dec.name.value]) for dec in chosen]
    if not edit.replace:
        return VllmAdaptation(code, tuple(outcomes))
    new_module = module.with_changes(body=[edit.replace.get(s, s) for s in module.body])  # type: ignore[arg-type]
    new_module = add_imports(new_module, edit.needed, absolute_imports)
    new_module = stamp(new_module, label, edit.adapted_names)
    return VllmAdaptation(new_module.code, tuple(outcomes))


class _FileEdit:
    """The classes of one file rewritten so far (by node id), the imports they need and the names the
    header lists; ``decoder`` adapts one decoder and its holders or records why not."""

    def __init__(self, module: cst.Module, top: list[cst.ClassDef], spec: AdapterSpec | None, label: str,
                 line_of: LineIndex, lookup: ClassLookup, rule: str | None = None) -> None:
        self.module, self.top, self.spec, self.label, self.line_of, self.lookup = module, top, spec, label, line_of, lookup
        self.rule = rule
        self.replace: dict[cst.ClassDef, cst.ClassDef] = {}  # original class -> its rewrite
        self.needed: set[str] = set()
        self.adapted_names: list[str] = []
        self.eagle3_ready = {c.name.value for c in top if has_base(c, VLLM_EAGLE3_INTERFACE)}

    def decoder(self, dec: cst.ClassDef, held: list[Holder]) -> DecoderOutcome:
        name = dec.name.value
        causal = tuple(h.cls.name.value for h in held)
        attr = held[0].attr if held else None
        self.line_of.near(dec)
        try:
            status, reason = judge(dec, self.lookup)
            if status is DecoderStatus.ADAPTED:
                self._adapt(dec, held)
        except Decline as exc:
            status, reason = DecoderStatus.DECLINED, f"line {self.line_of(exc.node)}: {exc.reason}"
        return DecoderOutcome(name, status, "" if status is DecoderStatus.ADAPTED else reason, causal, attr)

    def _plan(self, dec: cst.ClassDef) -> ForwardPlan | Branches | Helpers:
        found = forward_plans(dec, self.line_of, self.lookup)
        if isinstance(found, Branches):  # one loop per config branch: each branch's residual read on its own
            return with_plans(found, [self._residual_rule(dec, p) for p in found.plans])
        if isinstance(found, Helpers):  # the model's own captures, in its helpers: nothing to read
            return found
        return self._residual_rule(dec, found)

    def _residual_rule(self, dec: cst.ClassDef, plan: ForwardPlan) -> ForwardPlan:
        if plan.residual is not None and not plan.own_capture and plan.before_capture is None and plan.residual_arg is None:
            reads = residual_read(dec, plan, self.lookup, {c.name.value for c in self.top}, self.rule)
            if isinstance(reads, tuple):
                plan = replace_plan(plan, stale_for=reads)
            elif not reads:
                plan = replace_plan(plan, stale_residual=True)
            if reads is not True and zero_is_none(dec, plan, self.lookup):
                plan = replace_plan(plan, zero_none_residual=True)
        return plan

    def _adapt(self, dec: cst.ClassDef, held: list[Holder]) -> None:
        spec, replace, name = self.spec, self.replace, dec.name.value
        plan = self._plan(dec)
        new_dec, imports = adapt_decoder(replace.get(dec, dec), plan, spec, self.label, self.module)
        if spec is not None and held and spec.embed_decoder_attr not in (None, held[0].attr):
            raise Decline(f"spec {spec.name} ({spec.source}) says embed.decoder_attr = {spec.embed_decoder_attr!r} "
                          f"but {held[0].cls.name.value} holds {name} as self.{held[0].attr}: fix the spec", held[0].cls)
        module_type = nn_module_type(module_names(self.module))
        new_dec = decoder_surface(new_dec, held, module_type)  # what vLLM's V2 runner reads where it looks
        edits = []
        for h in held:
            bases_ready = any(base_name(b) in self.eagle3_ready for b in bases_of(h.cls))
            new_h, more = adapt_holder(replace.get(h.cls, h.cls), h.attr, plan.loop.layers_attr, bases_ready,
                                       module_type, h.multimodal)
            edits.append((h.cls, new_h))
            imports |= more
            self.eagle3_ready.add(h.cls.name.value)
            if h.wrapper is not None:
                wrapped = share_embed(replace.get(h.wrapper, h.wrapper), h.wrapper_attr, new_dec, module_type)
                wrapped = wrapper_surface(wrapped, h.wrapper_attr)
                edits.append((h.wrapper, wrapped))
                replace[h.wrapper] = wrapped
        replace[dec] = new_dec
        for old, new in edits:
            replace[old] = new
        self.needed |= imports
        changed = {old for old, new in edits if new is not old}
        named = [h.cls.name.value for h in held if not h.multimodal or h.cls in changed]
        self.adapted_names += [name, *named, *(h.wrapper.name.value for h in held if h.wrapper is not None)]


def _select(decoders: list[cst.ClassDef], holders: dict[str, list[Holder]], classes: Sequence[str] | None,
            top: list[cst.ClassDef], label: str) -> list[cst.ClassDef]:
    if classes is None:
        return decoders
    by_name = {d.name.value: d for d in decoders}
    chosen: list[cst.ClassDef] = []
    for name in classes:
        picked = [by_name[name]] if name in by_name else [by_name[d] for d, hs in holders.items()
                                                           if any(h.cls.name.value == name for h in hs)]
        if not picked:
            present = ", ".join(c.name.value for c in top) or "none"
            pp = ", ".join(by_name)
            if name in {c.name.value for c in top}:
                raise UsageError(f"{label}: class {name!r} is neither a PP decoder nor a class holding one "
                                 f"(PP decoders here: {pp}); pass one of them to --class")
            raise UsageError(f"{label}: no top-level class {name!r} (classes here: {present}); pass a PP decoder "
                             f"({pp}) or the class holding it to --class")
        chosen += [d for d in picked if all(d is not c for c in chosen)]
    return chosen


__all__ = ["DecoderOutcome", "VllmAdaptation", "adapt_vllm_module", "GENERATOR", "GENERATOR_VERSION"]
