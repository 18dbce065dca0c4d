"""The classes that hold a PP decoder (``*ForCausalLM``, a wrapper between them, a multimodal model
around the causal LM) and their rewrite to vLLM's ``SupportsEagle3``: what vLLM's protocol defaults and
its drafter cannot find on their own. Imports no vLLM; the decoder's own rewrite is vllm_native_decoder."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.vllm_forward_shape import is_docstring, names_in, self_attr
from pipespec.codemods.vllm_native_loop import methods
from pipespec.codemods.vllm_native_names import DRAFTER_EMBEDS, source_of
from pipespec.codemods.vllm_native_qualified import UNBOUND, VllmNames
from pipespec.contract.names import VLLM_EAGLE3_INTERFACE


@dataclass(frozen=True)
class Holder:
    cls: cst.ClassDef
    attr: str  # "model", or "model.decoder" through a wrapper
    wrapper: cst.ClassDef | None = None  # the plain class between them (OPTModel), if any
    wrapper_attr: str = ""  # the wrapper's attribute holding the decoder ("decoder")
    multimodal: bool = False  # a SupportsMultiModal class holding the causal LM as language_model
    supports_multimodal: bool = False  # the class implements vLLM's SupportsMultiModal (is_multimodal)



def find_holders(top: list[cst.ClassDef], decoder: str, names: VllmNames = UNBOUND) -> list[Holder]:
    """Top-level causal LMs that build ``decoder`` into ``self.<attr>`` (directly or via one of their
    methods), or into ``self.<attr>.<inner>`` through one plain wrapper class of the file whose forward
    only returns ``self.<inner>(...)`` (OPTForCausalLM.model -> OPTModel.decoder -> OPTDecoder)."""
    out = []
    used = _class_names(top)
    mentions = [c for c in top if c.name.value != decoder and decoder in used[c]]
    wrappers = [(w, inner[0]) for w in mentions if not is_generative(w)
                for inner in [built_attrs(w, decoder)] if inner and forwards_to(w, inner[0])]
    for cls in top:
        if cls.name.value == decoder or not is_generative(cls):
            continue
        attrs = built_attrs(cls, decoder) if any(cls is c for c in mentions) else []
        if attrs:
            out.append(Holder(cls, attrs[0], supports_multimodal=is_multimodal(cls, names)))
            continue
        for wrapper, inner_attr in wrappers:
            if wrapper is cls:
                continue
            inner = [inner_attr]
            outer = built_attrs(cls, wrapper.name.value)
            if outer:
                out.append(Holder(cls, f"{outer[0]}.{inner[0]}", wrapper, inner[0],
                                  supports_multimodal=is_multimodal(cls, names)))
                break
    return out + multimodal_holders(top, out, names)


_NAMES_OF: list[tuple[tuple[cst.ClassDef, ...], dict[cst.ClassDef, set[str]]]] = []  # the last file's classes and their names


def _class_names(top: list[cst.ClassDef]) -> dict[cst.ClassDef, set[str]]:
    """The identifiers used in each class (keyed by the node), one walk per class per file: a file's decoders
    and its multimodal classes all ask about the same classes."""
    key = tuple(top)
    if not _NAMES_OF or len(_NAMES_OF[0][0]) != len(key) or any(a is not b for a, b in zip(_NAMES_OF[0][0], key)):
        _NAMES_OF[:] = [(key, {c: names_in(c) for c in top})]
    return _NAMES_OF[0][1]


def multimodal_holders(top: list[cst.ClassDef], direct: list[Holder], names: VllmNames = UNBOUND) -> list[Holder]:
    """Multimodal classes of the file that build a causal LM holding the decoder as their language model
    (MossAudioModel.language_model = MossQwen3ForCausalLM(...)): the class vLLM's registry builds. vLLM's
    ``SupportsEagle3`` defaults reach the decoder through ``get_language_model().model`` and its drafter
    takes the embedding from ``get_language_model()``, so such a class needs only the base."""
    held = {h.cls.name.value: h for h in direct if h.attr == "model"}
    out = []
    for cls in top:
        if cls.name.value in held or any(cls is h.cls for h in direct) or not is_multimodal(cls, names):
            continue
        for name, inner in held.items():
            if name in _class_names(top)[cls] and "language_model" in built_attrs(cls, name):
                out.append(Holder(cls, f"language_model.{inner.attr}", multimodal=True, supports_multimodal=True))
                break
    return out


def is_multimodal(cls: cst.ClassDef, names: VllmNames = UNBOUND) -> bool:
    """``cls`` implements vLLM's ``SupportsMultiModal`` (whose ``get_language_model`` finds the text model)."""
    return names.has_base(cls, "SupportsMultiModal") or "get_language_model" in methods(cls)


def forwards_to(cls: cst.ClassDef, attr: str) -> bool:
    """``forward`` is one ``return self.<attr>(...)`` (after a docstring): the wrapped decoder's result,
    aux states included, is what the wrapper returns."""
    forward = methods(cls).get("forward")
    if forward is None or not isinstance(forward.body, cst.IndentedBlock):
        return False
    body = [s for s in forward.body.body if not is_docstring(s)]
    return len(body) == 1 and m.matches(body[0], m.SimpleStatementLine(body=[m.Return(m.Call(func=self_attr(attr)))]))


def built_attrs(cls: cst.ClassDef, decoder: str) -> list[str]:
    """Attributes ``self.<attr>`` that ``cls`` assigns a ``decoder(...)`` to: called by name, through an
    ``__init__`` parameter defaulting to it (``model_type: type[X] = X``), a method returning one, or a
    class attribute ``model_cls = decoder``."""
    own = methods(cls)
    init = own.get("__init__")
    aliases = [decoder]
    if init is not None:
        p = init.params
        aliases += [x.name.value for x in (*p.params, *p.kwonly_params) if m.matches(x.default, m.Name(decoder))]
    built = m.Call(func=m.OneOf(*(m.Name(a) for a in aliases)))

    def assigned(value: m.BaseMatcherNode) -> list[str]:
        return [cst.ensure_type(cst.ensure_type(a, cst.Assign).targets[0].target, cst.Attribute).attr.value
                for a in m.findall(cls, m.Assign(targets=[m.AssignTarget(self_attr())], value=value))]

    attrs = assigned(built)
    if not attrs:
        makers = {n for n, fn in own.items() if m.findall(fn, m.Return(built))}
        if makers:
            attrs = assigned(m.Call(func=m.Attribute(value=m.Name("self"), attr=m.OneOf(*(m.Name(n) for n in makers)))))
            if not attrs and "_init_model" in makers:  # vLLM's LlamaForCausalLM assigns self.model from it
                attrs = ["model"]
    if not attrs:  # `model_cls = Decoder` on a subclass whose base builds self.model = self.model_cls(...)
        body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
        refs = [cst.ensure_type(cst.ensure_type(s.body[0], cst.Assign).targets[0].target, cst.Name).value for s in body
                if m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Name(decoder))]))]
        for ref in refs:
            found = assigned(m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(ref))))
            attrs += found or (["model"] if ref == "model_cls" else [])
    return attrs


def is_generative(cls: cst.ClassDef) -> bool:
    """A model an EAGLE3 drafter can target: a causal LM (pooling/classification heads are not)."""
    name = cls.name.value
    if any(word in name for word in ("Classification", "Embedding", "Reward", "Pooling", "QuestionAnswering")):
        return False
    return name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) or "compute_logits" in methods(cls)



def adapt_holder(cls: cst.ClassDef, attr: str, layers_attr: str, bases_ready: bool,
                  module_type: str, multimodal: bool = False, names: VllmNames = UNBOUND) -> tuple[cst.ClassDef, set[str]]:
    """``SupportsEagle3`` and what vLLM's protocol defaults cannot find on their own (a multimodal holder
    of the causal LM needs only the base: the defaults go through ``get_language_model().model``)."""
    imports: set[str] = set()
    own = methods(cls)
    body = list(cst.ensure_type(cls.body, cst.IndentedBlock).body)
    setter = own.get("set_aux_hidden_state_layers")
    if setter is not None:  # a PP=1-only setter writes the tuple directly and skips the stage's slot base
        direct = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Attribute(
            value=m.Attribute(value=m.Name("self")), attr=m.Name("aux_hidden_state_layers")))])])
        new_setter = setter.visit(_SetterFix(direct))
        body = [new_setter if s is setter else s for s in body]  # type: ignore[misc]
    redirect = not multimodal and (attr != "model" or "get_language_model" in own or "language_model" in names_in(cls))
    assigns_model = bool(m.findall(cls, m.AssignTarget(self_attr("model")))) or "model" in own
    extra: list[str] = []
    if attr != "model" and not assigns_model and not multimodal:
        extra.append(f"@property\ndef model(self) -> {module_type}:\n"
                     "    # vLLM's EAGLE drafter reads the target's input embedding through .model\n"
                     f"    return self.{attr}\n")
    if redirect and setter is None:
        extra.append("def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:\n"
                     f"    self.{attr}._set_aux_hidden_state_layers(layers)\n")
    if (redirect or layers_attr != "layers") and "get_eagle3_default_aux_hidden_state_layers" not in own:
        extra.append("def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:\n"
                     f"    num_layers = len(self.{attr}.{layers_attr})\n"
                     "    return (2, num_layers // 2, num_layers - 3)\n")
    for text in extra:
        body.append(cst.parse_statement(text).with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
    bases = list(cls.bases)
    if not names.has_base(cls, VLLM_EAGLE3_INTERFACE) and not bases_ready:
        imports.add(VLLM_EAGLE3_INTERFACE)
        if bases:
            bases[-1] = bases[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        bases.append(cst.Arg(cst.Name(VLLM_EAGLE3_INTERFACE)))
    if bases == list(cls.bases) and body == list(cst.ensure_type(cls.body, cst.IndentedBlock).body):
        return cls, imports
    multiline = any(isinstance(a.comma, cst.Comma) and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace)
                    for a in cls.bases)
    if multiline and len(bases) > len(cls.bases):
        indent = cst.ensure_type(cls.bases[0].comma, cst.Comma).whitespace_after if isinstance(cls.bases[0].comma, cst.Comma) else None
        old_last = cls.bases[-1]
        bases[-2] = old_last.with_changes(comma=cst.Comma(whitespace_after=indent) if indent else old_last.comma)
        bases[-1] = bases[-1].with_changes(comma=old_last.comma)
    return cls.with_changes(bases=bases, lpar=cls.lpar or cst.LeftParen(), rpar=cls.rpar or cst.RightParen(),
                            body=cls.body.with_changes(body=body)), imports


def has_attr(cls: cst.ClassDef, name: str) -> bool:
    """``cls`` binds ``self.<name>`` (assigned or annotated) or defines a method/property of that name."""
    return name in methods(cls) or bool(m.findall(cls, m.AssignTarget(self_attr(name)) | m.AnnAssign(target=self_attr(name))))


def share_embed(wrapper: cst.ClassDef, inner: str, decoder: cst.ClassDef, module_type: str) -> cst.ClassDef:
    """The wrapper between a causal LM and its decoder (OPTModel) is what vLLM's drafter reads as
    ``target.model``: give it the decoder's input embedding as ``embed_tokens``, a property, so the module
    is not registered twice (that would break weight loading)."""
    if any(has_attr(wrapper, n) for n in DRAFTER_EMBEDS):
        return wrapper
    embed = next((n for n in DRAFTER_EMBEDS if has_attr(decoder, n)), None)
    if embed is None:
        return wrapper
    prop = cst.parse_statement(
        "@property\n"
        f"def embed_tokens(self) -> {module_type}:\n"
        "    # vLLM's EAGLE drafter shares the target's input embedding as .model.embed_tokens\n"
        f"    return self.{inner}.{embed}\n").with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    body = list(cst.ensure_type(wrapper.body, cst.IndentedBlock).body)
    at = next((i for i, st in enumerate(body) if isinstance(st, cst.FunctionDef) and st.name.value == "forward"), len(body))
    body.insert(at, prop)
    return wrapper.with_changes(body=wrapper.body.with_changes(body=body))


class _SetterFix(cst.CSTTransformer):
    def __init__(self, direct: m.BaseMatcherNode) -> None:
        self.direct = direct

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine,
                                  updated_node: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
        if not m.matches(original_node, self.direct):
            return updated_node
        assign = cst.ensure_type(original_node.body[0], cst.Assign)
        owner = cst.ensure_type(assign.targets[0].target, cst.Attribute).value
        call = f"{source_of(owner)}._set_aux_hidden_state_layers({source_of(assign.value)})\n"
        return cst.ensure_type(cst.parse_statement(call), cst.SimpleStatementLine).with_changes(
            leading_lines=original_node.leading_lines)
