"""Everything in pipespec that depends on the vLLM release, in one place (vllm-ascend's discipline).

One small module per minor release behind one interface (``Vllm032``'s methods): ``v0_32`` is the base,
``v0_33`` and ``v0_34`` override only what changed. ``current()`` chooses one, once per process, from the
installed vLLM through the gate (``gate.decide_gate``: a tested release, a newer release whose contract is
intact, or a refusal); the plugin calls ``load()`` when vLLM loads it, so a refusal or the one warning
line comes before anything else. ``probe`` reads a vLLM tree's source without importing it.

Dropping a release: delete its module and its entries in ``releases.py`` and ``patches.PATCHES``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipespec.errors import UsageError
from pipespec.integrations.vllm.compat.gate import Gate, GateVerdict, decide_gate, release_class
from pipespec.integrations.vllm.compat.releases import RELEASE_MODULES, TESTED_RANGE, TESTED_RELEASES, Scope
from pipespec.integrations.vllm.compat.v0_32 import Runner, Vllm032

__all__ = ["Gate", "GateVerdict", "Runner", "Scope", "TESTED_RANGE", "TESTED_RELEASES", "Vllm032", "current",
           "gate_installed", "load"]

_CHOSEN: dict[str, tuple[GateVerdict, Vllm032]] = {}
#: Set by the process that logs the NEWER warning; the processes vLLM starts from it inherit it and stay quiet.
WARNED = "PIPESPEC_VLLM_WARNED_NEWER"


def gate_installed(scope: Scope = Scope.PLUGIN) -> GateVerdict:
    """The gate for the installed vLLM (imported: this runs where vLLM runs); ``UsageError`` if refused."""
    import vllm

    verdict = decide_gate(str(vllm.__version__), Path(vllm.__file__).parent, scope)
    if verdict.gate is Gate.REFUSED:
        raise UsageError(verdict.message)
    return verdict


def load(scope: Scope = Scope.PLUGIN) -> GateVerdict:
    """Gate the installed vLLM and choose its release module, once per process and scope; logs the NEWER
    warning once per run (the first process; ``WARNED``). Raises the gate's ``UsageError`` for a refused
    release."""
    if scope.value not in _CHOSEN:
        verdict = gate_installed(scope)
        assert verdict.module is not None
        minor = next(m for m, path in RELEASE_MODULES.items() if path == verdict.module)
        _CHOSEN[scope.value] = (verdict, release_class(minor)())
        if verdict.gate is Gate.NEWER and os.environ.get(WARNED) != verdict.version:
            from vllm.logger import init_logger

            init_logger("vllm.plugins.pipespec").warning(verdict.message)
            os.environ[WARNED] = verdict.version  # vLLM's engine core and workers inherit it: one line a run
    return _CHOSEN[scope.value][0]


def current() -> Vllm032:
    """The installed vLLM's release rules (gated on first use in this process)."""
    load()
    return _CHOSEN[Scope.PLUGIN.value][1]

