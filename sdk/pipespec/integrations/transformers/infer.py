"""Infer an adapter spec from an HF decoder class's source, for classes no spec names.

``pipespec.adapt`` uses it when the registry has nothing for a class; ``adapter-gen new`` and the zoo
use it to scaffold and to run every causal-LM type of the installed transformers. It reads source with
libcst (``pipespec.codemods.hf_forward_shape``) and never imports or runs what it reads; only
``decoder_class_for_model_type`` imports the (installed, trusted) transformers classes it looks up.

    >>> spec = infer_spec(transformers.GPT2Model, "gpt2")          # doctest: +SKIP
    >>> spec.layers_attr, spec.embed_attr, spec.norm_attr
    ('h', 'wte', 'ln_f')
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import textwrap

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.hf_decline import AlreadyStageAware, ShapeError
from pipespec.codemods.hf_forward_shape import LAYER_COUNT_KEYS, analyze_forward, find_forward, rotary_attrs
from pipespec.codemods.hf_names import dotted, walk
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import UnsupportedModelError, UsageError

_MODEL_TYPE = re.compile(r"[a-z0-9_\-]+")


@functools.lru_cache(maxsize=512)
def class_source(cls: type) -> tuple[str, int]:
    """(source text, first line number) of ``cls``; cached, since ``inspect`` re-parses the whole module
    file to find a class and the runtime path asks once for the spec and once for the codemod."""
    lines, first_line = inspect.getsourcelines(cls)
    return "".join(lines), first_line


def forward_owner(cls: type) -> type:
    """The class in ``cls``'s MRO whose own ``__dict__`` defines ``forward`` (the code to adapt)."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return klass
    raise UnsupportedModelError(f"`{cls.__name__}` has no forward method to adapt")


def _class_def(source: str, class_name: str | None) -> cst.ClassDef:
    module = cst.parse_module(textwrap.dedent(source))
    classes = [n for n in walk(module, into_functions=True) if isinstance(n, cst.ClassDef)]
    if class_name is not None:
        classes = [c for c in classes if c.name.value == class_name]
    else:
        classes = [c for c in classes if find_forward(c) is not None]
    if len(classes) != 1:
        which = f"class {class_name}" if class_name else "one class with a forward"
        raise UsageError(f"expected {which} in the source, found {len(classes)}: pass class_name")
    return classes[0]


def _layer_count_key_from_init(cls_node: cst.ClassDef, layers_attr: str) -> str | None:
    """``config.K`` in ``self.<layers> = nn.ModuleList([... for i in range(config.K)])`` of ``__init__``."""
    for stmt in cls_node.body.body:
        if not (isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__"):
            continue
        for n in walk(stmt):
            if not isinstance(n, cst.Assign) or len(n.targets) != 1:
                continue
            if dotted(n.targets[0].target) != f"self.{layers_attr}":
                continue
            for call in walk(n.value):
                if isinstance(call, cst.Call) and m.matches(call.func, m.Name("range")) and call.args:
                    bound = dotted(call.args[-1].value if len(call.args) == 1 else call.args[1].value) or ""
                    if bound.startswith("config.") or bound.startswith("self.config."):
                        return bound.rsplit(".", 1)[-1]
    return None


def _spec_name(model_type: str | None, class_name: str) -> str:
    if model_type:
        return re.sub(r"\W", "_", model_type)
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()
    return re.sub(r"\W", "_", snake)


def infer_spec(
    cls_or_source: type | str,
    model_type: str | None = None,
    *,
    class_name: str | None = None,
    module: str | None = None,
) -> AdapterSpec:
    """Detect layer list, final norm, embedding, residual style and layer-count key of a decoder class.

    ``cls_or_source`` is the class or its source text (then ``class_name`` picks the class when the
    text has several, and ``module`` names its module for ``decoder_class``). A class whose forward
    cannot be adapted gets ``supported = False`` with the specific reason, so callers can report or
    scaffold it; nothing here raises for an unadaptable shape.
    """
    if isinstance(cls_or_source, type):
        owner = forward_owner(cls_or_source)
        source, _ = class_source(owner)
        decoder_class = f"{cls_or_source.__module__}:{cls_or_source.__name__}"
        node = _class_def(source, owner.__name__)
        shown = cls_or_source.__name__
    else:
        node = _class_def(cls_or_source, class_name)
        shown = node.name.value
        decoder_class = f"{module or 'source'}:{shown}"
    architectures: tuple[str, ...] = ()
    if model_type is not None:
        arch = _causal_lm_names().get(model_type)
        if isinstance(arch, str) and arch.isidentifier():
            architectures = (arch,)
    fields: dict[str, object] = {
        "name": _spec_name(model_type, shown),
        "decoder_class": decoder_class,
        "architectures": architectures,
        "model_types": (model_type,) if model_type and _MODEL_TYPE.fullmatch(model_type) else (),
        "dialect": "hf",
        "source": f"inferred from {decoder_class}",
    }
    func = find_forward(node)
    try:
        if func is None:
            raise ShapeError(f"{shown} does not define forward")
        shape = analyze_forward(func, shape_only_attrs=rotary_attrs(node))
    except AlreadyStageAware:
        return AdapterSpec(
            supported=False,
            reason=f"{shown}.forward already takes intermediate_tensors: a hand-written pipeline forward",
            **fields,  # type: ignore[arg-type]
        )
    except ShapeError as exc:
        return AdapterSpec(supported=False, reason=f"{shown}.forward: {exc}", **fields)  # type: ignore[arg-type]
    key = shape.loop.num_layers_key or _layer_count_key_from_init(node, shape.loop.layers_attr) or "num_hidden_layers"
    if key not in LAYER_COUNT_KEYS and not key.isidentifier():
        key = "num_hidden_layers"
    return AdapterSpec(
        layers_attr=shape.loop.layers_attr,
        norm_attr=shape.norm_attr or "norm",
        embed_attr=shape.embed_attr,
        residual=shape.residual,
        capture="hidden + residual" if shape.residual else "hidden",
        num_layers_key=key,
        **fields,  # type: ignore[arg-type]
    )


def _causal_lm_names() -> dict[str, object]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_class_for_model_type(model_type: str) -> type:
    """The installed transformers causal-LM class for ``model_type`` (``"llama"`` → ``LlamaForCausalLM``)."""
    name = _causal_lm_names().get(model_type)
    if not isinstance(name, str):
        raise UsageError(
            f"model type {model_type!r} has no causal-LM class in the installed transformers "
            "(see transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
        )
    transformers = importlib.import_module("transformers")
    try:
        return getattr(transformers, name)  # type: ignore[no-any-return]
    except (AttributeError, ImportError) as exc:
        raise UnsupportedModelError(f"transformers cannot import {name} for model type {model_type!r}: {exc}") from None


def _assigned_class(klass: type, attr: str) -> type | None:
    """The class ``klass.__init__`` instantiates into ``self.<attr>`` (``self.decoder = BartDecoder(config)``)."""
    init = klass.__dict__.get("__init__")
    if init is None:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(init))
    except (OSError, TypeError):
        return None
    module = importlib.import_module(klass.__module__)
    for n in walk(cst.parse_module(source), into_functions=True):
        if isinstance(n, cst.Assign) and len(n.targets) == 1 and dotted(n.targets[0].target) == f"self.{attr}":
            if isinstance(n.value, cst.Call):
                name = dotted(n.value.func)
                found = getattr(module, name, None) if name and "." not in name else None
                if isinstance(found, type):
                    return found
    return None


def _runs_self_decoder_without_loop(func: cst.FunctionDef) -> bool:
    """``forward`` calls ``self.decoder(...)`` and runs no loop of its own (``OPTModel``)."""
    calls_decoder = any(isinstance(n, cst.Call) and dotted(n.func) == "self.decoder" for n in walk(func))
    return calls_decoder and not any(isinstance(n, cst.For) for n in walk(func))


def follow_delegate(cls: type) -> type:
    """For a wrapper that only runs another module, the class of that module (where the layers are).

    transformers' ``BartDecoderWrapper`` & co. (``return self.decoder(*args, **kwargs)``) exist only to
    hold the real decoder under a name; ``OPTModel``'s forward runs ``self.decoder(...)`` and nothing
    else of the stack (``OPTForCausalLM`` even calls ``self.model.decoder`` directly). The layers, and
    the forward to adapt, are in the wrapped class.
    """
    owner = forward_owner(cls)
    try:
        source = textwrap.dedent(inspect.getsource(owner.__dict__["forward"]))
    except (OSError, TypeError):
        return cls
    func = next((n for n in walk(cst.parse_module(source), into_functions=True) if isinstance(n, cst.FunctionDef)), None)
    if func is None or not isinstance(func.body, cst.IndentedBlock):
        return cls
    body = [s for s in func.body.body if not m.matches(s, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))]
    pattern = m.SimpleStatementLine(
        body=[m.Return(value=m.Call(func=m.Attribute(value=m.Name("self")), args=[m.Arg(star="*"), m.Arg(star="**")]))]
    )
    if len(body) == 1 and m.matches(body[0], pattern):
        attr = body[0].body[0].value.func.attr.value  # type: ignore[attr-defined]
    elif _runs_self_decoder_without_loop(func):
        attr = "decoder"
    else:
        return cls
    for klass in cls.__mro__:
        found = _assigned_class(klass, attr)
        if found is not None:
            return found
    return cls


def decoder_class_for_model_type(model_type: str) -> type:
    """The decoder-stack class a causal LM of ``model_type`` wraps (``"llama"`` → ``LlamaModel``).

    Read from the causal-LM class's ``__init__``: ``self.<base_model_prefix> = <Decoder>(config)``, the
    name resolved in that class's module; else ``MODEL_MAPPING_NAMES[model_type]``. A wrapper that only
    delegates (``BartDecoderWrapper``) is followed to the class it wraps.
    """
    lm_cls = causal_lm_class_for_model_type(model_type)
    prefix = getattr(lm_cls, "base_model_prefix", "model") or "model"
    for klass in lm_cls.__mro__:
        if "__init__" in klass.__dict__ and not klass.__module__.startswith("torch"):
            found = _assigned_class(klass, prefix)
            if found is not None:
                return follow_delegate(found)
            break
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(model_type)
    transformers = importlib.import_module("transformers")
    found = getattr(transformers, base, None) if isinstance(base, str) else None
    if isinstance(found, type):
        return follow_delegate(found)
    raise UnsupportedModelError(
        f"cannot find the decoder class of {lm_cls.__name__} (model type {model_type!r}): its __init__ does not "
        f"assign self.{prefix} = <DecoderClass>(config) and MODEL_MAPPING_NAMES has no entry"
    )
