"""Reading pipespec's ``PIPESPEC_*`` environment settings: one parser per kind, strict about values.

A typo in a switch must not silently mean "off": every reader here accepts a small set of spellings
and raises ``UsageError`` naming the variable, the value and what to write instead.
"""

from __future__ import annotations

import os

from pipespec.errors import UsageError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """``$name`` as a switch: unset, empty, 0/false/no/off → False; 1/true/yes/on → True (any case)."""
    value = os.environ.get(name, "").strip().lower()
    if value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise UsageError(f"{name}={value!r}: use 1 (on) or 0 (off)")


def env_positive_int(name: str) -> int | None:
    """``$name`` as an integer >= 1, or None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None
    if number < 1:
        raise UsageError(f"{name}={number} must be >= 1")
    return number
