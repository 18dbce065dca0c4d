"""The SGLang dialect: adapt an SGLang model file so EAGLE3's aux states survive pipeline parallelism.

``adapt_sglang_module(code, label=..., classes=None)`` runs two libcst commands over one file:

1. ``RelayAuxStatesCommand`` (``sglang_forward``): each decoder (a ``forward`` with a pipeline layer
   loop) captures on every rank, seeds its collector with the states received from upstream, and adds
   its own to the ``PPProxyTensors`` a non-last rank returns; the last rank's list (or packed buffer)
   reaches the logits processor as before.
2. ``CaptureOnEveryRankCommand`` (``sglang_setter``): ``set_eagle3_layers_to_capture`` (and the DFlash
   setter) stop returning early off the last rank, and ``capture_aux_hidden_states`` stays a last-rank
   fact (also in a setter that never had the guard). It runs only when no decoder of the file was
   declined: a non-last rank that learns its ids but cannot send them would
   hand the last rank fewer states, where SGLang today fails loudly.

The result lists every decoder with its verdict, the reason (construct and line for a decline), the
capture form and the id convention read from the model's own setter. A second run changes nothing.
The generated code imports nothing from pipespec (docs/codemods.md, "SGLang dialect", says why).

    >>> result = adapt_sglang_module("x = 1\\n", label="empty.py")
    >>> result.changed, result.decoders
    (False, ())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.helpers import get_full_name_for_node

from pipespec.codemods.sglang_forward import AUX_MODULE, RelayAuxStatesCommand, is_pp_loop, pp_forward
from pipespec.codemods.sglang_outcome import CaptureForm, DecoderOutcome, SglangStatus
from pipespec.codemods.sglang_setter import CaptureOnEveryRankCommand, id_conventions

__all__ = ["CaptureForm", "DecoderOutcome", "SglangAdaptResult", "SglangStatus", "adapt_sglang_module"]


@dataclass(frozen=True)
class SglangAdaptResult:
    """The adapted source and what happened to each decoder and setter of the file."""

    label: str
    source: str
    code: str
    decoders: tuple[DecoderOutcome, ...]
    #: ``Class.method`` setters whose last-rank guard was dropped.
    setters: tuple[str, ...] = ()
    #: ``Class.method: why`` setters left with their guard.
    setters_left: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.code != self.source

    def outcome(self, cls: str) -> DecoderOutcome:
        for row in self.decoders:
            if row.cls == cls:
                return row
        raise KeyError(f"{self.label}: no decoder class {cls} with a pipeline layer loop "
                       f"(decoders: {', '.join(r.cls for r in self.decoders) or 'none'})")


def adapt_sglang_module(code: str, *, label: str, classes: Sequence[str] | None = None) -> SglangAdaptResult:
    """Adapt SGLang model source ``code`` (``label`` names it in messages); ``classes`` limits the decoders.

    Raises ``libcst.ParserSyntaxError`` for source that does not parse.
    """
    module = cst.parse_module(code)
    outcomes: list[DecoderOutcome] = []
    adapted = _relay(module, label, outcomes, classes)
    conventions = id_conventions(module)
    blocking = [o for o in outcomes if o.status is SglangStatus.DECLINED]
    if not outcomes and any(is_pp_loop(n) for n in m.findall(module, m.For())):
        # a layer loop outside any forward (deepseek_v4's _forward_impl): the decoder is here but unseen
        blocking.append(DecoderOutcome(cls="", status=SglangStatus.DECLINED, reason="", capture_form=CaptureForm.NONE))
    setters: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    if not blocking:
        setter = CaptureOnEveryRankCommand(CodemodContext(filename=label))
        adapted = setter.transform_module(adapted)
        setters, left = tuple(setter.adapted), tuple(setter.skipped)
    rows = tuple(o.with_convention(_convention_for(o.cls, module, conventions)) for o in outcomes)
    return SglangAdaptResult(label=label, source=code, code=adapted.code, decoders=rows, setters=setters,
                             setters_left=left)


def _relay(module: cst.Module, label: str, outcomes: list[DecoderOutcome], classes: Sequence[str] | None) -> cst.Module:
    """``RelayAuxStatesCommand`` over the file's top-level imports and decoder classes only (their qualified names
    and lines are what it reads: resolving scopes over a 3,000-line file for one class is most of the cost), the
    rewritten classes put back in place and the imports it asked for added to the whole file."""
    body = list(module.body)
    decoders = [i for i, s in enumerate(body) if isinstance(s, cst.ClassDef) and pp_forward(s) is not None
                and (classes is None or s.name.value in classes)]
    if not decoders:
        return module
    imports = [i for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()]))]
    kept = sorted({*imports, *decoders})
    reduced = module.with_changes(body=[body[i] for i in kept])
    full_lines, reduced_lines = _lines_before(module), _lines_before(reduced)
    offsets: dict[str, int] = {}
    for j, i in enumerate(kept):
        if i in decoders:
            offsets.setdefault(cst.ensure_type(body[i], cst.ClassDef).name.value, full_lines[i] - reduced_lines[j])
    context = CodemodContext(filename=label, full_module_name=None)
    out = RelayAuxStatesCommand(context, outcomes, classes, offsets).transform_module(reduced)
    rewritten = [s for s in out.body if isinstance(s, cst.ClassDef)]
    for i, new in zip([i for i in kept if i in decoders], rewritten, strict=True):
        body[i] = new
    spliced = module.with_changes(body=body)
    return sorted_import_names(AddImportsVisitor(context).transform_module(spliced), AUX_MODULE)


def _lines_before(module: cst.Module) -> list[int]:
    """For each top-level statement, the number of lines of the module before it."""
    counts, seen = [], module.code_for_node(cst.Module(body=[], header=module.header)).count("\n")
    for stmt in module.body:
        counts.append(seen)
        seen += module.code_for_node(stmt).count("\n")
    return counts


def sorted_import_names(module: cst.Module, from_module: str) -> cst.Module:
    """The names of the top-level ``from <from_module> import ...`` in sorted order, separated as the file's
    own names were: ``AddImportsVisitor`` puts a name it adds to an existing import first, with ``", "``,
    where isort (SGLang's linter) sorts them."""
    body = list(module.body)
    for i, stmt in enumerate(body):
        if not m.matches(stmt, m.SimpleStatementLine(body=[m.ImportFrom(module=m.DoNotCare())])):
            continue
        node = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.ImportFrom)
        if node.module is None or get_full_name_for_node(node.module) != from_module or isinstance(node.names,
                                                                                                  cst.ImportStar):
            continue
        names = list(node.names)
        order = sorted(names, key=lambda a: (a.evaluated_name, a.evaluated_alias or ""))
        if order != names:
            between = names[1].comma if len(names) >= 3 else names[0].comma  # [0] is the added name
            commas = [between] * (len(names) - 1) + [names[-1].comma]
            fixed = [alias.with_changes(comma=comma) for alias, comma in zip(order, commas, strict=True)]
            body[i] = stmt.with_changes(body=[node.with_changes(names=fixed)])
    return module.with_changes(body=body)


def _convention_for(decoder: str, module: cst.Module, conventions: dict[str, str]) -> str:
    """The convention of the class that builds ``decoder`` (``self.model = Decoder(...)``), else the file's only
    one; "" when the setter lives in another file (an inherited ``*ForCausalLM``)."""
    builds = [c for c in conventions if _builds(module, c, decoder)]
    owner = builds[0] if builds else (next(iter(conventions)) if len(conventions) == 1 else None)
    return f"{owner}: {conventions[owner]}" if owner else ""


def _builds(module: cst.Module, owner: str, decoder: str) -> bool:
    for cls in m.findall(module, m.ClassDef(name=m.Name(owner))):
        if m.findall(cls, m.Call(func=m.Name(decoder))):
            return True
    return False
