"""How the HF forward-shape analysis says no: the two exceptions its checks raise.

``ShapeError`` carries the specific, true reason a stage forward cannot be generated and, where known,
the source line; ``AdaptHFStageForwardCommand`` turns it into ``SkipFile`` and
``pipespec.integrations.transformers.infer`` into an unsupported spec. ``AlreadyStageAware`` is not a
failure: the forward is a pipeline forward already.

Imports nothing: every ``hf_*`` analysis module raises these, so they sit below all of them.
"""

from __future__ import annotations


class ShapeError(Exception):
    """The forward has a shape the HF codemod cannot adapt; ``str(exc)`` says which and where."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        self.reason = reason
        self.line = line
        super().__init__(f"line {line}: {reason}" if line else reason)


class AlreadyStageAware(Exception):
    """The forward already takes ``intermediate_tensors``."""
