"""The zoo: pipespec's adaptation checked against every causal-LM type of the installed transformers.

``tiny`` builds a tiny random float32 model per type (``fixes``: what the generic recipe cannot express);
``check`` adapts one type's decoder, runs it as P in-process stages (``stages``) and compares
(``compare``) with the unadapted model (``reference``); ``runner`` runs every type; ``report`` is the
table and the ``--write-coverage`` report (docs/coverage.md); ``shapes`` labels each forward for it.
``pipespec zoo`` is the command. Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipespec.integrations.transformers.zoo.check import ZooResult, run_type
    from pipespec.integrations.transformers.zoo.compare import REL_TOL
    from pipespec.integrations.transformers.zoo.runner import run_zoo
    from pipespec.integrations.transformers.zoo.shapes import SHAPES
    from pipespec.integrations.transformers.zoo.tiny import (
        TinyBuildError,
        TinyModel,
        build_tiny_model,
        causal_lm_model_types,
        tiny_config,
    )

# Imported on first use (PEP 562): the submodules import torch and transformers, and a caller that only
# needs the tiny sizes (``zoo.sizes``: ``adapter-gen new``'s scaffold) must not pay for them.
_EXPORTS = {
    "REL_TOL": "compare", "SHAPES": "shapes", "TinyBuildError": "tiny", "TinyModel": "tiny", "ZooResult": "check",
    "build_tiny_model": "tiny", "causal_lm_model_types": "tiny", "run_type": "check", "run_zoo": "runner",
    "tiny_config": "tiny",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "REL_TOL",
    "SHAPES",
    "TinyBuildError",
    "TinyModel",
    "ZooResult",
    "build_tiny_model",
    "causal_lm_model_types",
    "run_type",
    "run_zoo",
    "tiny_config",
]
