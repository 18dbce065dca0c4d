"""Load-time verifier: refuse, before any weight is read, what cannot run aux capture over PP.

Support is decided on the class itself, never by an inherited flag:

* a spec or the decorator names the class (and does not say ``supported = false``), or the class
  carries ``supports_aux_hidden_states_over_pp = True`` in its *own* ``__dict__`` (generated code);
* or it inherits from such a class **and neither it nor any class in between defines ``forward``**.

So a MiMo-style subclass of Qwen2 that brings its own forward is rejected with no manual entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipespec.contract.embed import METHODS_NEEDING_TARGET_EMBED
from pipespec.contract.layout import LayoutPlan, plan_layout
from pipespec.contract.names import AUX_OVER_PP_FLAG, SPEC_ATTR
from pipespec.contract.registry import Registry, class_path, default_registry
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import LayoutError, UnsupportedModelError, UsageError

METHODS = tuple(sorted(METHODS_NEEDING_TARGET_EMBED))
FORWARD_METHODS = ("forward",)


@dataclass(frozen=True)
class RegisteredSupport:
    """Why pipespec's runtime may run a class: the class whose registration (spec, decorator or generated
    flag) carries support, and the spec (if any) behind it. Not vLLM's readiness check
    (``integrations.vllm.readiness``), which judges a vLLM class as released."""

    cls: type
    supported_by: type
    spec: AdapterSpec | None


def _fail(cls: type, method: str, reason: str, fix: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"`{cls.__name__}` does not support {method} with pipeline parallelism: {reason}. {fix}")


def _spec_of(klass: type, registry: Registry) -> AdapterSpec | None:
    entry = registry.entry_for_class(klass)
    if entry is not None:
        return entry.spec
    own = klass.__dict__.get(SPEC_ATTR)
    return own if isinstance(own, AdapterSpec) else None


def find_registered_support(cls: type, method: str = "eagle3", registry: Registry | None = None) -> RegisteredSupport:
    """Resolve support for ``cls`` or raise ``UnsupportedModelError`` saying why and what to do."""
    registry = registry or default_registry()
    for depth, klass in enumerate(cls.__mro__):
        spec = _spec_of(klass, registry)
        marked = klass.__dict__.get(AUX_OVER_PP_FLAG) is True
        if spec is None and not marked:
            continue
        if spec is not None and not spec.supported and not marked:
            reason = spec.reason.rstrip(".")
            if klass is not cls:
                reason = f"its parent `{klass.__name__}` is marked unsupported in {spec.source} ({reason})"
            raise _fail(cls, method, reason, f"Adapt it with `adapter-gen <file> --class {cls.__name__}` and register the result")
        overriders = [k for k in cls.__mro__[:depth] if any(m in k.__dict__ for m in FORWARD_METHODS)]
        if overriders:
            sub = overriders[0]
            raise _fail(
                cls,
                method,
                f"`{sub.__name__}` overrides forward, so the aux-state handling of its supported parent "
                f"`{klass.__name__}` does not run",
                f"Adapt its forward: `adapter-gen {sub.__module__.replace('.', '/')}.py --class {sub.__name__}` "
                "(or `pipespec.adapt(cls)` at load), or register it with @pipespec.adapter once its forward "
                "collects and packs aux states",
            )
        return RegisteredSupport(cls=cls, supported_by=klass, spec=spec)
    raise _fail(
        cls,
        method,
        f"no adapter spec or @pipespec.adapter names `{class_path(cls)}` or a parent class",
        "Write one: `adapter-gen new <model_type>` scaffolds adapters/<model_type>.toml",
    )


def verify_supports_aux_hidden_states_over_pp(
    model_or_class: object,
    method: str = "eagle3",
    layout: LayoutPlan | None = None,
    registry: Registry | None = None,
) -> RegisteredSupport:
    """Check a model (instance or class) can run ``method`` under ``layout``; return why it can.

    Raises ``UnsupportedModelError`` (class not supported), ``LayoutError`` (boundary rule, ids out of
    range for this model's N) or ``UsageError`` (unknown method).
    """
    if method not in METHODS:
        raise UsageError(f"speculative method {method!r} is unknown: use one of {', '.join(METHODS)}")
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    support = find_registered_support(cls, method, registry)
    if layout is None:
        return support
    spec = support.spec
    num_layers_key = spec.num_layers_key if spec else "num_hidden_layers"
    config = getattr(model_or_class, "config", None) if not isinstance(model_or_class, type) else None
    n = getattr(config, num_layers_key, None) if config is not None else None
    if n is not None and int(n) != layout.num_layers:
        raise LayoutError(
            f"`{cls.__name__}` has {n} layers ({num_layers_key}) but the layout was planned for {layout.num_layers}: "
            "plan the layout with the model's own layer count"
        )
    rule = spec.boundary_rule if spec else "allow"
    if rule != "allow" and layout.boundary_rule != rule:
        try:
            plan_layout(layout.num_layers, layout.pp_size, layout.aux_layers, layout.partition, boundary_rule=rule)
        except LayoutError as exc:
            raise LayoutError(f"`{cls.__name__}` ({spec.source if spec else ''}): {exc}") from None
    return support
