"""Every SGLang symbol pipespec's SGLang plugin wraps, with why, how, and when it can go.

The vllm-ascend discipline, as for vLLM (``integrations/vllm/patches.py``): one list, read before anything else
changes. The plugin registers these through SGLang's own plugin API (``HookRegistry`` and the named resolution
hooks of ``sglang.srt.arg_groups.resolution_hooks``) in ``apply_patches()``; SGLang applies them in every process
that calls ``load_plugins()`` (the engine and each scheduler). Tested on SGLang 0.5.23 only.

Imports SGLang lazily, inside ``apply_patches``; importing this module needs no SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TESTED = ("0.5.23",)
#: Speculative methods whose draft reads the target's aux hidden states (SGLang's names).
AUX_METHODS = ("EAGLE3",)


@dataclass(frozen=True)
class Patch:
    """One SGLang symbol pipespec wraps at run time."""

    symbol: str  # dotted path of what is wrapped
    where: str  # the processes it runs in
    why: str
    how: str
    upstream: str  # the upstream change that would make it unnecessary
    removal: str  # when and how it goes away


PATCHES = (
    Patch(
        symbol="sglang.srt.arg_groups.validation_hook.handle_aux_hidden_state_capture",
        where="engine front-end, while ServerArgs resolve (before any scheduler process starts)",
        why=(
            "it refuses --enable-return-aux-hidden-states unless pp_size == 1, because SGLang's models capture "
            "on the last rank only; an adapted class captures on every rank and relays the states"
        ),
        how=(
            "a named resolution hook (register_resolution_hook, SGLang's own API): for pp_size > 1 pipespec "
            "decides on the model class (adapt_at_load.decide_for_run); refuse -> one line (UnsupportedModelError) "
            "before weights load; adapt or supported -> SGLang's step runs with pp_size seen as 1, so every other "
            "check of it still applies"
        ),
        upstream="SGLang issue #39634 (aux states over PP; #39643, #39644): the guard goes when models relay",
        removal="drop the hook for releases whose models carry aux states over PP",
    ),
    Patch(
        symbol="sglang.srt.arg_groups.validation_hook.check_pipeline_parallel_compat",
        where="engine front-end (ServerArgs.check_server_args), before any scheduler process starts",
        why=(
            "with pp_size > 1 it asserts the speculative algorithm is EAGLE (single hidden state); EAGLE3 reads "
            "aux states, which an adapted class relays"
        ),
        how=(
            "HookRegistry AROUND: for EAGLE3 (not multi-layer) pipespec decides on the class; refuse -> one "
            "line; adapt or supported -> SGLang's check runs on a view where the algorithm reads EAGLE, so its "
            "other PP rules (SGLANG_ENABLE_PP_SPEC, disaggregation, adaptive spec) still apply"
        ),
        upstream="SGLang issue #39634: EAGLE3 under PP once models relay aux states",
        removal="drop the hook for releases that accept EAGLE3 under PP",
    ),
    Patch(
        symbol="sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        where="every process that resolves the model class (engine, tokenizer manager, each scheduler)",
        why=(
            "SGLang builds the model in each scheduler process from its registry; the adapted class must be the "
            "one every stage builds, and registering it by name (ModelRegistry.models[arch] = ...) would have to "
            "happen after the run's config is known in each process"
        ),
        how=(
            "HookRegistry AROUND: when the run captures EAGLE3 aux states (an EAGLE3 draft or "
            "--enable-return-aux-hidden-states), the class SGLang resolves is replaced by pipespec's adapted one "
            "(adapted_modules, built in memory once per process) when the verdict is adapt; otherwise SGLang's "
            "answer is returned unchanged"
        ),
        upstream="none needed once SGLang's own model files relay aux states",
        removal="drop when the supported SGLang releases ship relaying models (the verdict is then 'supported')",
    ),
)


def apply_patches() -> None:
    """Register the hooks above with SGLang (call from the plugin; SGLang applies them once per process)."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _registered
    if _registered:
        return
    _registered = True
    register_resolution_hook("handle_aux_hidden_state_capture")(_aux_capture_guard)
    HookRegistry.register(PATCHES[1].symbol, _pp_compat_guard, HookType.AROUND)
    HookRegistry.register(PATCHES[2].symbol, _resolve_adapted, HookType.AROUND)


_registered = False


def _aux_capture_guard(server_args: Any, previous: Callable[[Any], None]) -> None:
    from pipespec.integrations.sglang.adapt_at_load import decide_for_run, refuse_if_needed

    pp = int(getattr(server_args, "pp_size", 1) or 1)
    if pp == 1 or not getattr(server_args, "enable_return_aux_hidden_states", False):
        previous(server_args)
        return
    decision = decide_for_run(server_args.model_path, pp)
    refuse_if_needed(decision, pp, "--enable-return-aux-hidden-states")
    if decision is None:
        previous(server_args)  # not a local checkpoint: SGLang's own answer
        return
    previous(_View(server_args, pp_size=1))  # ServerArgs refuses writes to its inputs during resolution


class _View:
    """An SGLang config object as one of its checks reads it, with some fields answered differently; writes
    (``declare_resolution``'s stash) go to the object itself."""

    def __init__(self, target: Any, **fields: Any) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        return fields[name] if name in fields else getattr(object.__getattribute__(self, "_target"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_target"), name, value)


def _pp_compat_guard(original: Callable[[Any], None], cfg: Any) -> None:
    from pipespec.integrations.sglang.adapt_at_load import decide_for_run, refuse_if_needed

    if not _reads_aux(getattr(cfg, "speculative_algorithm", None)) or getattr(cfg, "enable_multi_layer_eagle", False):
        original(cfg)
        return
    pp = int(cfg.pp_size)
    decision = decide_for_run(cfg.model_path, pp)
    refuse_if_needed(decision, pp, "--speculative-algorithm EAGLE3")
    original(_View(cfg, speculative_algorithm="EAGLE") if decision is not None else cfg)


def _captures_aux() -> bool:
    """Whether this process's run captures EAGLE3 aux states (read from SGLang's published config)."""
    from sglang.srt.runtime_context import get_exec, get_spec

    try:
        capture = get_exec().features.aux_hidden_state_capture
        algorithm = get_spec().speculative_algorithm
    except ValueError:  # not published in this process (the front-end before launch): nothing is built here
        return False
    return _reads_aux(capture) or _reads_aux(algorithm)


def _reads_aux(method: str | None) -> bool:
    """Whether an SGLang speculative method (or aux-capture setting) is one whose draft reads aux states."""
    return (method or "").upper() in AUX_METHODS


def _resolve_adapted(original: Callable[..., tuple[type, str]], registry: Any, *args: Any, **kwargs: Any
                     ) -> tuple[type, str]:
    cls, architecture = original(registry, *args, **kwargs)
    if not _captures_aux():
        return cls, architecture
    from pipespec.integrations.sglang.adapted_modules import adapt_model_class

    adaptation = adapt_model_class(cls)  # cached per process
    if adaptation.adapted is None:
        return cls, architecture
    if cls.__name__ not in _logged:
        _logged.add(cls.__name__)
        logging.getLogger("sglang.plugins.pipespec").info(
            "pipespec: %s built as adapted for EAGLE3 aux states over PP (%s)", cls.__name__, adaptation.label)
    return adaptation.adapted, architecture


_logged: set[str] = set()
