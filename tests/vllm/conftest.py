"""Tests against the real vLLM CPU build (``make test-vllm`` runs them in ``.venv-vllm``).

They never skip for a missing vLLM: a suite that passes without the engine it tests proves nothing.
"""

from __future__ import annotations

import os

import pytest

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - the wrong venv
    raise pytest.UsageError(
        f"tests/vllm need vLLM's CPU build ({exc}); run them with `make test-vllm` (it creates .venv-vllm)"
    ) from exc

# Spawned vLLM workers on a 2-core machine: small KV cache, no CPU binding.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
