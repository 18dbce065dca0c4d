"""Enums whose members are the strings that pipespec prints and writes: verdicts and statuses.

``enum.StrEnum`` is Python 3.11+; pipespec supports 3.10, so this is its behaviour in two lines. A
member equals, hashes, formats and JSON-encodes as its value, so text and JSON outputs carry the value
exactly as the plain strings did, while code compares members:

    >>> import json
    >>> class Light(StrEnum):
    ...     GREEN = "green"
    >>> f"{Light.GREEN}", json.dumps({"light": Light.GREEN}), Light("green") is Light.GREEN
    ('green', '{"light": "green"}', True)
"""

from __future__ import annotations

import enum

__all__ = ["StrEnum"]


class StrEnum(str, enum.Enum):
    """A ``str`` enum: ``str(member)`` and ``f"{member}"`` give its value (as ``enum.StrEnum`` does)."""

    def __str__(self) -> str:
        return str(self.value)
