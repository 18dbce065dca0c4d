"""``pipespec.adapt(cls)``: an HF decoder class whose forward runs one pipeline stage, built at load time.

The runtime twin of ``adapter-gen``: the same libcst codemod (``AdaptHFStageForwardCommand``) rewrites
the installed source in memory, then ONLY the transformed ``forward`` is compiled, in a copy of the
original module's globals plus ``IntermediateTensors``, inside ``class Adapted<Name>(cls,
AuxHiddenStatesMixin)``. Nothing else of the module is re-executed, and the codemod itself never runs
the code it reads. Results are cached: the same class and spec give the same class object.

Calling convention (what the engine does, one model instance per stage process)::

    Model = pipespec.adapt(LlamaModel)                  # or adapt(cls, spec)
    model = Model(config)                               # load only this stage's weights
    model.set_pipeline_stage(rank, pp_size, partition)  # which layers [start, end) it runs
    model.set_aux_hidden_state_layers(aux_ids)          # input-index ids, e.g. (2, N//2, N-3)
    cache = pipespec.integrations.transformers.stage_cache.new_stage_cache(model) # one per stage; size queries answer from
                                                        # this stage's own layers
    kw = {cache_kwarg_name(Model): cache}               # "cache" (5.24) or "past_key_values"
    out = model(
        input_ids=ids if rank == 0 else None,           # stage 0 only
        position_ids=positions,                         # absolute positions of these tokens
        use_cache=True,
        intermediate_tensors=received if rank > 0 else None,
        **kw,
    )

``out`` is an ``IntermediateTensors`` (``hidden_states`` + relayed + own ``aux_hidden_states_{slot}``)
on a non-last stage, to send on; on the last stage it is the model's own output object (final norm
applied), or ``(output, aux_list)`` when aux ids are set — ``aux_list`` in id order. Speculative
rollback: ``cache.crop(max_length)`` on every stage.
"""

from __future__ import annotations

import inspect
import linecache
import sys
import threading
from typing import Any

import libcst as cst
from libcst.codemod import CodemodContext, SkipFile

from pipespec.codemods.adapt_hf_stage_forward import AdaptHFStageForwardCommand, marker_text
from pipespec.codemods.hf_forward_shape import find_forward
from pipespec.codemods.hf_names import walk
from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.mixin import AuxHiddenStatesMixin
from pipespec.contract.names import (
    AUX_OVER_PP_FLAG,
    GENERATED_BY_ATTR,
    HAS_RESIDUAL_ATTR,
    NUM_LAYERS_KEY_ATTR,
    SPEC_ATTR,
)
from pipespec.contract.registry import default_registry
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import UnsupportedModelError
from pipespec.integrations.transformers.infer import class_source, forward_owner, infer_spec

__all__ = ["adapt", "cache_kwarg_name", "returned_cache", "spec_for_class"]

_CACHE: dict[tuple[type, AdapterSpec], type] = {}
_LOCK = threading.Lock()
_BASE = "__pipespec_base__"
_MIXIN = "__pipespec_mixin__"


def spec_for_class(cls: type) -> AdapterSpec:
    """The registry's spec for ``cls`` or its nearest ancestor; else one inferred from its source."""
    registry = default_registry()
    for klass in cls.__mro__:
        spec = registry.lookup(klass)
        if spec is not None:
            return spec
    return infer_spec(cls)


def cache_kwarg_name(cls: type) -> str:
    """The keyword the class's forward takes its KV cache under: ``"cache"`` (5.24) or ``"past_key_values"``."""
    params = inspect.signature(forward_owner(cls).__dict__["forward"]).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedModelError(f"`{cls.__name__}.forward` takes no cache argument (neither `cache` nor `past_key_values`)")


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned: ``output.cache`` (5.24) or ``output.past_key_values``; None when neither.

    Read under the name the output class declares: from 5.24 ``past_key_values`` is a property that logs
    a deprecation warning (and only aliases ``cache``), earlier 5.x releases have no ``cache``.
    """
    fields = getattr(output, "__dataclass_fields__", None)
    if fields is not None:
        name = next((n for n in ("cache", "past_key_values") if n in fields), None)
        return getattr(output, name) if name is not None else None
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def adapt(cls: type, spec: AdapterSpec | None = None) -> type:
    """Return ``Adapted<Name>(cls, AuxHiddenStatesMixin)`` with a stage-aware forward (cached).

    Raises ``UnsupportedModelError`` naming the class and the codemod's reason when the forward has a
    shape that cannot run as pipeline stages, or when the spec marks the class unsupported.
    """
    if cls.__dict__.get(AUX_OVER_PP_FLAG) is True:
        return cls  # generated by adapter-gen or decorated: already a stage model
    resolved = spec if spec is not None else spec_for_class(cls)
    key = (cls, resolved)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        try:
            adapted = _build(cls, resolved)
        except UnsupportedModelError:
            if spec is not None or _names_class(resolved, cls):
                raise
            # A spec inherited from an ancestor did not fit this class's own forward: infer one.
            inferred = infer_spec(cls)
            adapted = _build(cls, inferred)
            resolved = inferred
        _CACHE[key] = adapted
        _CACHE[(cls, resolved)] = adapted
        return adapted


def _names_class(spec: AdapterSpec, cls: type) -> bool:
    owner = forward_owner(cls)
    return spec.decoder_class in {f"{k.__module__}:{k.__name__}" for k in (cls, owner)}


def _build(cls: type, spec: AdapterSpec) -> type:
    if not spec.supported:
        raise UnsupportedModelError(f"`{cls.__name__}` cannot run as pipeline stages: {spec.reason}")
    owner = forward_owner(cls)
    module = sys.modules[owner.__module__]
    text, first_line = class_source(owner)
    # Pad with blank lines so positions in codemod messages are the real file's line numbers.
    source = "\n" * (first_line - 1) + text
    origin = f"{owner.__module__}:{owner.__qualname__}"
    context = CodemodContext(full_module_name=owner.__module__, filename=inspect.getsourcefile(owner))
    command = AdaptHFStageForwardCommand(context, owner.__name__, spec, source=origin, add_imports=False)
    try:
        tree = command.transform_module(cst.parse_module(source))
    except SkipFile as exc:
        raise UnsupportedModelError(f"`{cls.__name__}` cannot run as pipeline stages: {exc}") from None
    class_node = next(n for n in walk(tree, into_functions=True) if isinstance(n, cst.ClassDef) and n.name.value == owner.__name__)
    forward = find_forward(class_node)
    assert forward is not None
    name = f"Adapted{cls.__name__}"
    stub = cst.ClassDef(
        name=cst.Name(name),
        bases=[cst.Arg(cst.Name(_BASE)), cst.Arg(cst.Name(_MIXIN))],
        body=cst.IndentedBlock(body=[forward]),
    )
    code = cst.Module(body=[stub]).code
    filename = f"<pipespec adapted {origin}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = dict(vars(module))
    namespace.update({_BASE: cls, _MIXIN: AuxHiddenStatesMixin, "IntermediateTensors": IntermediateTensors})
    exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - the installed class's own forward, rewritten
    adapted: type = namespace[name]
    adapted.__qualname__ = name
    adapted.__module__ = cls.__module__
    adapted.__doc__ = (
        f"{cls.__name__} adapted for pipeline stages by pipespec ({marker_text(origin, spec)}). "
        "See pipespec.adapt for the calling convention."
    )
    shape = command.shape
    assert shape is not None
    attrs = {
        AUX_OVER_PP_FLAG: True,
        SPEC_ATTR: spec,
        NUM_LAYERS_KEY_ATTR: shape.loop.num_layers_key or spec.num_layers_key,
        HAS_RESIDUAL_ATTR: False,
        "pipespec_cache_kwarg": shape.cache_kwarg,
        "pipespec_adapted_from": cls,
        GENERATED_BY_ATTR: marker_text(origin, spec),
    }
    for attr, value in attrs.items():
        setattr(adapted, attr, value)
    return adapted
