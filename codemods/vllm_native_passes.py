"""The vLLM-native codemod's passes, one libcst ``Codemod`` per concern, run in order by
``adapt_vllm_module`` through one ``CodemodContext``.

Each pass reads and writes the run's state, a ``NativeRun`` kept in ``context.scratch[RUN]``: the
decoders found, each one's status, plan and rewrite, the classes replaced, the imports the generated code
needs. A pass that asks about one decoder runs over the decoders in file order; a ``Decline`` raised for
one decoder marks that decoder declined (the construct and its line) and the later passes skip it. The
classes rewritten replace their originals only in ``ReplaceClassesCommand``, so a decoder declined late
leaves nothing behind.

The passes share the parsed module's nodes (the state is keyed by them), so they run on the tree as
parsed: ``NativePass.transform_module`` does not wrap a copy of it in a ``MetadataWrapper`` as libcst's
default does per pass. Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as replace_plan
from typing import ClassVar

import libcst as cst
from libcst.codemod import Codemod, CodemodContext

from pipespec.codemods.vllm_native_branches import Branches, forward_plans, with_plans
from pipespec.codemods.vllm_native_decoder import adapt_decoder
from pipespec.codemods.vllm_native_helpers import Helpers
from pipespec.codemods.vllm_native_holders import Holder, adapt_holder, find_holders, share_embed
from pipespec.codemods.vllm_native_imports import add_imports, stamp
from pipespec.codemods.vllm_native_index import ClassIndex, ModuleReader
from pipespec.codemods.vllm_native_lines import LineIndex
from pipespec.codemods.vllm_native_loop import ClassLookup, Decline, ForwardPlan, is_pp_decoder
from pipespec.codemods.vllm_native_modules import ModuleSources
from pipespec.codemods.vllm_native_names import (
    PP_DECODER,
    base_name,
    bases_of,
    module_names,
    nn_module_type,
)
from pipespec.codemods.vllm_native_qualified import UNBOUND, VllmNames
from pipespec.codemods.vllm_native_residual import residual_read, zero_is_none
from pipespec.codemods.vllm_native_runner_surface import decoder_surface, wrapper_surface
from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.codemods.vllm_native_support import judge
from pipespec.contract.names import VLLM_EAGLE3_INTERFACE
from pipespec.contract.spec import RESIDUAL_RULES, AdapterSpec
from pipespec.errors import UsageError

RUN = "vllm_native"  #: the key of the run's state in ``CodemodContext.scratch``


@dataclass
class DecoderRun:
    """One PP decoder of the file, as the passes leave it."""

    cls: cst.ClassDef
    holders: list[Holder]
    status: DecoderStatus | None = None  # None until judged
    reason: str = ""  # unchanged: why; declined: "line N: <construct>"
    plan: ForwardPlan | Branches | Helpers | None = None
    rewritten: cst.ClassDef | None = None  # the decoder's rewrite, before its holders are
    imports: set[str] = field(default_factory=set)  # what the rewrite names, to import once it lands

    @property
    def name(self) -> str:
        return self.cls.name.value


@dataclass
class NativeRun:
    """What the passes are given (the parsed file and the caller's choices) and what they find and write."""

    module: cst.Module
    code: str
    label: str
    read: ModuleReader
    classes: Sequence[str] | None = None
    spec: AdapterSpec | None = None
    rule: str | None = None
    absolute_imports: bool | None = None
    line_of: LineIndex = field(init=False)
    top: list[cst.ClassDef] = field(default_factory=list)
    lookup: ClassLookup | None = None
    decoders: list[DecoderRun] = field(default_factory=list)  # the chosen ones, in file order
    replace: dict[cst.ClassDef, cst.ClassDef] = field(default_factory=dict)  # original class -> its rewrite
    needed: set[str] = field(default_factory=set)  # names the generated code imports
    adapted_names: list[str] = field(default_factory=list)  # the classes the header lists
    eagle3_ready: set[str] = field(default_factory=set)  # classes that are SupportsEagle3 (bases or rewrite)
    names: VllmNames = UNBOUND  # the file's names for vLLM's (vllm_native_qualified), read when decoders are found

    def __post_init__(self) -> None:
        self.line_of = LineIndex(self.module, self.code)  # positions resolved per decoder class, where a line is asked


class NativePass(Codemod):
    """A pass of the vLLM-native codemod: ``DESCRIPTION`` says what it does, ``transform_module_impl``
    does it on the run's state."""

    DESCRIPTION: ClassVar[str]

    @property
    def run(self) -> NativeRun:
        state = self.context.scratch[RUN]
        assert isinstance(state, NativeRun)
        return state

    def transform_module(self, tree: cst.Module) -> cst.Module:
        # The state is keyed by the parsed nodes: run on them (libcst's default resolves metadata on a copy).
        return self.transform_module_impl(tree)

    def each_adapted(self, step: Callable[[DecoderRun], None]) -> None:
        """``step`` on every decoder still to be adapted, in file order; a ``Decline`` declines that one."""
        for dec in self.run.decoders:
            if dec.status is DecoderStatus.ADAPTED:
                self.run.line_of.near(dec.cls)
                try:
                    step(dec)
                except Decline as exc:
                    dec.status, dec.reason = DecoderStatus.DECLINED, f"line {self.run.line_of(exc.node)}: {exc.reason}"


class FindDecodersCommand(NativePass):
    DESCRIPTION = "Find the file's PP decoders and the classes holding them; keep those --class or the spec names."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        run = self.run
        run.top = [s for s in tree.body if isinstance(s, cst.ClassDef)]
        found = [c for c in run.top if is_pp_decoder(c)]
        run.lookup = ClassIndex(tree, run.read, package=run.read.package if isinstance(run.read, ModuleSources) else None).lookup
        if run.rule is not None and run.rule not in RESIDUAL_RULES:
            raise UsageError(f"residual rule {run.rule!r} is unknown: use one of {', '.join(RESIDUAL_RULES)}")
        if not found:
            present = ", ".join(c.name.value for c in run.top) or "none"
            raise UsageError(f"{run.label}: no PP decoder here ({PP_DECODER}; classes here: {present}); "
                             "pass a vLLM model file with one")
        run.names = VllmNames.of(tree)
        holders = {d.name.value: find_holders(run.top, d.name.value, run.names) for d in found}
        chosen = _select(found, holders, run.classes, run.top, run.label)
        if run.spec is not None and len(chosen) > 1:
            chosen = [d for d in chosen if d.name.value == run.spec.decoder_class_name] or chosen
        run.decoders = [DecoderRun(d, holders[d.name.value]) for d in chosen]
        run.eagle3_ready = {c.name.value for c in run.top if run.names.has_base(c, VLLM_EAGLE3_INTERFACE)}
        return tree


class JudgeDecodersCommand(NativePass):
    DESCRIPTION = "Judge each decoder: unchanged (already follows vLLM's contract), declined (an opt-out) or to adapt."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        for dec in self.run.decoders:
            self.run.line_of.near(dec.cls)
            try:
                dec.status, dec.reason = judge(dec.cls, self.run.lookup)
            except Decline as exc:
                dec.status, dec.reason = DecoderStatus.DECLINED, f"line {self.run.line_of(exc.node)}: {exc.reason}"
        return tree


class PlanForwardCommand(NativePass):
    DESCRIPTION = ("Plan each forward's rewrite: its layer loop and global index, returns and captures to replace or "
                   "keep; one plan per config branch, or the captures its helper methods keep.")

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        def plan(dec: DecoderRun) -> None:
            dec.plan = forward_plans(dec.cls, self.run.line_of, self.run.lookup, self.run.names)

        self.each_adapted(plan)
        return tree


class ReadResidualHandoffCommand(NativePass):
    DESCRIPTION = ("Read from the layer classes whether the stream at a layer boundary includes the residual "
                   "(a layer that rebinds it first hands on a stale one).")

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        def read(dec: DecoderRun) -> None:
            plan = dec.plan
            if isinstance(plan, Branches):  # one loop per config branch: each branch's residual read on its own
                dec.plan = with_plans(plan, [self._read(dec.cls, p) for p in plan.plans])
            elif isinstance(plan, ForwardPlan):  # Helpers: the model's own captures, nothing to read
                dec.plan = self._read(dec.cls, plan)

        self.each_adapted(read)
        return tree

    def _read(self, cls: cst.ClassDef, plan: ForwardPlan) -> ForwardPlan:
        run = self.run
        assert run.lookup is not None
        if plan.residual is not None and not plan.own_capture and plan.before_capture is None and plan.residual_arg is None:
            reads = residual_read(cls, plan, run.lookup, {c.name.value for c in run.top}, run.rule)
            if isinstance(reads, tuple):
                plan = replace_plan(plan, stale_for=reads)
            elif not reads:
                plan = replace_plan(plan, stale_residual=True)
            if reads is not True and zero_is_none(cls, plan, run.lookup):
                plan = replace_plan(plan, zero_none_residual=True)
        return plan


class RewriteDecodersCommand(NativePass):
    DESCRIPTION = ("Rewrite each decoder to the plan: EagleModelMixin, the flag and marker, the target embedding, "
                   "its forward (collect, capture, pack, hand over), and what vLLM's V2 runner reads on it.")

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        run = self.run
        module_type = nn_module_type(module_names(tree))

        def rewrite(dec: DecoderRun) -> None:
            assert dec.plan is not None
            new_dec, imports = adapt_decoder(run.replace.get(dec.cls, dec.cls), dec.plan, run.spec, run.label, tree,
                                             run.names)
            held, spec = dec.holders, run.spec
            if spec is not None and held and spec.embed_decoder_attr not in (None, held[0].attr):
                raise Decline(f"spec {spec.name} ({spec.source}) says embed.decoder_attr = {spec.embed_decoder_attr!r} "
                              f"but {held[0].cls.name.value} holds {dec.name} as self.{held[0].attr}: fix the spec",
                              held[0].cls)
            dec.rewritten, dec.imports = decoder_surface(new_dec, held, module_type), imports

        self.each_adapted(rewrite)
        return tree


class RewriteHoldersCommand(NativePass):
    DESCRIPTION = ("Give the classes holding each adapted decoder SupportsEagle3, aux-layer setters that reach it, "
                   "and a wrapper's shared embedding and runner surface; schedule the rewrites to replace their classes.")

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        run = self.run
        module_type = nn_module_type(module_names(tree))

        def rewrite(dec: DecoderRun) -> None:
            assert dec.plan is not None and dec.rewritten is not None
            replace, edits, imports = run.replace, [], set(dec.imports)
            for h in dec.holders:
                bases_ready = any(base_name(b) in run.eagle3_ready for b in bases_of(h.cls))
                new_h, more = adapt_holder(replace.get(h.cls, h.cls), h.attr, dec.plan.loop.layers_attr, bases_ready,
                                           module_type, h.multimodal, run.names)
                edits.append((h.cls, new_h))
                imports |= more
                run.eagle3_ready.add(h.cls.name.value)
                if h.wrapper is not None:
                    wrapped = share_embed(replace.get(h.wrapper, h.wrapper), h.wrapper_attr, dec.rewritten, module_type)
                    wrapped = wrapper_surface(wrapped, h.wrapper_attr)
                    edits.append((h.wrapper, wrapped))
                    replace[h.wrapper] = wrapped
            replace[dec.cls] = dec.rewritten
            for old, new in edits:
                replace[old] = new
            run.needed |= imports
            changed = {old for old, new in edits if new is not old}
            named = [h.cls.name.value for h in dec.holders if not h.multimodal or h.cls in changed]
            run.adapted_names += [dec.name, *named, *(h.wrapper.name.value for h in dec.holders if h.wrapper is not None)]

        self.each_adapted(rewrite)
        return tree


class ReplaceClassesCommand(NativePass):
    DESCRIPTION = "Put each rewritten class in place of its original in the module."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        replace = self.run.replace
        if not replace:
            return tree
        return tree.with_changes(body=[replace.get(s, s) for s in tree.body])  # type: ignore[call-overload]


class AddContractImportsCommand(NativePass):
    DESCRIPTION = ("Import what the generated code names (EagleModelMixin, SupportsEagle3, get_pp_group, "
                   "spec_decode_needs_target_embed), merged into the file's own import lines as isort would.")

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if not self.run.replace:
            return tree
        return add_imports(tree, self.run.needed, self.run.absolute_imports)


class StampHeaderCommand(NativePass):
    DESCRIPTION = "Write the generated-file header (source, generator, adapted classes, the command that regenerates them)."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if not self.run.replace:
            return tree
        return stamp(tree, self.run.label, self.run.adapted_names)


#: The passes in the order ``adapt_vllm_module`` runs them.
PASSES: tuple[type[NativePass], ...] = (
    FindDecodersCommand,
    JudgeDecodersCommand,
    PlanForwardCommand,
    ReadResidualHandoffCommand,
    RewriteDecodersCommand,
    RewriteHoldersCommand,
    ReplaceClassesCommand,
    AddContractImportsCommand,
    StampHeaderCommand,
)


def run_passes(run: NativeRun, passes: Sequence[type[NativePass]] = PASSES) -> tuple[cst.Module, CodemodContext]:
    """The module after ``passes`` (default: all, in order) over ``run``, and the context they shared."""
    context = CodemodContext(filename=run.label, scratch={RUN: run})
    tree = run.module
    for cls in passes:
        tree = cls(context).transform_module(tree)
    return tree, context


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


__all__ = [
    "PASSES", "RUN", "AddContractImportsCommand", "DecoderRun", "FindDecodersCommand", "JudgeDecodersCommand",
    "NativePass", "NativeRun", "PlanForwardCommand", "ReadResidualHandoffCommand", "ReplaceClassesCommand",
    "RewriteDecodersCommand", "RewriteHoldersCommand", "StampHeaderCommand", "run_passes",
]
