"""The zoo: pipespec's adaptation checked against every causal-LM type of the installed transformers.

``tiny`` builds a tiny random float32 model per type; ``runner`` adapts its decoder, runs it as P
in-process stages and compares with the unadapted model. ``pipespec zoo`` is the command; its
``--write-coverage`` report is docs/coverage.md.
"""

from __future__ import annotations

from pipespec.integrations.transformers.zoo.runner import REL_TOL, SHAPES, ZooResult, run_type, run_zoo
from pipespec.integrations.transformers.zoo.tiny import (
    TinyBuildError,
    TinyModel,
    build_tiny_model,
    causal_lm_model_types,
    tiny_config,
)

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
