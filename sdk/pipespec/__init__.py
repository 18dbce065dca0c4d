"""pipespec: EAGLE3-style speculative decoding under pipeline parallelism, correct by construction.

Three parts, bottom up: ``contract`` (spec → layout → intermediate → mixin / verify / registry),
``integrations`` (``transformers``, ``vllm``; the libcst ``codemods`` both use), and the reference
``engine`` on the ``pp`` runtime; ``codegen`` and ``cli`` on top. See docs/architecture.md.
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
    "AdapterSpec": "pipespec.contract.spec",
    "AuxHiddenStatesMixin": "pipespec.contract.mixin",
    "IntermediateTensors": "pipespec.contract.intermediate",
    "LayoutPlan": "pipespec.contract.layout",
    "StagePlan": "pipespec.contract.layout",
    "plan_layout": "pipespec.contract.layout",
    "adapt": "pipespec.integrations.transformers.adapt",
    "adapter": "pipespec.contract.decorator",
    "lookup": "pipespec.contract.registry",
    "maybe_share_target_embed": "pipespec.contract.embed",
    "spec_decode_needs_target_embed": "pipespec.contract.embed",
    "verify_supports_aux_hidden_states_over_pp": "pipespec.contract.verify",
}

if TYPE_CHECKING:
    from pipespec.contract.decorator import adapter
    from pipespec.contract.embed import maybe_share_target_embed, spec_decode_needs_target_embed
    from pipespec.contract.intermediate import IntermediateTensors
    from pipespec.contract.layout import LayoutPlan, StagePlan, plan_layout
    from pipespec.contract.mixin import AuxHiddenStatesMixin
    from pipespec.contract.registry import lookup
    from pipespec.contract.spec import AdapterSpec
    from pipespec.contract.verify import verify_supports_aux_hidden_states_over_pp
    from pipespec.integrations.transformers.adapt import adapt


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipespec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
