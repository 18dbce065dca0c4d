"""pipespec's vLLM general plugin (entry point ``vllm.general_plugins: pipespec``).

vLLM calls ``register()`` in the front-end, the engine core and every worker, before any model is built.
It reads ``PIPESPEC_VLLM`` (``on`` by default; ``off`` turns the plugin into a no-op; anything else is an
error), gates the installed vLLM and chooses its release rules (``compat.load``: a tested release runs, a
newer one whose contract is intact runs with one warning line, any other is refused in one line), installs
the adapted-module finder (so the adapted ``module:Class`` vLLM registers resolves in every process) and
applies the patches listed in ``patches.py``. What happens at engine load is
``adapt_at_load.apply_to_engine_config``.

Must stay cheap and import nothing of vLLM's model code: vLLM loads plugins in every process.
"""

from __future__ import annotations

import os

from pipespec.env import env_flag

SWITCH = "PIPESPEC_VLLM"


def enabled() -> bool:
    """``PIPESPEC_VLLM``: unset → on; 1/on/true/yes → on; 0/off/false/no → off; anything else → UsageError."""
    if os.environ.get(SWITCH) is None or not os.environ[SWITCH].strip():
        return True
    return env_flag(SWITCH)


def register() -> None:
    """The entry point vLLM calls in every process (safe to call more than once)."""
    if not enabled():
        return
    from pipespec.integrations.vllm import compat
    from pipespec.integrations.vllm.adapted_modules import install_finder
    from pipespec.integrations.vllm.patches import apply_patches

    compat.load()
    install_finder()
    apply_patches()
