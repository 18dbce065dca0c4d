"""Where a decode round's time goes, per stage: ``pipespec generate`` runs side by side, each stage's
``phase_s`` (``pipespec.engine.phases``) as milliseconds per round.

A diagnostic, not a goal: it answers "why is this configuration slower than that one" (for example a
plain round inside a drafting run against a round of a ``--num-spec-tokens 0`` run). Usage::

    python -m pipespec.bench.phases --device cuda --out DIR [--pair DIR] [--c 1,8] [--k 0,3] [--tokens 128]
                                    [--variants "--cuda-graphs off;--cuda-graphs auto"]

``--variants``: ``;``-separated sets of extra ``generate`` options, each run for every (c, k, policy).

Every (c, k, policy) run writes its whole ``generate`` JSON to ``DIR/phases_runs.jsonl`` and the table
to ``DIR/phases.txt``. ``PIPESPEC_PHASE_SYNC=1`` / ``PIPESPEC_PROFILE=DIR`` in the environment apply to
every run (see ``docs/engine.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipespec.bench.common import append_jsonl, cli_json, heldout_prompts, pair_dirs


def _pair(pair: str | None) -> tuple[Path, Path]:
    if pair:
        return pair_dirs(Path(pair))
    from pipespec.cli.demo import shipped_pair

    target, draft = shipped_pair()
    return Path(target), Path(draft)


def _runs(cs: list[int], ks: list[int]) -> list[tuple[int, int, str]]:
    runs = []
    for c in cs:
        for k in ks:
            runs += [(c, k, "always")] if k == 0 else [(c, k, "always"), (c, k, "adaptive")]
    return runs


def table(records: list[dict[str, Any]]) -> str:
    """One block per run: rounds, tokens/s, then each stage's phases in ms per round, largest first."""
    lines = []
    for rec in records:
        gen = rec["generate"]
        rounds = max(1, gen["rounds"])
        variant = f" [{rec['variant']}]" if rec.get("variant") else ""
        head = (f"c={rec['c']} k={rec['k']} {rec['spec_policy']}{variant}: {gen['tokens_per_s']} tokens/s, {gen['rounds']} rounds"
                f" ({gen.get('spec_rounds', 0)} drafting, {gen.get('plain_rounds', gen['rounds'] if not rec['k'] else 0)} plain),"
                f" acceptance {gen['mean_acceptance_length']}")
        lines.append(head)
        for stage in gen["stages"]:
            busy = 1e3 * stage["decode_s"] / rounds
            phases = ", ".join(f"{name} {1e3 * p['s'] / rounds:.3f}" for name, p in stage["phase_s"].items())
            lines.append(f"  stage {stage['rank']}: {busy:.3f} ms/round decode; {phases}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pair", default=None, help="a train_demo output directory (default: the shipped demo pair)")
    parser.add_argument("--c", default="1,8", help="concurrencies (prompts per run)")
    parser.add_argument("--k", default="0,3", help="draft lengths (0: plain decoding)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--variants", default="", help="';'-separated extra generate options, one run each")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft = _pair(args.pair)
    cs = [int(c) for c in args.c.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    prompts = heldout_prompts(target, max(cs), 48)
    if prompts is None:
        raise SystemExit(f"{target}: no tokenizer to cut held-out prompts with")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for (c, k, policy), variant in ((run, v) for run in _runs(cs, ks) for v in args.variants.split(";")):
            path = Path(tmp) / f"prompts_{c}.jsonl"
            path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts[:c]))
            gen = cli_json(["generate", "--target", str(target), "--draft", str(draft), "--pp", "2", "--prompts-file", str(path),
                            "--max-new-tokens", str(args.tokens), "--num-spec-tokens", str(k), "--ignore-eos",
                            "--device", args.device, "--spec-policy", policy, "--json", *variant.split()],
                           f"generate c={c} k={k} {policy} {variant}")
            record = {"c": c, "k": k, "spec_policy": policy, "variant": variant.strip(), "generate": gen}
            append_jsonl(out / "phases_runs.jsonl", record)
            records.append(record)
            print(table([record]), end="", flush=True)
    (out / "phases.txt").write_text(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
