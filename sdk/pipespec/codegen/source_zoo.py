"""What the source zoos share: the row and report types, the statuses, and the run over model files.

A source zoo reads an engine's model files (a released tree, never imported) and gives one ``SourceRow`` per
decoder with a ``Status``; ``run_files`` surveys the files in ``jobs`` spawned processes or in this one.
``vllm_source_zoo`` (vLLM's tree, the vLLM-native codemod and the readiness verdict) and ``sglang_source_zoo``
(SGLang's tree, the sglang dialect) are the two; each module's docstring says what its statuses mean there.
Engine-neutral: nothing here imports an engine, torch, or the code the zoos read.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pipespec.str_enum import StrEnum


class Status(StrEnum):
    """A decoder's outcome, from best to worst for a user of that release."""

    UNCHANGED = "unchanged"
    SUPPORTED = "supported"
    ADAPTED = "adapted"
    DECLINED = "declined"
    CRASHED = "crashed"


class CodemodStatus(StrEnum):
    """What the codemod itself said of a decoder, beside the row's ``Status``."""

    ADAPTED = "adapted"  # it rewrote the decoder
    UNCHANGED = "unchanged"  # it left the decoder byte-identical
    DECLINED = "declined"  # it did not rewrite it (the construct and its line)
    UNSEEN = "unseen"  # a class with a PP hand-off that the codemod does not take for a decoder
    CRASHED = "crashed"  # the file does not parse, or the codemod raised


#: The statuses under which a decoder runs EAGLE3 over PP: as released, or adapted by the codemod.
READY = (Status.UNCHANGED, Status.SUPPORTED, Status.ADAPTED)


@dataclass(frozen=True)
class SourceRow:
    """One decoder: DESIGN.md's ``{"file", "class", "status", "reason"}`` plus what the codemod said."""

    file: str  # relative to the engine's package: model_executor/models/llama.py, srt/models/llama.py
    class_name: str
    status: Status
    reason: str
    codemod: CodemodStatus
    causal_lm: tuple[str, ...] = ()
    line: int = 0  # the class's line in the released file

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "class": self.class_name, "status": self.status.value, "reason": self.reason,
                "codemod": self.codemod.value, "causal_lm": list(self.causal_lm), "line": self.line}


@dataclass(frozen=True)
class SourceZoo:
    """A tree's rows in file order, and how the run went."""

    tree: Path  # the engine's package directory
    release: str  # the tree's version (read from its version file), or its path when it has none
    rows: tuple[SourceRow, ...]
    files_read: int  # model files read (a file that cannot hold a decoder is not parsed)
    wall_s: float = 0.0
    jobs: int = 1
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.counts.update(r.status.value for r in self.rows)

    def files(self) -> list[str]:
        """The files with a PP hand-off (one or more rows), in order."""
        return list(dict.fromkeys(r.file for r in self.rows))

    def ready_files(self) -> list[str]:
        """Files whose every decoder is unchanged, supported or adapted."""
        return [f for f in self.files() if all(r.status in READY for r in self.rows if r.file == f)]

    def crashed(self) -> list[SourceRow]:
        return [r for r in self.rows if r.status is Status.CRASHED]


def one_line(exc: BaseException) -> str:
    """An exception as one line of a row's reason: its type and its first 300 characters.

    >>> one_line(ValueError("bad\\n  value"))
    'ValueError: bad value'
    """
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


Job = TypeVar("Job")
Row = TypeVar("Row")


def run_files(survey: Callable[[Job], list[Row]], work: Sequence[Job], jobs: int) -> tuple[Row, ...]:
    """``survey`` over ``work`` (a module-level function, so spawned workers can import it), rows in order."""
    if jobs > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(work))) as pool:
            per_file = pool.map(survey, work, chunksize=1)
    else:
        per_file = [survey(w) for w in work]
    return tuple(r for file_rows in per_file for r in file_rows)


def survey_tree(tree: Path, release: str, paths: Sequence[Path], survey: Callable[[tuple[str, str]], list[SourceRow]],
                jobs: int) -> SourceZoo:
    """``survey`` over ``paths`` of ``tree`` (one ``(file, tree)`` job each, ``run_files``), timed, as the zoo."""
    started = time.perf_counter()
    rows = run_files(survey, [(str(p), str(tree)) for p in paths], jobs)
    return SourceZoo(tree, release, rows, len(paths), time.perf_counter() - started, jobs)


__all__ = ["READY", "CodemodStatus", "SourceRow", "SourceZoo", "Status", "one_line", "run_files", "survey_tree"]
