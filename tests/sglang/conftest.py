"""Tests against real SGLang on CPU (``make test-sglang`` runs them in ``.venv-sglang``).

They never skip for a missing SGLang: a suite that passes without the engine it tests proves nothing.
``standins/`` (sgl_kernel and torchvision, which have no CPU build, and the test-only aux recorder plugin) is
put on ``sys.path`` here and on ``PYTHONPATH`` for every SGLang process the tests start (``harness``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

STANDINS = str(Path(__file__).resolve().parent / "standins")
if STANDINS not in sys.path:
    sys.path.insert(0, STANDINS)
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

try:
    import sglang  # noqa: F401
except ImportError as exc:  # pragma: no cover - the wrong venv
    raise pytest.UsageError(
        f"tests/sglang need SGLang 0.5.23 ({exc}); run them with `make test-sglang` (it creates .venv-sglang)"
    ) from exc
