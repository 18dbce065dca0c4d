"""What pipespec does for one SGLang run: nothing, adapt the model class, or refuse — decided before weights load.

``decide(architecture, cls, pp)`` is the verdict on the class SGLang's registry resolves an architecture to
(also what ``pipespec verify --engine sglang`` prints), in the words of vLLM's plugin (``Verdict``):

* the class's decoder already carries aux states over PP (its forward is left unchanged by the codemod) →
  supported;
* else its decoder module and its own module are adapted with the SGLang codemod (``adapted_modules``) →
  adapt, and the registry answers the adapted class in every process (``patches``);
* else → refuse, with the codemod's reason (construct and line), before any weight is loaded.

SGLang 0.5.23 has no model that carries EAGLE3's aux states over PP, so "supported" is only for classes
already adapted (by ``adapter-gen --dialect sglang``) or fixed upstream.

Imports SGLang (this is ``pipespec.integrations.sglang``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from pipespec.codemods.sglang_outcome import SglangStatus
from pipespec.errors import UnsupportedModelError, UsageError
from pipespec.integrations.sglang.adapted_modules import adapt_model_class
from pipespec.integrations.verdict import Verdict


@dataclass(frozen=True)
class Decision:
    """The plugin's verdict on one model class for one run (``pipespec verify --engine sglang --json``)."""

    architecture: str
    cls: str  # module:Class SGLang's registry resolves the architecture to
    decision: Verdict
    reason: str
    spec: str | None = None  # the codemod and files behind "adapt"
    adapted: type | None = None

    def as_json(self) -> dict[str, Any]:
        """DESIGN.md's CLI contract: architecture, class, decision, reason, spec."""
        return {"architecture": self.architecture, "class": self.cls, "decision": str(self.decision),
                "reason": self.reason, "spec": self.spec}


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def decide(architecture: str, cls: type, pp: int = 1) -> Decision:
    """Supported as is, adapt (and to what), or refuse, for ``cls`` registered as ``architecture``.

    Builds the adapted modules when adaptation is needed (no weights, no model instance), so "adapt" is only
    answered for a class whose adapted decoder carries the capability flag and the adapted forward.
    """
    path = f"{cls.__module__}:{cls.__name__}"
    needs = "EAGLE3 with pipeline parallelism" if pp > 1 else "EAGLE3"
    head = (f"{cls.__name__} does not support {needs} in SGLang {_sglang_version()}: its forward captures aux "
            "states on the last pipeline rank only")
    try:
        adaptation = adapt_model_class(cls)
    except Exception as exc:  # the codemod's output failed to import: refuse, do not crash the engine
        return Decision(architecture, path, Verdict.REFUSE,
                        f"{head}; pipespec cannot adapt it: its adapted module fails to import "
                        f"({type(exc).__name__}: {exc})")
    if adaptation.status is SglangStatus.UNCHANGED:
        return Decision(architecture, path, Verdict.SUPPORTED,
                        f"{cls.__name__}'s decoder already captures on every rank and relays aux states over "
                        f"PP ({adaptation.reason})", adaptation.label)
    if adaptation.status is SglangStatus.DECLINED or adaptation.adapted is None:
        return Decision(architecture, path, Verdict.REFUSE, f"{head}; pipespec cannot adapt it: declined "
                        f"({adaptation.reason})", adaptation.label if adaptation.files else None)
    return Decision(architecture, path, Verdict.ADAPT, f"{head}; {adaptation.reason}", adaptation.label,
                    adaptation.adapted)


def architectures_of(model_path: str) -> list[str]:
    """``architectures`` from ``model_path``'s config.json (a local directory), or [] when it has none here."""
    config = os.path.join(model_path, "config.json")
    if not os.path.isfile(config):
        return []
    with open(config, encoding="utf-8") as handle:
        return list(json.load(handle).get("architectures") or [])


def decide_for_run(model_path: str, pp: int) -> Decision | None:
    """The engine-load decision in SGLang's front-end, from the server arguments (None: not a local model
    directory; SGLang resolves hub ids later and the registry hook adapts what it resolves)."""
    architectures = architectures_of(model_path)
    if not architectures:
        return None
    return verify_architecture(architectures[0], pp)


def refuse_if_needed(decision: Decision | None, pp: int, what: str) -> None:
    """Raise the one line for a refused run (``what``: the SGLang setting that asked for aux states)."""
    if decision is not None and decision.decision is Verdict.REFUSE:
        raise UnsupportedModelError(f"pipespec: {what} with --pp-size {pp}: {decision.reason}")


def _module_of(architecture: str) -> str | None:
    """The ``sglang.srt.models`` module defining ``architecture`` as an ``EntryClass``, found by reading the
    files (importing all ~300 model modules takes a minute and needs every CUDA-only import)."""
    import sglang.srt.models as models

    pattern = re.compile(rf"^class\s+{re.escape(architecture)}\s*[(:]", re.M)
    for directory in models.__path__:
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                text = handle.read()
            if "EntryClass" in text and pattern.search(text):
                return f"sglang.srt.models.{name[:-3]}"
    return None


def verify_architecture(architecture: str, pp: int) -> Decision:
    """``pipespec verify --engine sglang``: what the plugin would do for this architecture (no weights, no config)."""
    import importlib

    if pp < 1:
        raise UsageError(f"--pp {pp}: pipeline size must be >= 1")
    module_name = _module_of(architecture)
    if module_name is None:
        return Decision(architecture, "", Verdict.REFUSE,
                        f"{architecture} is not an architecture of SGLang {_sglang_version()}: check the spelling "
                        "(config.json's `architectures`)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        return Decision(architecture, f"{module_name}:{architecture}", Verdict.REFUSE,
                        f"{architecture}: SGLang's module {module_name} cannot be imported here "
                        f"({type(exc).__name__}: {exc}), so pipespec can neither check nor adapt it; install what "
                        "it needs and retry")
    entries = module.EntryClass if isinstance(module.EntryClass, list) else [module.EntryClass]
    cls = next((c for c in entries if c.__name__ == architecture), None)
    if cls is None:
        return Decision(architecture, f"{module_name}:{architecture}", Verdict.REFUSE,
                        f"{architecture} is defined in {module_name} but not registered there (not in EntryClass)")
    return decide(architecture, cls, pp)
