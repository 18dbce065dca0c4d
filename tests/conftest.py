"""Shared test settings: hypothesis profile sized for 2-core CI."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread_per_stage() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one intra-op thread per stage process is by far the
    fastest (see pipespec.engine.stage.settings.stage_threads). Modules that start stages opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread_per_stage")``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPESPEC_THREADS", "1")
        yield
