"""What the vLLM-native codemod did with one decoder: its verdict type, shared by the codemod and by the
processes that only read its results.

A vLLM worker that loads an adapted model from pipespec's cache reads this status but never runs the
codemod, so this module imports nothing but pipespec's ``StrEnum`` (no libcst): the import stays as cheap
as the standard library's, like ``sglang_outcome`` for the SGLang dialect.
"""

from __future__ import annotations

from pipespec.str_enum import StrEnum

__all__ = ["DecoderStatus"]


class DecoderStatus(StrEnum):
    """What the codemod does with one decoder; the value is what reports and JSON say."""

    ADAPTED = "adapted"  # rewritten to vLLM's EAGLE3-over-PP contract
    UNCHANGED = "unchanged"  # already PP-correct by that contract: left byte-identical
    DECLINED = "declined"  # not rewritten: the reason names the construct and its line
