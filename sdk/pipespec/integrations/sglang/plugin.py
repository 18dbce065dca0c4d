"""pipespec's SGLang plugin (entry point ``sglang.srt.plugins: pipespec``).

SGLang's ``load_plugins()`` calls ``register()`` in the engine and in every scheduler process, before the
server arguments are checked and before any model is built. It reads ``PIPESPEC_SGLANG`` (``on`` by default;
``off`` makes it a no-op, so SGLang's own guards refuse EAGLE3 aux states under PP; anything else stops
every run at argument resolution with one line) and registers the hooks listed in ``patches.py``. What
happens at engine load is ``adapt_at_load``.

Must stay cheap and import nothing of SGLang's model code: SGLang loads plugins in every process. SGLang logs
and swallows an exception raised here, so refusals happen in the hooks, where they stop the run.
"""

from __future__ import annotations

import os
from typing import Any

from pipespec.env import env_flag
from pipespec.errors import UsageError

SWITCH = "PIPESPEC_SGLANG"


def enabled() -> bool:
    """``PIPESPEC_SGLANG``: unset → on; 1/on/true/yes → on; 0/off/false/no → off; anything else → UsageError."""
    if os.environ.get(SWITCH) is None or not os.environ[SWITCH].strip():
        return True
    return env_flag(SWITCH)


def register() -> None:
    """The entry point SGLang calls in every process (safe to call more than once)."""
    try:
        on = enabled()
    except UsageError as exc:  # SGLang would log and swallow it here: stop the run where it does not
        _refuse_runs(exc)
        return
    if not on:
        return
    from pipespec.integrations.sglang.patches import apply_patches

    apply_patches()


def _refuse_runs(error: UsageError) -> None:
    """A bad ``PIPESPEC_SGLANG`` stops the run while SGLang resolves its arguments (before any process starts)."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    def refuse(server_args: Any, previous: Any) -> None:
        raise error

    register_resolution_hook("handle_aux_hidden_state_capture")(refuse)
