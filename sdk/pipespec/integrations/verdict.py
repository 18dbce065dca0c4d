"""What an engine plugin does for one model class in one run, decided before any weight loads.

The values are the words of ``pipespec verify --engine ... --json``'s ``"decision"`` (DESIGN.md), so the
JSON and the text output print a member exactly as the strings did. Engine-neutral: vLLM's plugin
(``integrations.vllm.adapt_at_load``) answers with these, and another engine's plugin answers in the same words.
"""

from __future__ import annotations

from pipespec.str_enum import StrEnum

__all__ = ["Verdict"]


class Verdict(StrEnum):
    """The plugin's verdict, from "nothing to do" to "the run stops"."""

    SKIP = "skip"  # the run's method reads no aux hidden states: nothing to decide
    SUPPORTED = "supported"  # the class runs the method as it is (the engine's own code)
    ADAPT = "adapt"  # pipespec registers its adapted class for the run
    REFUSE = "refuse"  # the run cannot work: stop before loading, with the reason
