"""The ``pipespec`` command: one subcommand per module in this package.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Errors derived from ``PipespecError`` become one line on stderr and exit code 1 (2 for usage errors);
argparse's own usage errors exit 2 as well.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from pipespec.errors import PipespecError

# name -> module; order is the order `pipespec --help` lists them.
COMMANDS = {
    "demo": "pipespec.cli.demo",
    "layout": "pipespec.cli.layout",
    "specs": "pipespec.cli.specs",
    "verify": "pipespec.cli.verify",
    "adapter-gen": "pipespec.cli.adapter_gen",
    "zoo": "pipespec.cli.zoo",
    "generate": "pipespec.cli.generate",
    "bench": "pipespec.cli.bench",
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and values such as ``-1,5`` taken as values, not as flags.

    argparse of the Pythons pipespec supports takes a dash-led token as a value only when the whole
    token is one number, so ``--aux-layers -1,5`` failed with "expected one argument" instead of the
    real reason (id -1 is out of range). No pipespec option starts with a dash and a digit, so a token
    that does is a value (the rule newer argparse releases apply).
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pipespec", description="EAGLE3 speculative decoding under pipeline parallelism.")
    parser.add_argument("--version", action="version", version=f"pipespec {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from pipespec import __version__

    return __version__


def run_command(run, args: argparse.Namespace, prog: str = "pipespec") -> int:  # type: ignore[no-untyped-def]
    """Run a subcommand, turning pipespec errors into one stderr line and an exit code."""
    try:
        return int(run(args) or 0)
    except PipespecError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return run_command(args._run, args)


if __name__ == "__main__":
    sys.exit(main())
