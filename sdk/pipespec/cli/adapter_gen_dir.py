"""``adapter-gen DIR --dialect vllm``: every PP decoder of a package directory, each file adapted as
``adapter-gen FILE`` adapts it (its imports resolved from its own place).

Modes (see ``adapter_gen``'s docstring): ``--diff`` (default) prints each changed file's diff;
``--in-place`` rewrites the changed files; ``--out DIR2`` writes a copy of the directory's ``*.py`` files
(adapted where adapted, the others byte-identical); ``--check`` exits 1 when a file (or its copy in DIR2)
is not up to date. Every output is computed before the first write, so bad input or a crash writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from pipespec.errors import UsageError
from pipespec.str_enum import StrEnum

PROG = "adapter-gen"


class FileStatus(StrEnum):
    """What ``adapter-gen DIR`` made of one file: its ``adapt_target`` outcome (``AdaptStatus``, same values),
    or no PP decoder in it."""

    ADAPTED = "adapted"
    UNCHANGED = "unchanged"
    SKIPPED = "skipped"  # every decoder declined (each reason is printed; exit 1)
    NO_DECODER = "no decoder"  # no forward takes intermediate_tensors over a layer loop: copied as it is


@dataclass(frozen=True)
class FileResult:
    """One ``*.py`` of the directory: its text now and what adapter-gen makes of it."""

    path: Path
    relative: Path
    label: str
    code: str
    new_code: str
    status: FileStatus
    reason: str


def python_files(directory: Path) -> list[Path]:
    """``*.py`` under ``directory``, sorted, without hidden or ``__pycache__`` directories."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        parts = path.relative_to(directory).parts
        if any(p == "__pycache__" or p.startswith(".") for p in parts[:-1]):
            continue
        found.append(path)
    return found


def adapt_directory(directory: Path, residual_rule: str | None) -> list[FileResult]:
    """Every ``*.py`` of ``directory`` through the vllm dialect (files with no PP decoder come back as is)."""
    from pipespec.codegen.source import load_target
    from pipespec.codegen.transform import adapt_target
    from pipespec.codemods.vllm_native_names import PP_DECODER

    results = []
    for path in python_files(directory):
        target = load_target(path, None)
        relative = path.relative_to(directory)
        if "intermediate_tensors" not in target.code:  # no forward can take it (the codemod's own shortcut)
            results.append(FileResult(path, relative, target.label, target.code, target.code, FileStatus.NO_DECODER, PP_DECODER))
            continue
        try:
            outcome = adapt_target(target, "vllm", None, residual_rule=residual_rule)
        except UsageError as exc:
            if "no PP decoder here" not in str(exc):
                raise
            results.append(FileResult(path, relative, target.label, target.code, target.code, FileStatus.NO_DECODER, str(exc)))
            continue
        for warning in outcome.warnings:
            print(f"{PROG}: warning: {target.label}: {warning}", file=sys.stderr)
        results.append(FileResult(path, relative, target.label, target.code, outcome.code, FileStatus(outcome.status),
                                  outcome.reason))
    return results


def run_dir(args: argparse.Namespace) -> int:
    """The ``adapter-gen DIR`` command (flags as parsed by ``adapter_gen.add_arguments``)."""
    from pipespec.atomic_write import write_atomic
    from pipespec.codegen.write import unified_diff

    directory = Path(args.target[0])
    for flag, value, why in (("--class", args.class_name, "a class is one file's"),
                             ("--spec", args.spec, "a spec names one file's decoder class"),
                             ("--hf", args.hf, "--hf adapts an installed transformers module")):
        if value:
            raise UsageError(f"{flag} cannot be combined with a directory ({directory}): {why}; give FILE instead")
    if args.dialect not in (None, "vllm"):
        raise UsageError(f"--dialect {args.dialect} with a directory ({directory}): a directory is adapted in the vllm "
                         "dialect only; pass --dialect vllm, or one FILE --class NAME")
    modes = [f for f, on in (("--diff", args.diff), ("--in-place", args.in_place), ("--check", args.check)) if on]
    if len(modes) > 1 or (args.out is not None and modes and modes[0] != "--check"):
        shown = modes if len(modes) > 1 else ["--out", modes[0]]
        raise UsageError(f"{shown[0]} cannot be combined with {shown[1]}: choose one mode (--diff, --out DIR2, "
                         "--in-place or --check [--out DIR2])")
    out = Path(args.out) if args.out is not None else None
    if out is not None:
        _check_out(directory, out, creating=not args.check)
    results = adapt_directory(directory, args.residual_rule)
    if all(r.status is FileStatus.NO_DECODER for r in results):
        raise UsageError(f"{directory}: no *.py file here has a PP decoder (a class whose forward takes "
                         "intermediate_tensors and loops over self.layers); pass a vLLM model package")
    failed = 0
    for r in results:
        if r.status is FileStatus.SKIPPED:
            failed = 1
            print(f"{PROG}: skipped {r.label}: {r.reason}", file=sys.stderr)
    if args.check:
        return _check(results, directory, out) or failed
    if out is None and not args.in_place:
        for r in results:
            if r.new_code != r.code:
                sys.stdout.write(unified_diff(r.code, r.new_code, f"a/{r.label}", f"b/{r.label}"))
        return failed
    writes = [(out / r.relative if out is not None else r.path, r.new_code) for r in results
              if out is not None or r.new_code != r.code]
    if out is not None:
        out.mkdir(exist_ok=True)
    for path, text in writes:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    adapted = [r.label for r in results if r.status is FileStatus.ADAPTED]
    where = out if out is not None else directory
    print(f"{PROG}: wrote {len(writes)} file(s) under {where} ({len(adapted)} adapted: {', '.join(adapted) or 'none'})",
          file=sys.stderr)
    return failed


def _check_out(directory: Path, out: Path, creating: bool) -> None:
    src, dst = directory.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise UsageError(f"--out {out}: is {directory} itself or inside it; use --in-place, or a directory elsewhere")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory; with DIR, --out names a directory")
    if creating and not out.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: its parent {out.parent} does not exist; create it or choose another --out")


def _check(results: list[FileResult], directory: Path, out: Path | None) -> int:
    """``--check``: DIR's files adapted already (no ``--out``), or DIR2 what regenerating would write."""
    from pipespec.codegen.write import unified_diff

    stale = 0
    for r in results:
        if out is None:
            current, shown = r.code, r.label
        else:
            copy = out / r.relative
            current = copy.read_text(encoding="utf-8") if copy.is_file() else ""
            shown = str(copy)
        if current != r.new_code and not (out is None and r.status is FileStatus.SKIPPED):
            stale += 1
            sys.stdout.write(unified_diff(current, r.new_code, f"a/{shown}", f"b/{shown} (regenerated)"))
    if stale:
        again = f"adapter-gen {directory} --dialect vllm " + (f"--out {out}" if out is not None else "--in-place")
        print(f"{PROG}: {stale} file(s) under {out or directory} not up to date; regenerate with `{again}`",
              file=sys.stderr)
        return 1
    return 0
