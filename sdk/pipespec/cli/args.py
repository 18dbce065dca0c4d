"""Argument parsers shared by subcommands: comma-separated int lists and the layout flags."""

from __future__ import annotations

import argparse

from pipespec.contract.layout import BOUNDARY_RULES, LayoutPlan, plan_layout
from pipespec.errors import UsageError


def int_list(text: str) -> list[int]:
    """``"2,16,29"`` → ``[2, 16, 29]`` (argparse type; a bad value is a usage error)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer (expected a comma-separated list like 2,16,29)") from None
    return out


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def add_layout_arguments(parser: argparse.ArgumentParser, num_layers_required: bool = True) -> None:
    parser.add_argument("--num-layers", type=int, required=num_layers_required, metavar="N", help="decoder layers N")
    parser.add_argument("--pp", type=int, required=True, metavar="P", help="pipeline stages P (1 <= P <= N)")
    parser.add_argument("--partition", type=int_list, metavar="C0,C1,...", help="layer count per stage (default: vLLM's rule)")
    parser.add_argument("--aux-layers", type=int_list, metavar="A,B,C", help="aux layer ids (input-index convention, 0..N)")
    parser.add_argument("--boundary-rule", choices=BOUNDARY_RULES, default="allow", help="forbid ids that end a non-last stage")


def layout_from_args(args: argparse.Namespace, num_layers: int | None = None, default_aux: tuple[int, ...] = ()) -> LayoutPlan:
    n = num_layers if num_layers is not None else args.num_layers
    if n is None:
        raise UsageError("--num-layers is required")
    aux = args.aux_layers if args.aux_layers is not None else default_aux
    return plan_layout(n, args.pp, aux_layers=aux, partition=args.partition, boundary_rule=args.boundary_rule)
