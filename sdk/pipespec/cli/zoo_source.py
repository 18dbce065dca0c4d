"""What ``pipespec zoo --engine vllm|sglang --source TREE_OR_VERSION`` share: the run, the table, the counts.

An engine's source zoo (``zoo_vllm_source``, ``zoo_sglang_source``) checks its own flags and supplies a
``SourceEngine``: how to find its tree, pick files, name the release, run the codemod over the files and write
its coverage section. The run here is the same for both: a bad ``--files`` value or coverage file is one line
before anything runs, then the table (or ``--json``) and, with ``--write-coverage FILE``, the release's section
of FILE (``pipespec.cli.report_sections``). Exit 1 when any row crashed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipespec.cli.report_sections import check_section, write_section
from pipespec.cli.zoo import load_average
from pipespec.codegen.source_zoo import SourceZoo, Status

STATUSES = [s.value for s in Status]


@dataclass(frozen=True)
class SourceEngine:
    """One engine's source zoo, as the shared run needs it."""

    name: str  # the --engine value
    label: str  # how tables and messages name it ("vLLM", "SGLang")
    section: str  # the coverage section's key, with {release}
    source_tree: Callable[[str], Path]
    select_files: Callable[[Path, Sequence[str] | None], object]
    release_of: Callable[[Path], str]
    run: Callable[..., SourceZoo]  # (tree, wanted, jobs=...) -> SourceZoo
    markdown: Callable[[SourceZoo, str, float], str]  # (zoo, command, load) -> the section


def run_source(engine: SourceEngine, args: argparse.Namespace) -> int:
    """The tree read, the table (or JSON) printed, the release's section written; 1 when a row crashed."""
    wanted = args.files.split(",") if args.files is not None else None
    tree = engine.source_tree(args.source)
    engine.select_files(tree, wanted)  # a bad --files value is one line before the run
    key = engine.section.format(release=engine.release_of(tree))
    if args.write_coverage:
        check_section(args.write_coverage, key)
    load = load_average()
    zoo = engine.run(tree, wanted, jobs=args.jobs)
    if args.json:
        print(json.dumps([r.to_json() for r in zoo.rows]))
    else:
        print(source_table(zoo, engine.label))
    if args.write_coverage:
        command = f"pipespec zoo --engine {engine.name} --source {args.source} --write-coverage {args.write_coverage}"
        if args.files:
            command += f" --files {args.files}"
        if args.jobs > 1:
            command += f" --jobs {args.jobs}"
        write_section(args.write_coverage, key, engine.markdown(zoo, command, load))
        print(f"wrote the {engine.label} {zoo.release} section of {args.write_coverage}", file=sys.stderr)
    return 1 if zoo.crashed() else 0


def summary(zoo: SourceZoo) -> tuple[str, str]:
    """The counts per status and the files line ("X of Y files with a PP hand-off ...")."""
    counts = ", ".join(f"{zoo.counts[s]} {s}" for s in STATUSES)
    files = (f"{len(zoo.ready_files())} of {len(zoo.files())} files with a PP hand-off adapted, unchanged or supported "
             f"({zoo.files_read} model files read)")
    return f"{len(zoo.rows)} decoders: {counts}", files


def source_table(zoo: SourceZoo, label: str) -> str:
    """One row per decoder (reasons cut at 110 characters), then the counts, the files line and the wall time."""
    rows = [("file", "decoder", "status", "reason")]
    for r in zoo.rows:
        reason = r.reason if len(r.reason) <= 110 else r.reason[:107] + "..."
        rows.append((r.file, r.class_name or "-", r.status.value, reason))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    decoders, files = summary(zoo)
    lines += [f"{label} {zoo.release} ({zoo.tree}): {decoders}", files, f"{zoo.wall_s:.1f} s wall, {zoo.jobs} process(es)"]
    return "\n".join(line.rstrip() for line in lines)


def markdown_cell(text: str) -> str:
    """Text that stays inside one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


__all__ = ["STATUSES", "SourceEngine", "markdown_cell", "run_source", "source_table", "summary"]
