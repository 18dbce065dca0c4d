"""pipespec's SGLang plugin (entry point ``sglang.srt.plugins: pipespec``).

SGLang's ``load_plugins()`` calls ``register()`` in the engine and in every scheduler process, before the
server arguments are checked and before any model is built. It reads ``PIPESPEC_SGLANG`` (``on`` by default;
``off`` makes it a no-op, so SGLang's own guards refuse EAGLE3 aux states under PP; anything else is an error)
and registers the hooks listed in ``patches.py``. What happens at engine load is ``adapt_at_load``.

Must stay cheap and import nothing of SGLang's model code: SGLang loads plugins in every process. SGLang logs
and swallows an exception raised here, so refusals happen in the hooks, where they stop the run.
"""

from __future__ import annotations

import os

from pipespec.env import env_flag

SWITCH = "PIPESPEC_SGLANG"


def enabled() -> bool:
    """``PIPESPEC_SGLANG``: unset → on; 1/on/true/yes → on; 0/off/false/no → off; anything else → UsageError."""
    if os.environ.get(SWITCH) is None or not os.environ[SWITCH].strip():
        return True
    return env_flag(SWITCH)


def register() -> None:
    """The entry point SGLang calls in every process (safe to call more than once)."""
    if not enabled():
        return
    from pipespec.integrations.sglang.patches import apply_patches

    apply_patches()
