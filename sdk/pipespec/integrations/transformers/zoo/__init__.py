"""The zoo: pipespec's adaptation checked against every causal-LM type of the installed transformers.

``tiny`` builds a tiny random float32 model per type (``fixes``: what the generic recipe cannot express);
``check`` adapts one type's decoder, runs it as P in-process stages (``stages``) and compares
(``compare``) with the unadapted model (``reference``); ``runner`` runs every type; ``report`` is the
table and the ``--write-coverage`` report (docs/coverage.md); ``shapes`` labels each forward for it.
``pipespec zoo`` is the command. Nothing here imports vLLM.
"""

from __future__ import annotations

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
