"""``adapter-gen``'s (and the zoo reports') output: a unified diff, or a file written atomically.

``write_atomic`` (``pipespec.atomic_write``, below every layer that writes files) writes a temp file in
the same directory, then ``os.replace``: a failure leaves the original byte-identical.
"""

from __future__ import annotations

import difflib

from pipespec.atomic_write import write_atomic

__all__ = ["unified_diff", "write_atomic"]


def unified_diff(old: str, new: str, old_label: str, new_label: str) -> str:
    """``diff -u`` of two texts (empty when equal)."""
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), old_label, new_label))
