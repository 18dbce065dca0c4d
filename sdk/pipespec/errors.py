"""Error types. Every user mistake surfaces as one of these, never as a bare traceback.

The CLI maps them to exit codes: ``UsageError`` (bad flags, bad spec, bad layout) → 2, every other
``PipespecError`` (unsupported model, bad checkpoint, runtime failure) → 1.
"""

from __future__ import annotations


class PipespecError(Exception):
    """Base class: a message fit to print as the one line a user sees."""

    exit_code: int = 1


class UsageError(PipespecError, ValueError):
    """The user asked for something impossible (flags, layout, spec contents)."""

    exit_code = 2


class LayoutError(UsageError):
    """A pipeline layout breaks a rule of the contract (partition, aux ids, boundary rule)."""


class SpecError(UsageError):
    """An adapter spec (adapters/*.toml or a decorator) is malformed."""


class UnsupportedModelError(PipespecError):
    """A model cannot run the requested speculative method under pipeline parallelism."""


class CheckpointError(PipespecError):
    """A checkpoint directory or file is missing, corrupt, or does not match the model."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as one line for a report: its type, then its message with whitespace collapsed, cut at
    ``limit`` characters (the zoo tables give each failing model one line)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"
