"""pipespec: EAGLE3-style speculative decoding under pipeline parallelism, correct by construction.

Layers, bottom up: ``spec`` → ``layout`` → ``mixin`` / ``verify`` / ``registry`` → ``codemods`` and
``pp`` → ``engine`` → ``cli``. See docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AdapterSpec",
    "AuxHiddenStatesMixin",
    "IntermediateTensors",
    "LayoutPlan",
    "StagePlan",
    "adapt",
    "adapter",
    "lookup",
    "maybe_share_target_embed",
    "plan_layout",
    "spec_decode_needs_target_embed",
    "verify_supports_aux_hidden_states_over_pp",
]

# Lazy attribute map: `import pipespec` stays cheap (no torch) for CLI commands that need none.
_EXPORTS = {
    "AdapterSpec": "pipespec.spec",
    "AuxHiddenStatesMixin": "pipespec.mixin",
    "IntermediateTensors": "pipespec.intermediate",
    "LayoutPlan": "pipespec.layout",
    "StagePlan": "pipespec.layout",
    "plan_layout": "pipespec.layout",
    "adapt": "pipespec.adapt",
    "adapter": "pipespec.decorator",
    "lookup": "pipespec.registry",
    "maybe_share_target_embed": "pipespec.embed",
    "spec_decode_needs_target_embed": "pipespec.embed",
    "verify_supports_aux_hidden_states_over_pp": "pipespec.verify",
}

if TYPE_CHECKING:
    from pipespec.adapt import adapt
    from pipespec.decorator import adapter
    from pipespec.embed import maybe_share_target_embed, spec_decode_needs_target_embed
    from pipespec.intermediate import IntermediateTensors
    from pipespec.layout import LayoutPlan, StagePlan, plan_layout
    from pipespec.mixin import AuxHiddenStatesMixin
    from pipespec.registry import lookup
    from pipespec.spec import AdapterSpec
    from pipespec.verify import verify_supports_aux_hidden_states_over_pp


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipespec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
