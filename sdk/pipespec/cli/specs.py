"""``pipespec specs``: list the registry — architecture, decoder class, supported, origin, source file.

The table fits ``WIDTH`` columns: one line per architecture, the decoder class by its name (its module
is in ``--json``), a built-in spec's file by its name, a longer path shortened from the left, and an
unsupported spec's reason wrapped below its row. ``--json`` prints every field in full.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

from pipespec.contract.registry import default_registry

HELP = "list adapter specs in the registry (built-in, PIPESPEC_ADAPTERS_PATH, decorators)"
WIDTH = 100
HEADER = ("architecture", "decoder class", "supported", "origin", "source")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help='print a JSON list of {"name", "architectures", "decoder_class", "dialect", "origin", '
                             '"source", "supported", "boundary_rule", "reason"}')


def records() -> list[dict[str, Any]]:
    """One dict per effective registry entry, every field in full (the ``--json`` output)."""
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
    return rows


def _left_shortened(text: str, width: int) -> str:
    """``text`` if it fits ``width``, else ``...`` and its last ``width - 3`` characters."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


def format_table(rows: list[dict[str, Any]], width: int = WIDTH) -> str:
    """The registry as a table no wider than ``width`` (see the module docstring for what is shortened)."""
    table: list[tuple[str, ...]] = []
    notes: dict[int, str] = {}  # table row index -> the reason shown under it (a spec's last row)
    for r in rows:
        source = Path(r["source"]).name if r["origin"] == "builtin" else r["source"]
        decoder = r["decoder_class"].rpartition(":")[2]
        archs = r["architectures"] or ["-"]
        table.append((archs[0], decoder, "yes" if r["supported"] else "no", r["origin"], source))
        table += [(arch, "", "", "", "") for arch in archs[1:]]
        if not r["supported"]:
            notes[len(table) - 1] = f"not supported: {r['reason']}"
    widths = [max(len(t[i]) for t in [HEADER, *table]) for i in range(len(HEADER) - 1)]
    lead = sum(widths) + 2 * len(widths)
    lines = []
    for i, t in enumerate([HEADER, *table]):
        cells = "  ".join(c.ljust(w) for c, w in zip(t[:-1], widths))
        lines.append((cells + "  " + _left_shortened(t[-1], max(width - lead, 12))).rstrip())
        if i - 1 in notes:
            lines += textwrap.wrap(notes[i - 1], width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = records()
    print(json.dumps(rows) if args.json else format_table(rows))
    return 0
