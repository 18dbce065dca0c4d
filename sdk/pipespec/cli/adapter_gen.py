"""``adapter-gen`` (also ``pipespec adapter-gen``): adapt a model source file, or scaffold a new adapter.

    adapter-gen FILE [--class NAME] [--dialect hf|vllm|pipespec|sglang] [--spec FILE] [--residual-rule reads|rebinds]
                [--diff | --out FILE | --in-place | --check]
    adapter-gen DIR [--dialect vllm] [--residual-rule reads|rebinds] [--diff | --out DIR2 | --in-place | --check]
    adapter-gen --hf MODEL_TYPE [--class NAME] [--spec FILE] [--diff | --out FILE | --check]
    adapter-gen new MODEL_TYPE [--out-dir DIR] [--force]

Dialects: ``vllm`` (detected for vLLM-style files) emits vLLM >= 0.32's own EAGLE3-over-PP contract, for
every PP decoder of FILE or the one ``--class`` names (a decoder or its ``*ForCausalLM``); ``pipespec``
emits vLLM-style source run by pipespec's own runtime (``AuxHiddenStatesMixin``); ``hf`` adapts
transformers modeling code. ``--class`` is required for ``hf`` and ``pipespec``.

``--residual-rule reads|rebinds`` (vllm dialect; also ``model.residual_rule`` in a vllm-dialect spec)
states whether a decoder layer reads the residual it is given (vLLM's pre-norm convention) or rebinds it
first, for files whose layer classes cannot be found from the source (layers injected through
``__init__``); where they are found, a rule they contradict declines the decoder.

A directory (vllm dialect): every ``*.py`` under DIR (sorted; hidden and ``__pycache__`` directories
skipped) with a PP decoder is adapted as FILE would be, each file resolving its imports from its own place.
``--diff`` prints every changed file's diff; ``--in-place`` rewrites the changed files; ``--out DIR2``
writes a copy of DIR's ``*.py`` files at the same relative paths (adapted where adapted, the others
byte-identical, so DIR2 imports as DIR did; DIR2 is created if its parent exists, and may not be DIR or
inside it); ``--check`` exits 1 when a file (or, with ``--out``, its copy in DIR2) is not up to date.
Every output is computed before anything is written. Exit 1 also when a file with a PP decoder had every
decoder declined (each reason is printed); ``--class`` and ``--spec`` name one file's classes: give FILE.

Modes: ``--diff`` (default) prints a unified diff and writes nothing; ``--out FILE`` writes the adapted
module there; ``--in-place`` rewrites FILE; ``--check`` exits 1 when FILE (or, with ``--out``, the
generated OUT) is not up to date. Exit codes: 0 ok, 1 check failed or class skipped (its shape is not
understood: the reason is printed), 2 usage error (one line naming the flag, file or value, and the fix).
Writes are atomic: a temp file next to the target, then ``os.replace``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipespec.contract.spec import DIALECTS, RESIDUAL_RULES
from pipespec.errors import UsageError

if TYPE_CHECKING:  # codegen imports libcst: loaded only when a command needs it
    from pipespec.codegen.source import Target
    from pipespec.codegen.transform import Outcome

HELP = "adapt a model's forward for aux hidden states over PP (vLLM-style or HF code), or scaffold a new adapter"
PROG = "adapter-gen"
USAGE = (
    "adapter-gen FILE [--class NAME] [--dialect {hf,vllm,pipespec,sglang}] [--spec FILE] [--residual-rule {reads,rebinds}]\n"
    "                   [--diff | --out FILE | --in-place | --check]\n"
    "       adapter-gen DIR [--dialect vllm] [--residual-rule {reads,rebinds}] [--diff | --out DIR2 | --in-place | --check]\n"
    "       adapter-gen --hf MODEL_TYPE [--class NAME] [--spec FILE] [--diff | --out FILE | --check]\n"
    "       adapter-gen new MODEL_TYPE [--out-dir DIR] [--force]"
)
EPILOG = "exit codes: 0 ok; 1 --check found the file out of date, or the class was skipped; 2 usage error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    parser.epilog = EPILOG
    parser.add_argument("target", nargs="*", metavar="FILE | new MODEL_TYPE", help="model source file, or `new MODEL_TYPE`")
    parser.add_argument("--class", dest="class_name", metavar="NAME",
                        help="the decoder-stack class to adapt (vllm dialect: or its *ForCausalLM; default every PP decoder)")
    parser.add_argument("--hf", metavar="MODEL_TYPE", help="adapt the installed transformers modeling module of MODEL_TYPE")
    parser.add_argument("--dialect", choices=(*DIALECTS, "sglang"),
                        help="source dialect (default: detected from the forward signature; sglang: an SGLang model file)")
    parser.add_argument("--spec", metavar="FILE", help="adapter spec TOML (default: registry lookup, else inferred)")
    parser.add_argument("--residual-rule", choices=RESIDUAL_RULES,
                        help="vllm dialect: a layer reads the residual it is given (reads) or rebinds it first (rebinds); "
                             "for layer classes that cannot be found from the source")
    parser.add_argument("--diff", action="store_true", help="print a unified diff, write nothing (the default)")
    parser.add_argument("--out", metavar="FILE", help="write the adapted module to FILE")
    parser.add_argument("--in-place", action="store_true", help="rewrite FILE itself")
    parser.add_argument("--check", action="store_true", help="exit 1 if FILE (or --out FILE) is not up to date")
    parser.add_argument("--out-dir", metavar="DIR", help="`new`: where adapters/ and tests/ are written (default: .)")
    parser.add_argument("--force", action="store_true", help="`new`: write even if the type already has a spec")


def _conflict(a: str, b: str, fix: str) -> UsageError:
    return UsageError(f"{a} cannot be combined with {b}: {fix}")


def run(args: argparse.Namespace) -> int:
    if args.target and args.target[0] == "new":
        return _run_new(args)
    for flag, value in (("--out-dir", args.out_dir), ("--force", args.force)):
        if value:
            raise UsageError(f"{flag} only applies to `adapter-gen new MODEL_TYPE`")
    if args.dialect == "sglang":
        from pipespec.cli.adapter_gen_sglang import run_sglang

        return run_sglang(args)
    if len(args.target) == 1 and Path(args.target[0]).is_dir():
        from pipespec.cli.adapter_gen_dir import run_dir

        return run_dir(args)
    return _run_adapt(args)


# ------------------------------------------------------------------------------------ adapt
def _run_adapt(args: argparse.Namespace) -> int:
    from pipespec.atomic_write import write_atomic
    from pipespec.codegen.decide import resolve_spec
    from pipespec.codegen.transform import AdaptStatus, adapt_target
    from pipespec.codegen.write import unified_diff
    from pipespec.codemods.vllm_native_status import DecoderStatus

    modes = [f for f, on in (("--diff", args.diff), ("--in-place", args.in_place), ("--check", args.check)) if on]
    if len(modes) > 1:
        raise _conflict(modes[0], modes[1], "choose one mode (--diff, --out FILE, --in-place or --check)")
    if args.out is not None and modes and modes[0] != "--check":
        raise _conflict("--out", modes[0], "choose one mode (--diff, --out FILE, --in-place or --check [--out FILE])")
    target, dialect = _target_and_dialect(args)
    if args.residual_rule is not None and dialect != "vllm":
        raise UsageError(f"--residual-rule {args.residual_rule}: applies to the vllm dialect only, and {target.label} "
                         f"is adapted as {dialect}: drop it, or pass a vLLM model file (--dialect vllm)")
    if args.out is not None and not args.check:
        parent = Path(args.out).parent
        if not parent.is_dir():
            raise UsageError(f"--out {args.out}: directory {parent} does not exist; create it or choose another --out path")
    spec = resolve_spec(target, dialect, args.spec)
    if spec is not None and spec.residual_rule is not None and args.residual_rule not in (None, spec.residual_rule):
        raise UsageError(f"--residual-rule {args.residual_rule} contradicts spec {spec.name} ({spec.source}): "
                         f"model.residual_rule = {spec.residual_rule!r}; drop one of the two")
    if spec is not None and spec.dialect != dialect:
        print(f"{PROG}: warning: spec {spec.name} ({spec.source}) is for the {spec.dialect} dialect; "
              f"the source is adapted as {dialect}", file=sys.stderr)
    write_to = Path(args.out) if args.out else (target.path if args.in_place else None)
    outcome = adapt_target(target, dialect, spec, regenerate=_regenerate_command(args, target),
                           out=Path(args.out) if args.out else None, residual_rule=args.residual_rule)
    for warning in outcome.warnings:
        print(f"{PROG}: warning: {target.label}: {warning}", file=sys.stderr)

    if outcome.status is AdaptStatus.SKIPPED:
        print(f"{PROG}: skipped {target.label}: {outcome.reason}", file=sys.stderr)
        return 1
    if args.check:
        return _check(args, target, outcome)
    if outcome.status is AdaptStatus.UNCHANGED:
        print(f"{PROG}: {target.label}: {outcome.reason}; nothing to do", file=sys.stderr)
        if write_to is None or write_to == target.path:
            return 0
    if write_to is None:
        sys.stdout.write(unified_diff(target.code, outcome.code, f"a/{target.label.split(' ')[0]}",
                                      f"b/{target.label.split(' ')[0]}"))
        return 0
    write_atomic(write_to, outcome.code)
    what = target.class_name or ", ".join(d.class_name for d in outcome.decoders if d.status is DecoderStatus.ADAPTED)
    print(f"{PROG}: wrote {write_to} ({what}, {outcome.dialect} dialect, spec {outcome.spec_label})", file=sys.stderr)
    return 0


def _target_and_dialect(args: argparse.Namespace) -> tuple[Target, str]:
    """The source to adapt (FILE, or ``--hf MODEL_TYPE``'s installed module) and its dialect."""
    from pipespec.codegen.decide import detect_module_dialect
    from pipespec.codegen.source import load_hf_target, load_target

    if args.hf is not None:
        if args.target:
            raise _conflict("--hf", f"a source file ({args.target[0]})", "give either FILE --class NAME or --hf MODEL_TYPE")
        if args.in_place:
            raise UsageError("--in-place with --hf would rewrite the installed transformers: use --out FILE")
        if args.dialect in ("vllm", "pipespec"):
            raise UsageError(f"--dialect {args.dialect} with --hf: installed transformers modules are the hf dialect")
        return load_hf_target(args.hf, args.class_name), "hf"
    if not args.target:
        raise UsageError("no source file: give FILE --class NAME, --hf MODEL_TYPE, or `new MODEL_TYPE` (see --help)")
    if len(args.target) > 1:
        raise UsageError(f"one source file at a time, got {len(args.target)}: {' '.join(args.target)}")
    target = load_target(args.target[0], args.class_name)
    dialect = args.dialect or detect_module_dialect(target.module)
    if target.class_name is None and dialect != "vllm":
        raise UsageError(f"{args.target[0]}: --class NAME is required for the {dialect} dialect "
                         "(the decoder-stack class to adapt)")
    return target, dialect


def _check(args: argparse.Namespace, target: Target, outcome: Outcome) -> int:
    """``--check``: is FILE adapted (no ``--out``), or is OUT what regenerating would write?"""
    from pipespec.codegen.source import read_text
    from pipespec.codegen.transform import AdaptStatus
    from pipespec.codegen.write import unified_diff

    if args.out is None:
        if outcome.status is AdaptStatus.UNCHANGED:
            return 0
        sys.stdout.write(unified_diff(target.code, outcome.code, f"a/{target.label}", f"b/{target.label}"))
        print(f"{PROG}: {target.label}: {target.class_name or 'its PP decoders'} not adapted; run "
              f"`{_regenerate_command(args, target, '--in-place')}`", file=sys.stderr)
        return 1
    out = Path(args.out)
    if not out.exists():
        print(f"{PROG}: {args.out} does not exist; create it with `{_regenerate_command(args, target)}`", file=sys.stderr)
        return 1
    current = read_text(out, "--out file")
    if current == outcome.code:
        return 0
    sys.stdout.write(unified_diff(current, outcome.code, f"a/{args.out}", f"b/{args.out} (regenerated)"))
    print(f"{PROG}: {args.out} is not up to date with {target.label}; regenerate it with `{_regenerate_command(args, target)}`",
          file=sys.stderr)
    return 1


def _regenerate_command(args: argparse.Namespace, target: Target, mode: str | None = None) -> str:
    """The command line that reproduces this output, written into the header (stable across cwd)."""
    from pipespec.codegen.source import project_label

    words = ["adapter-gen"]
    if args.hf is not None:
        words += ["--hf", args.hf]
        if args.class_name:
            words += ["--class", args.class_name]
    else:
        words += [target.label] + (["--class", target.class_name] if target.class_name else [])
    if args.dialect and args.hf is None:
        words += ["--dialect", args.dialect]
    if args.spec:
        words += ["--spec", project_label(Path(args.spec))]
    if args.residual_rule:
        words += ["--residual-rule", args.residual_rule]
    if mode is not None:
        words.append(mode)
    elif args.out is not None:
        words += ["--out", project_label(Path(args.out))]
    else:
        words.append("--in-place" if args.hf is None else "--out FILE")
    return " ".join(shlex.quote(w) if w != "--out FILE" else w for w in words)


# ------------------------------------------------------------------------------------ new
def _run_new(args: argparse.Namespace) -> int:
    from pipespec.codegen.scaffold import scaffold_adapter

    for flag, value in (("--class", args.class_name), ("--hf", args.hf), ("--dialect", args.dialect),
                        ("--spec", args.spec), ("--residual-rule", args.residual_rule), ("--out", args.out), ("--diff", args.diff),
                        ("--in-place", args.in_place), ("--check", args.check)):
        if value:
            raise UsageError(f"{flag} does not apply to `adapter-gen new MODEL_TYPE` (it takes --out-dir DIR and --force)")
    if len(args.target) != 2:
        raise UsageError("`adapter-gen new` takes exactly one MODEL_TYPE, e.g. `adapter-gen new olmo2`")
    result = scaffold_adapter(args.target[1], Path(args.out_dir or "."), force=args.force)
    for warning in result.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    for path in result.written:
        print(f"wrote {path}")
    # The generated test runs under pytest with pytest-timeout: the `test` extra installs both.
    print(f"next: pytest -q {result.test_path}   (needs pytest and pytest-timeout: pip install 'pipespec[test]')")
    print(f"      {result.verify_command}")
    return 0


# ------------------------------------------------------------------------------------ console script
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    from pipespec.cli import run_command

    parser = _Parser(prog=PROG, description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_command(run, args, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
