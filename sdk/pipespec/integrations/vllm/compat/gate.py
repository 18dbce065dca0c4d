"""The plugin gate: may pipespec run on this vLLM, and with which release's rules. Decided from source.

* a tested minor release (0.32, 0.33, 0.34; any patch release of them) → runs with that release's module;
* an older one → refused;
* a newer one (or a build without a readable version) → its source is probed (``probe.py``): when every
  contract symbol is there and its runner facts are those the newest module assumes, it runs with the
  newest module and ONE warning line naming the tested range; else it is refused, naming what differs.

A refusal is one ``UsageError`` line naming the release, what is missing and ``PIPESPEC_VLLM=off``;
the plugin raises it when vLLM loads plugins, before any config is built or weight read.
Imports nothing of vLLM: ``decide_gate`` takes a version and a tree, so the tests run it on each
release's real source (``sources.source_tree``) and on modified copies.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, fields
from pathlib import Path

from pipespec.integrations.vllm.compat.probe import Probe, RunnerFacts, probe_tree
from pipespec.integrations.vllm.compat.releases import (
    NEWEST,
    OLDEST,
    RELEASE_MODULES,
    TESTED_RANGE,
    TESTED_RELEASES,
    Scope,
    minor_of,
    tested_span,
)
from pipespec.integrations.vllm.compat.v0_32 import Vllm032

#: The model-side contract generated code and the support verdicts stand on (DESIGN.md "vLLM (>= 0.32)").
MODEL_CONTRACT = (
    "vllm.model_executor.models.interfaces.EagleModelMixin.supports_aux_hidden_states_over_pp",
    "vllm.model_executor.models.interfaces.EagleModelMixin.AUX_HIDDEN_STATE_KEY",
    "vllm.model_executor.models.interfaces.EagleModelMixin._set_aux_hidden_state_layers",
    "vllm.model_executor.models.interfaces.EagleModelMixin._maybe_add_hidden_state",
    "vllm.model_executor.models.interfaces.EagleModelMixin.pack_local_aux_hidden_states",
    "vllm.model_executor.models.interfaces.EagleModelMixin.collect_remote_aux_hidden_states",
    "vllm.model_executor.models.interfaces.SupportsEagle3.set_aux_hidden_state_layers",
    "vllm.model_executor.models.interfaces.SupportsEagle3.get_eagle3_default_aux_hidden_state_layers",
    "vllm.model_executor.models.interfaces.supports_eagle3",
    "vllm.model_executor.models.utils.spec_decode_needs_target_embed",
    "vllm.sequence.IntermediateTensors",
)
OFF = "set PIPESPEC_VLLM=off to run vLLM without pipespec"


class Gate(enum.Enum):
    """The gate's verdict, in order of trust."""

    TESTED = "tested"  # a tested minor release: runs
    NEWER = "newer"  # untested, contract intact: runs with one warning line
    REFUSED = "refused"  # older than the tested range, or a contract that differs


@dataclass(frozen=True)
class GateVerdict:
    """What the gate decided for one vLLM, with which release module, and the line to print."""

    gate: Gate
    version: str
    module: str | None  # "module:Class" of the release rules (None when refused)
    message: str  # the warning (NEWER) or the refusal (REFUSED); empty when TESTED
    missing: tuple[str, ...] = ()


def contract(scope: Scope = Scope.PLUGIN, minor: tuple[int, int] = NEWEST) -> tuple[str, ...]:
    """The symbols a release must define for pipespec's ``scope``: the model contract plus every symbol
    ``patches.PATCHES`` uses in that scope on ``minor``'s release (the zoo scope includes the plugin's)."""
    from pipespec.integrations.vllm.patches import PATCHES

    release = next(r for r in TESTED_RELEASES if minor_of(r) == minor)
    used = [p.symbol for p in PATCHES if release in p.tested and (scope is Scope.ZOO or p.scope is Scope.PLUGIN)]
    return tuple(dict.fromkeys([*MODEL_CONTRACT, *used]))


def runner_differences(found: RunnerFacts, assumed: RunnerFacts) -> list[str]:
    """The runner facts of a tree that differ from what a release module assumes, as readable phrases."""
    out = []
    for field in fields(RunnerFacts):
        have, want = getattr(found, field.name), getattr(assumed, field.name)
        if have != want:
            out.append(f"runner fact {field.name} is {have} (the {NEWEST[0]}.{NEWEST[1]} rules assume {want})")
    return out


def decide_gate(version: str, tree: Path | str, scope: Scope = Scope.PLUGIN) -> GateVerdict:
    """The gate for vLLM ``version`` whose ``vllm`` package directory is ``tree`` (read only if untested)."""
    minor = minor_of(version)
    if minor in RELEASE_MODULES:
        return GateVerdict(Gate.TESTED, version, RELEASE_MODULES[minor], "")
    if minor is not None and minor < OLDEST:
        return GateVerdict(Gate.REFUSED, version, None, (
            f"pipespec's vLLM plugin needs vLLM >= {OLDEST[0]}.{OLDEST[1]} (tested on {tested_span()}), this is "
            f"vLLM {version}: install a tested vLLM (`pip install 'pipespec[vllm]'`, {TESTED_RANGE}), or {OFF}"))
    probe = probe_tree(Path(tree), contract(scope))
    return newer_verdict(version, probe)


def newer_verdict(version: str, probe: Probe) -> GateVerdict:
    """The verdict on an untested newer release from its probe: the newest rules apply, or it is refused."""
    differs = [*probe.missing, *runner_differences(probe.runner, release_class(NEWEST).RUNNERS)]
    if differs:
        shown = "; ".join(differs[:6]) + (f"; and {len(differs) - 6} more" if len(differs) > 6 else "")
        return GateVerdict(Gate.REFUSED, version, None, (
            f"pipespec's vLLM plugin cannot run on vLLM {version}: its contract differs from the tested releases "
            f"({tested_span()}): {shown}. Install a tested vLLM (`pip install 'pipespec[vllm]'`, {TESTED_RANGE}), "
            f"or {OFF}"), tuple(differs))
    return GateVerdict(Gate.NEWER, version, RELEASE_MODULES[NEWEST], (
        f"pipespec: vLLM {version} is newer than the releases pipespec's plugin is tested on ({tested_span()}); "
        f"its contract symbols are all present, so the plugin runs with the {NEWEST[0]}.{NEWEST[1]} rules"))


def release_class(minor: tuple[int, int]) -> type[Vllm032]:
    """The rules class of a tested minor release (``RELEASE_MODULES``)."""
    module, _, name = RELEASE_MODULES[minor].partition(":")
    found: type[Vllm032] = getattr(importlib.import_module(module), name)
    return found
