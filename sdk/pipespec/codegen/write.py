"""``adapter-gen``'s diff output: ``unified_diff``, what ``--diff`` and ``--check`` print.

Files are written with ``pipespec.atomic_write.write_atomic`` (below every layer that writes files): a temp
file in the same directory, then ``os.replace``, so a failure leaves the original byte-identical.
"""

from __future__ import annotations

import difflib

__all__ = ["unified_diff"]


def unified_diff(old: str, new: str, old_label: str, new_label: str) -> str:
    """``diff -u`` of two texts (empty when equal)."""
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), old_label, new_label))
