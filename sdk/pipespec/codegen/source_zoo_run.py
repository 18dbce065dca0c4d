"""The source zoos' run over files: one survey job per model file, in ``jobs`` spawned processes or in this one.

Engine-neutral: the SGLang source zoo runs its files through it; the rows come back in file order either way.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import TypeVar

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
