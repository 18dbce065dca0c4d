"""``pipespec layout``: plan a pipeline and show who produces, sends, relays and collects each aux id."""

from __future__ import annotations

import argparse
import json

from pipespec.cli.args import add_layout_arguments, layout_from_args
from pipespec.contract.layout import LayoutPlan

HELP = "plan stages and aux-state slots for N layers over P stages"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help='print the plan as JSON: {"num_layers", "aux_layers" (sorted, unique), "stages": [{"rank", '
                             '"start_layer", "end_layer", "slot_base", "produces" (ids), "sends" (aux keys, relayed first), '
                             '"relays", "collects" (last stage)}]}')


def format_table(plan: LayoutPlan) -> str:
    rows = [("stage", "layers", "slot_base", "produces", "sends", "relays", "collects")]
    for s in plan.stages:
        rows.append((
            str(s.rank),
            f"[{s.start_layer}, {s.end_layer})",
            str(s.slot_base),
            ",".join(map(str, s.produces)) or "-",
            ",".join(k.rsplit("_", 1)[1] for k in s.sends) or "-",
            ",".join(k.rsplit("_", 1)[1] for k in s.relays) or "-",
            ",".join(k.rsplit("_", 1)[1] for k in s.collects) or "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{plan.num_layers} layers, {plan.pp_size} stages, partition {list(plan.partition)}, "
        f"aux ids {list(plan.aux_layers)} (slots 0..{len(plan.aux_layers) - 1}; keys aux_hidden_states_<slot>)",
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    plan = layout_from_args(args)
    print(json.dumps(plan.to_json_dict()) if args.json else format_table(plan))
    return 0
