"""``@pipespec.adapter``: register a hand-written model class in code, no TOML file needed.

    @pipespec.adapter(architectures=["MyForCausalLM"], residual=True, capture="hidden + residual")
    class MyModel(AuxHiddenStatesMixin, nn.Module):
        ...

The class must inherit ``AuxHiddenStatesMixin`` (its forward calls collect/pack). The decorator marks
the class itself (``supports_aux_hidden_states_over_pp`` in its own ``__dict__``) and registers a spec
with the highest precedence (see ``pipespec.contract.registry``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pipespec.contract.mixin import AuxHiddenStatesMixin
from pipespec.contract.names import AUX_OVER_PP_FLAG, HAS_RESIDUAL_ATTR, NUM_LAYERS_KEY_ATTR, SPEC_ATTR
from pipespec.contract.registry import class_path, register_decorated
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import SpecError

T = TypeVar("T", bound=type)


def adapter(
    architectures: Sequence[str] = (),
    *,
    name: str | None = None,
    model_types: Sequence[str] = (),
    dialect: str = "pipespec",  # hand-written for pipespec's runtime (AuxHiddenStatesMixin), not vLLM's contract
    **fields: Any,
) -> Callable[[T], T]:
    """Register the decorated decoder class as supporting aux hidden states over PP."""

    def wrap(cls: T) -> T:
        if not issubclass(cls, AuxHiddenStatesMixin):
            raise SpecError(
                f"@pipespec.adapter on {cls.__name__}: the class must inherit pipespec.AuxHiddenStatesMixin "
                "so its forward can collect and pack aux hidden states"
            )
        spec = AdapterSpec(
            name=name or cls.__name__,
            decoder_class=class_path(cls),
            architectures=tuple(architectures),
            model_types=tuple(model_types),
            dialect=dialect,
            source=f"@pipespec.adapter on {cls.__module__}.{cls.__qualname__}",
            **fields,
        )
        setattr(cls, AUX_OVER_PP_FLAG, True)
        setattr(cls, SPEC_ATTR, spec)
        setattr(cls, NUM_LAYERS_KEY_ATTR, spec.num_layers_key)
        setattr(cls, HAS_RESIDUAL_ATTR, spec.residual)
        register_decorated(spec, cls)
        return cls

    return wrap
