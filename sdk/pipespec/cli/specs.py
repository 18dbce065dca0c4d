"""``pipespec specs``: list the registry — architecture, decoder class, source file, supported."""

from __future__ import annotations

import argparse
import json

from pipespec.contract.registry import default_registry

HELP = "list adapter specs in the registry (built-in, PIPESPEC_ADAPTERS_PATH, decorators)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list")


def run(args: argparse.Namespace) -> int:
    rows = []
    for entry in default_registry().entries():
        s = entry.spec
        rows.append({
            "name": s.name,
            "architectures": list(s.architectures),
            "decoder_class": s.decoder_class,
            "dialect": s.dialect,
            "origin": entry.origin,
            "source": s.source,
            "supported": s.supported,
            "boundary_rule": s.boundary_rule,
            "reason": s.reason,
        })
    if args.json:
        print(json.dumps(rows))
        return 0
    table = [("architecture", "decoder class", "supported", "origin", "source")]
    for r in rows:
        supported = "yes" if r["supported"] else f"no ({r['reason']})"
        table.append((",".join(r["architectures"]) or "-", r["decoder_class"], supported, r["origin"], r["source"]))
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t[:4], widths)) + "  " + t[4])
    return 0
