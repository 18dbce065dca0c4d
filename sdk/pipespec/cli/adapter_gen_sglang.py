"""``adapter-gen FILE --dialect sglang``: adapt one SGLang model file (``pipespec.codemods.adapt_sglang``).

Modes as for the other dialects: ``--diff`` (default, writes nothing), ``--out FILE``, ``--in-place``,
``--check`` (exit 1 when FILE, or ``--out FILE``, is not what the codemod writes). ``--class NAME`` limits it
to that decoder. Each decoder's verdict goes to stderr with its capture form and id convention. A file with
a declined decoder is written as it is with the reason (exit 1), as the vLLM dialect's skip; bad input is
one line, exit 2, before anything is written. Generated SGLang code carries no header: it stays the
released file plus the marked edits (``# pipespec: ...`` comments), so ``--check`` compares it to a fresh run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipespec.errors import UsageError

PROG = "adapter-gen"


def run_sglang(args: argparse.Namespace) -> int:
    """One SGLang model file through the sglang dialect, written per the mode flags."""
    from libcst import ParserSyntaxError

    from pipespec.atomic_write import write_atomic
    from pipespec.codegen.source import read_text
    from pipespec.codemods.adapt_sglang import adapt_sglang_module
    from pipespec.codemods.sglang_outcome import SglangStatus

    for flag, value in (("--hf", args.hf), ("--spec", args.spec), ("--residual-rule", args.residual_rule)):
        if value is not None:
            raise UsageError(f"{flag} does not apply to --dialect sglang (an SGLang model file is adapted as it is): drop it")
    if not args.target:
        raise UsageError("no source file: give an SGLang model file, e.g. adapter-gen sglang/srt/models/llama.py --dialect sglang")
    if len(args.target) > 1:
        raise UsageError(f"one source file at a time, got {len(args.target)}: {' '.join(args.target)}")
    modes = [f for f, on in (("--diff", args.diff), ("--in-place", args.in_place), ("--check", args.check)) if on]
    if len(modes) > 1 or (args.out is not None and modes and modes[0] != "--check"):
        raise UsageError(f"{modes[0]} and {modes[1] if len(modes) > 1 else '--out'} cannot be combined: choose one mode "
                         "(--diff, --out FILE, --in-place or --check [--out FILE])")
    path = Path(args.target[0])
    if path.suffix != ".py":
        raise UsageError(f"{path}: not a Python model file (give an sglang/srt/models/*.py file)")
    code = read_text(path, "source file")
    if args.out is not None and not args.check and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out {args.out}: directory {Path(args.out).parent} does not exist; create it or choose another --out path")
    try:
        result = adapt_sglang_module(code, label=path.name, classes=[args.class_name] if args.class_name else None)
    except ParserSyntaxError as exc:
        raise UsageError(f"{path}: line {exc.raw_line}: not valid Python ({exc.message}): fix the file") from None
    if args.class_name and not result.decoders:
        raise UsageError(f"--class {args.class_name}: no such class with a pipeline layer loop in its forward in {path}")
    if not result.decoders and not result.setters:
        raise UsageError(f"{path}: no decoder with a pipeline layer loop (range(self.start_layer, self.end_layer)) "
                         "and no set_eagle3_layers_to_capture to adapt: not an SGLang decoder file")
    for row in result.decoders:
        convention = f"; ids: {row.id_convention}" if row.id_convention else ""
        print(f"{PROG}: {path.name}: {row.cls}: {row.status.value} ({row.capture_form.value}{convention}): {row.reason}",
              file=sys.stderr)
    declined = [r for r in result.decoders if r.status is SglangStatus.DECLINED]
    if args.check:
        return _check(args, path, code, result.code)
    if declined:
        print(f"{PROG}: skipped {path}: {declined[0].cls} declined; nothing written", file=sys.stderr)
        return 1
    write_to = Path(args.out) if args.out else (path if args.in_place else None)
    if write_to is None:
        from pipespec.codegen.write import unified_diff

        sys.stdout.write(unified_diff(code, result.code, f"a/{path.name}", f"b/{path.name}"))
        return 0
    if not result.changed and write_to == path:
        print(f"{PROG}: {path}: already adapted; nothing to do", file=sys.stderr)
        return 0
    write_atomic(write_to, result.code)
    print(f"{PROG}: wrote {write_to} (sglang dialect)", file=sys.stderr)
    return 0


def _check(args: argparse.Namespace, path: Path, code: str, adapted: str) -> int:
    from pipespec.codegen.source import read_text
    from pipespec.codegen.write import unified_diff

    current = code if args.out is None else (read_text(Path(args.out), "--out file") if Path(args.out).exists() else None)
    if current is None:
        print(f"{PROG}: {args.out} does not exist; create it with `adapter-gen {path} --dialect sglang --out {args.out}`",
              file=sys.stderr)
        return 1
    if current == adapted:
        return 0
    shown = args.out or str(path)
    sys.stdout.write(unified_diff(current, adapted, f"a/{shown}", f"b/{shown} (regenerated)"))
    fix = f"--out {args.out}" if args.out else "--in-place"
    print(f"{PROG}: {shown} is not up to date; run `adapter-gen {path} --dialect sglang {fix}`", file=sys.stderr)
    return 1
