"""P3 — speculative decoding speedup: tokens/s with EAGLE3 ÷ tokens/s with ``--num-spec-tokens 0``.

Measured end to end through the real CLI, ``pipespec generate --pp 2`` (stage processes, gloo on CPU,
NCCL on two GPUs): a subprocess in a full CPU run; with ``--quick`` and on CUDA the CLI's entry point
called in this process (a fresh interpreter per run does not fit those time budgets). The pair is the
trained demo shipped in ``pipespec.demo`` (a constructed agreeing pair from ``pipespec.engine.testing``
when the demo is absent), or with ``--pair DIR`` a pair ``bench/train_demo.py`` wrote (e.g. its
``--preset medium``, a 51M target trained on the device for a GPU run); the prompts are held-out ones
from the Python standard library (the corpus of both; files they never trained on). Each run's raw
``generate`` JSON is appended to ``OUT/p3_runs.jsonl`` as it completes (with ``--out``). Concurrency c = the
number of prompts in one ``--prompts-file`` run; every run decodes exactly M new
tokens per prompt (``--ignore-eos``); tokens/s is the engine's own figure (decoding only, after its
warm-up). Speedup = tokens/s(k) ÷ tokens/s(0) at the same c; a full CPU run repeats the whole sweep
3 times, interleaved, and uses the medians (``--quick`` and CUDA runs once, for their time budgets).

On CUDA it adds a **projection** for a Llama-3-70B-shaped target (80 layers, H=8192, bf16), from step
costs measured on one GPU: a decoder layer's forward at B·(k+1) tokens vs B tokens (weights-bound at
these sizes; the attention over the KV context is left out: ~4 MB per layer at 1k context vs 1.7 GB
of weights), the lm_head over 128k tokens, and a 70B-shaped EAGLE3 draft's ``propose`` of k tokens;
with a public acceptance length τ(3) = 3 (EAGLE3 on Llama-3.3-70B, chain drafts) and a geometric
per-token acceptance α fitted to it (τ(k) = (1 − α^(k+1)) / (1 − α)). Goal (issue 5): ≥ 2.3× at c = 1
on GPU, never below 1.0× at any c.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipespec.bench.common import (
    Result,
    append_jsonl,
    cli_json,
    describe_pair,
    device_name,
    heldout_prompts,
    pair_dirs,
    print_table,
    save_plot,
    write_json,
)
from pipespec.bench.run_order import balanced_order, lead_in

NAME = "p3"
DESCRIPTION = "speedup: tokens/s with EAGLE3 / with --num-spec-tokens 0, PP=2 (plus a 70B projection on GPU)"
CPU_FEASIBLE = True
GOAL_GPU_C1 = 2.3
PUBLIC_TAU_K3 = 3.0
GPU_RUNS_BUDGET_S = 150.0  # `pipespec bench all --device cuda` has to fit one ~8-minute device call


def _repeats(quick: bool, device: str) -> int:
    """Interleaved repeats of the whole sweep (medians are reported): 3 on a full CPU run, where a shared
    machine moves single runs by +-20 %; 1 with --quick (the CI budget) and on CUDA (the one-call budget)."""
    return 1 if quick or device == "cuda" else 3


def _sweep(quick: bool, device: str) -> tuple[list[tuple[int, int, str]], int]:
    """(c, k, spec policy) runs (k = 0 before the other k of the same c) and new tokens per prompt.

    Every k > 0 runs with ``--spec-policy always`` (drafting every step: the speedup of speculation
    itself); k = 3 also with ``adaptive`` (the default, which falls back to plain decoding while that
    is measured faster: the goal "never below 1.0x at any c" is about it).
    """
    core = [(1, 0, "always"), (1, 3, "always"), (1, 3, "adaptive"), (8, 0, "always"), (8, 3, "always"),
            (8, 3, "adaptive")]
    if device == "cuda":
        runs = core + [(1, 1, "always"), (1, 5, "always")]  # the goal's runs first (time budget)
        return (runs if not quick else core), 192  # long enough for the adaptive policy to amortise its probing
    if quick:
        return core, 32
    return ([(c, k, "always") for c in (1, 8) for k in (0, 1, 3, 5)] + [(1, 3, "adaptive"), (8, 3, "adaptive")]
            + list(policy_runs((32,))), 96)


CONTROL = "control"  # an A/A control: ``always`` (k = 3) run again as a variant of its own


def policy_runs(cs: Sequence[int], control: bool = False) -> list[tuple[int, int, str]]:
    """The runs behind the policy rows: plain decoding, k = 3 ``always`` and k = 3 ``adaptive`` at each c
    (and with ``control`` k = 3 ``always`` once more, as ``CONTROL``: its ratio to ``always`` is the noise
    floor of a row)."""
    variants = ((0, "always"), (3, "always"), (3, "adaptive")) + (((3, CONTROL),) if control else ())
    return [(c, k, policy) for c in cs for k, policy in variants]


def interleaved(runs: Sequence[tuple[int, int, str]], repeats: int) -> list[tuple[tuple[int, int, str], bool]]:
    """``(run, measured)`` pairs: ``runs`` ``repeats`` times, one c after another, each c's variants in a
    carry-over balanced order (``pipespec.bench.run_order``: every variant at every place, and after every other
    variant, equally often) after one unmeasured lead-in run of the same c (with ``repeats`` > 1).

    Order effects, not the variants' own: a variant that always ran third after two others measured ~10 %
    slower on one H200 in every repeat (the same rounds, every phase slower); on the 2-core CPU adaptive,
    right after ``always`` in every repeat, measured 0.86x it on the same rounds. Before, the c's took turns
    within a repeat, so the first variant of each c ran after another c's run: at c = 1 on one H200
    ``always`` followed a plain run at c = 32 5 times of 9."""
    by_c: dict[int, list[tuple[int, int, str]]] = {}
    for run in runs:
        by_c.setdefault(run[0], []).append(run)
    order: list[tuple[tuple[int, int, str], bool]] = []
    for group in by_c.values():
        perms = balanced_order(len(group), repeats)
        if repeats > 1 and len(group) > 1:
            order.append((group[lead_in(perms)], False))
        order += [(group[i], True) for perm in perms for i in perm]
    return order


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in values) + "]"


def _pair(work: Path, pair: Path | None = None) -> tuple[Path, Path, str]:
    """(target dir, draft dir, what it is): ``pair`` when given, else the shipped demo pair, else a
    constructed agreeing pair."""
    if pair is not None:
        target, draft = pair_dirs(pair)
        return target, draft, describe_pair(pair)
    from pipespec.demo import demo_available, demo_draft_dir, demo_target_dir

    if demo_available():
        return demo_target_dir(), demo_draft_dir(), "trained demo pair (pipespec.demo)"
    from pipespec.engine.tiny_checkpoints import write_agreeing_pair

    target, draft, _ = write_agreeing_pair(work / "target", work / "draft", vocab_size=48, num_layers=4)
    return target, draft, "constructed agreeing pair (pipespec.engine.testing; no demo shipped)"


def _prompts(target: Path, count: int) -> list[dict[str, Any]]:
    """``count`` held-out stdlib prompts of 48 tokens (the pair's tokenizer), else seeded random ids."""
    ids = heldout_prompts(target, count, 48)
    if ids is not None:
        return [{"prompt_ids": p} for p in ids]
    import torch

    config = json.loads((target / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_ids": torch.randint(0, int(config["vocab_size"]), (16,), generator=gen).tolist()} for _ in range(count)]


def _generate(target: Path, draft: Path, prompts_file: Path, k: int, new_tokens: int, device: str,
              in_process: bool, extra: Sequence[str] = (), pp: int = 2) -> dict[str, Any]:
    """One ``pipespec generate --json`` run: a subprocess, or (``in_process``) the same CLI entry point
    called here, which reuses this process's warm stage forkserver instead of importing torch again.
    ``extra``: further ``generate`` options (a variant of the engine's settings)."""
    args = ["generate", "--target", str(target), "--draft", str(draft),
           "--pp", str(pp), "--prompts-file", str(prompts_file), "--max-new-tokens", str(new_tokens),
           "--num-spec-tokens", str(k), "--ignore-eos", "--device", device, "--json", *extra]
    if in_process:
        return cli_json(args, f"pipespec generate (k={k})")
    cmd = [sys.executable, "-c", "import sys; from pipespec.cli import main; sys.exit(main())", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"pipespec generate (k={k}) exited with {proc.returncode}: {tail}")
    return json.loads(proc.stdout)


def _count(run: tuple[int, int, str], generated: dict[str, Any], measured: dict[int, dict[tuple[int, str], dict[str, Any]]],
           rates: dict[tuple[int, int, str], list[float]], traces: dict[int, list[dict[str, Any]]]) -> None:
    """One measured run into the tallies: the first repeat's outputs and stats, its tokens/s, and (adaptive)
    its decision trace."""
    c, k, policy = run
    measured.setdefault(c, {}).setdefault((k, policy), generated)
    rates.setdefault(run, []).append(float(generated["tokens_per_s"]))
    if policy == "adaptive" and "policy_trace" in generated:
        traces.setdefault(c, []).append(generated["policy_trace"])


def run(quick: bool, device: str, command: str, pair: Path | None = None) -> list[Result]:
    runs, new_tokens = _sweep(quick, device)
    return measure(runs, new_tokens, _repeats(quick, device), device, command, pair,
                   in_process=quick or device == "cuda", budget_s=GPU_RUNS_BUDGET_S if device == "cuda" else None)


def measure(runs: Sequence[tuple[int, int, str]], new_tokens: int, repeats: int, device: str, command: str,
            pair: Path | None = None, *, in_process: bool, budget_s: float | None = None, pp: int = 2,
            speedups: bool = True) -> list[Result]:
    """Every (c, k, policy) run ``repeats`` times, interleaved; speedup rows (with ``speedups``), the
    policy rows where a c has all three of ``policy_runs``, a plot under ``$PIPESPEC_BENCH_OUT``."""
    dev = device_name(device)
    out_dir = os.environ.get("PIPESPEC_BENCH_OUT")
    results: list[Result] = []
    measured: dict[int, dict[tuple[int, str], dict[str, Any]]] = {}
    rates: dict[tuple[int, int, str], list[float]] = {}  # tokens/s of every repeat
    traces: dict[int, list[dict[str, Any]]] = {}  # the adaptive runs' decision traces, per c
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        work = Path(tmp)
        target, draft, what = _pair(work, pair)
        prompts = _prompts(target, max(c for c, _, _ in runs))
        started = time.perf_counter()
        for (c, k, policy), counted in interleaved(runs, repeats):
            if budget_s is not None and time.perf_counter() - started > budget_s and k and (0, "always") in measured.get(c, {}):
                print(f"p3: skipping c={c} k={k} {policy}: the measured runs took over {budget_s:.0f} s "
                      "(the one-call GPU budget)", file=sys.stderr)
                continue
            path = work / f"prompts_{c}.jsonl"
            if not path.exists():
                path.write_text("".join(json.dumps(p) + "\n" for p in prompts[:c]))
            # --quick (CPU CI budget) and CUDA (the one-call GPU budget) call the CLI's entry point in this
            # process, reusing the warm stage forkserver; a full CPU run starts it as a subprocess.
            generated = _generate(target, draft, path, k, new_tokens, device, in_process,
                                  extra=("--spec-policy", "always" if policy == CONTROL else policy), pp=pp)
            if out_dir:
                append_jsonl(Path(out_dir) / "p3_runs.jsonl", {"c": c, "k": k, "spec_policy": policy, "new_tokens": new_tokens,
                                                               "device": device, "machine": dev, "pp": pp, "pair": what,
                                                               "lead_in": not counted,
                                                               "generate": generated})
            if not counted:  # the lead-in: the first measured run of this c has a run of this c before it
                continue
            _count((c, k, policy), generated, measured, rates, traces)
    results += policy_results(rates, traces, measured, new_tokens, what, dev, command, pp)
    if not speedups:
        return results
    series: dict[str, tuple[list[float], list[float]]] = {}
    for c, by_k in measured.items():
        base = by_k[0, "always"]
        base_rate = statistics.median(rates[c, 0, "always"])
        plain_ids = [o["output_ids"] for o in base["outputs"]]
        for (k, policy), res in sorted(by_k.items()):
            if k == 0 or policy == CONTROL:
                continue
            rate = statistics.median(rates[c, k, policy])
            speedup = rate / base_rate
            spread = (f" (medians of {repeats} interleaved runs: {_fmt(rates[c, k, policy])} vs {_fmt(rates[c, 0, 'always'])})"
                      if repeats > 1 else "")
            same = [o["output_ids"] for o in res["outputs"]] == plain_ids
            goal = GOAL_GPU_C1 if device == "cuda" and c == 1 else 1.0
            suffix = "" if policy == "always" else f".{policy}"
            rounds = (f", {res.get('spec_rounds', 0)} speculative / {res.get('plain_rounds', 0)} plain rounds "
                      f"(measured rates {res.get('policy_rates')})" if policy == "adaptive" else "")
            results.append(Result(
                f"P3.speedup.c{c}.k{k}{suffix}", speedup, f">= {goal:g}", "x", speedup >= goal, dev, command,
                detail=(f"--spec-policy {policy}: {rate:.1f} vs {base_rate:.1f} tokens/s{spread}, mean "
                        f"acceptance length {res['mean_acceptance_length']:.2f}{rounds}, {new_tokens} new tokens x {c} "
                        f"prompts, outputs {'identical to' if same else 'DIFFER from'} plain decoding; {what}"),
            ))
            if policy != "always":
                continue
            results.append(Result(f"P3.acceptance.c{c}.k{k}", float(res["mean_acceptance_length"]), "-", "tokens/step",
                                  None, dev, command, detail="mean accepted drafts + 1 per verify step"))
            xs, ys = series.setdefault(f"measured c={c}", ([], []))
            xs.append(k)
            ys.append(speedup)
    if device == "cuda":
        import torch

        projected = project_70b(sorted({k for _, k, _ in runs if k} | {1, 3, 5}), sorted(measured), command)
        torch.cuda.empty_cache()  # the projection's models are gone; give their memory back for later benches
        results += projected
        for r in projected:
            if r.id.startswith("P3.projection_70b.speedup."):
                c = int(r.id.split(".c")[1].split(".")[0])
                k = int(r.id.rsplit(".k", 1)[1])
                xs, ys = series.setdefault(f"projection 70B c={c}", ([], []))
                xs.append(k)
                ys.append(r.value)
    if out_dir and series:
        save_plot(Path(out_dir) / f"p3_speedup_{device}.png", f"P3 speedup vs k ({device}, PP=2)", "k (draft tokens per step)",
                  "tokens/s with EAGLE3 / plain", series, hline=1.0)
    return results


POLICY_GOAL = 0.97  # issue 16: adaptive >= 0.97 x the better fixed choice


def _paired(runs: Sequence[float], *fixed: Sequence[float]) -> float | None:
    """The median over repeats of ``runs`` ÷ the best of ``fixed`` within one repeat (the runs next to each
    other in time, so a drift of the machine between repeats cancels); None when a run was skipped."""
    if not runs or any(len(f) != len(runs) for f in fixed):
        return None
    return statistics.median(r / max(f) for r, *f in zip(runs, *fixed))


def policy_results(rates: dict[tuple[int, int, str], list[float]], traces: dict[int, list[dict[str, Any]]],
                   measured: dict[int, dict[tuple[int, str], dict[str, Any]]], new_tokens: int, what: str,
                   dev: str, command: str, pp: int) -> list[Result]:
    """``P3.policy.c{c}``: the median tokens/s of ``--spec-policy adaptive`` (k = 3) ÷ the better of the
    medians of ``always`` (k = 3) and plain decoding (k = 0), with the decision trace's rounds per mode."""
    results: list[Result] = []
    for c in sorted(measured):
        keys = [(c, 3, "adaptive"), (c, 3, "always"), (c, 0, "always")]
        if not all(key in rates for key in keys):
            continue
        adaptive, always, plain = (statistics.median(rates[key]) for key in keys)
        best = max(always, plain)
        ratio = adaptive / best
        paired = _paired(*(rates[key] for key in keys))
        runs = traces.get(c, [])
        spec_rounds = [t["spec_rounds"] for t in runs]
        plain_rounds = [t["plain_rounds"] for t in runs]
        reasons = sorted({d["reason"].split(":")[0] for t in runs for d in t["trace"]})
        same = ([o["output_ids"] for o in measured[c][3, "adaptive"]["outputs"]]
                == [o["output_ids"] for o in measured[c][0, "always"]["outputs"]])
        control_key = (c, 3, CONTROL)
        control = ""
        if control_key in rates:
            noise = statistics.median(rates[control_key]) / always
            noise_paired = _paired(rates[control_key], rates[keys[1]])
            control = (f"; the A/A control (always run again as a variant of its own) reads {noise:.3f} "
                       f"(paired {'n/a' if noise_paired is None else f'{noise_paired:.3f}'})")
            results.append(Result(
                f"P3.control.c{c}" + ("" if pp == 2 else f".pp{pp}"), noise, "-", "x", None, dev, command,
                detail=(f"A/A: the median tokens/s of --spec-policy always (k=3) run again as a variant of its own "
                        f"÷ always's, the same interleaving: how far apart two identical variants measure in this run, "
                        f"the noise floor of the policy row (control {_fmt(rates[control_key])}, always "
                        f"{_fmt(rates[keys[1]])}; paired: {'n/a' if noise_paired is None else f'{noise_paired:.3f}'}); "
                        f"{new_tokens} new tokens x {c} prompts, PP={pp}; {what}"),
            ))
        results.append(Result(
            f"P3.policy.c{c}" + ("" if pp == 2 else f".pp{pp}"), ratio, f">= {POLICY_GOAL:g}", "x", ratio >= POLICY_GOAL,
            dev, command,
            detail=(f"adaptive {adaptive:.1f} / max(always {always:.1f}, plain {plain:.1f}) tokens/s, k=3, PP={pp} "
                    f"(medians of {len(rates[keys[0]])} interleaved: adaptive {_fmt(rates[keys[0]])}, always {_fmt(rates[keys[1]])}, "
                    f"plain {_fmt(rates[keys[2]])}; paired, the median of each repeat's adaptive ÷ its better fixed "
                    f"run: {'n/a' if paired is None else f'{paired:.3f}'}); "
                    f"adaptive rounds speculative {spec_rounds} / plain {plain_rounds}, "
                    f"switches {[t['switches'] for t in runs]}, load changes {[t.get('load_changes', 0) for t in runs]} "
                    f"(settled by drafting's acceptance, no plain round: {[t.get('load_checks', 0) for t in runs]}), "
                    f"decisions: {'; '.join(reasons) or 'none'}; "
                    f"{new_tokens} new tokens x {c} prompts, outputs {'identical to' if same else 'DIFFER from'} plain "
                    f"decoding; {what}{control}"),
        ))
    return results


POOLED_FIELDS = ("new_tokens", "pp", "device", "pair")  # what every pooled run must share


def pooled(paths: Sequence[Path], command: str) -> list[Result]:
    """The policy rows over the measured runs of several ``p3_runs.jsonl`` files (calls of this script with
    the same settings; lead-in runs left out): one call's 12 repeats leave a row's A/A control at 0.90–1.11
    on one H200, so a verdict within a few percent pools calls. Raises ``ValueError`` naming the file and
    line of a run that cannot be read or does not share ``POOLED_FIELDS`` with the first."""
    rates: dict[tuple[int, int, str], list[float]] = {}
    traces: dict[int, list[dict[str, Any]]] = {}
    measured: dict[int, dict[tuple[int, str], dict[str, Any]]] = {}
    first: dict[str, Any] | None = None
    machines: set[str] = set()
    for path in paths:
        try:
            lines = (gzip.decompress(Path(path).read_bytes()).decode() if str(path).endswith(".gz")
                     else Path(path).read_text()).splitlines()
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read it ({exc}); give the p3_runs.jsonl(.gz) of a run of this script") from None
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                c, k, policy, generated = int(row["c"]), int(row["k"]), str(row["spec_policy"]), row["generate"]
                float(generated["tokens_per_s"])  # a run without its rate is not a run
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a run of pipespec.bench.p3_speedup ({type(exc).__name__}: {exc})") from None
            settings = {name: row.get(name) for name in POOLED_FIELDS}
            machines.add(str(row.get("machine") or row.get("device")))  # runs before the "machine" field: the device
            first = first or settings
            if settings != first:
                field = next(name for name in POOLED_FIELDS if settings[name] != first[name])
                raise ValueError(f"{path}:{number}: {field} = {settings[field]!r}, but the first run pooled has "
                                 f"{first[field]!r}; pool only runs of the same settings")
            if row.get("lead_in"):
                continue
            _count((c, k, policy), generated, measured, rates, traces)
    if first is None:
        raise ValueError(f"{', '.join(map(str, paths))}: no runs in them")
    machine = " + ".join(sorted(machines))
    return policy_results(rates, traces, measured, int(first["new_tokens"]), f"{first['pair']}, {len(paths)} calls pooled",
                          machine, command, int(first["pp"]))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipespec.bench.p3_speedup --policy ...``: the policy rows alone, at any PP, c and repeats."""
    import argparse

    parser = argparse.ArgumentParser(description="P3 policy rows: adaptive / the better of always and plain decoding")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (1 = one GPU)")
    parser.add_argument("--c", default="1,8,32", help="concurrencies (prompts per run), comma-separated")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each run")
    parser.add_argument("--pair", type=Path, default=None, help="DIR with target/ and draft/ (default: the demo pair)")
    parser.add_argument("--subprocess", action="store_true",
                        help="a fresh interpreter per run (default: the CLI's entry point called in this process, which "
                             "reuses its warm stage forkserver)")
    parser.add_argument("--control", action="store_true",
                        help="an A/A control: `always` run again as a variant of its own (P3.control rows: the noise floor)")
    parser.add_argument("--pool", type=Path, nargs="+", default=None, metavar="RUNS",
                        help="measure nothing: the policy rows over the runs of these p3_runs.jsonl files (calls with the "
                             "same settings), written to OUT/p3_policy_pooled.json")
    parser.add_argument("--out", required=True, help="directory for p3_policy.json and p3_runs.jsonl")
    args = parser.parse_args(argv)
    command = "python -m pipespec.bench.p3_speedup " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.pool:
        try:
            results = pooled(args.pool, command)
        except ValueError as exc:
            parser.error(str(exc))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print_table(f"P3 policy rows, {len(args.pool)} calls pooled", results)
        write_json(out / "p3_policy_pooled.json", results)
        return 0
    try:
        cs = [int(c) for c in args.c.split(",")]
    except ValueError:
        parser.error(f"--c {args.c!r}: give comma-separated integers, e.g. 1,8,32")
    if min(cs) < 1 or args.pp < 1 or args.tokens < 1 or args.repeats < 1:
        parser.error("--c, --pp, --tokens and --repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PIPESPEC_BENCH_OUT"] = str(out)
    in_process = not args.subprocess
    results = measure(policy_runs(cs, args.control), args.tokens, args.repeats, args.device, command, args.pair, in_process=in_process,
                      pp=args.pp, speedups=False)
    print_table(f"P3 policy rows, PP={args.pp}", results)
    write_json(out / "p3_policy.json", results)
    return 0


# ------------------------------------------------------------------------------------ 70B projection
def acceptance_alpha(tau: float, k: int) -> float:
    """The per-token acceptance α with (1 - α^(k+1)) / (1 - α) = tau (bisection; 0 < α < 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_tau(alpha: float, k: int) -> float:
    return sum(alpha**i for i in range(k + 1))


def _median_ms(fn: Callable[[], Any], device: Any, repeats: int = 15) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class TargetShape:
    """The dimensions the projection measures at (Llama-3-70B by default)."""

    hidden: int = 8192
    intermediate: int = 28672
    heads: int = 64
    kv_heads: int = 8
    vocab: int = 128256
    draft_vocab: int = 32000
    num_layers: int = 80
    context: int = 1024  # tokens already in the draft's KV cache when it proposes


LLAMA_70B = TargetShape()


def project_70b(ks: Sequence[int], cs: Sequence[int], command: str, *, device: str = "cuda",
                shape: TargetShape = LLAMA_70B) -> list[Result]:
    """Speedup of a 70B-shaped target from measured per-layer, lm_head and draft costs (see module doc).

    ``device``/``shape`` exist so the same code runs on CPU at toy sizes in CI (tests/test_bench.py).
    """
    import torch
    from transformers import LlamaConfig, LlamaModel

    from pipespec.engine.draft.config import Eagle3DraftConfig
    from pipespec.engine.draft.model import Eagle3Draft

    if device == "cuda":
        from pipespec.engine.stage.settings import configure_cuda_attention

        configure_cuda_attention()  # as the engine runs: no cuDNN attention plan per new key length
    dev_t = torch.device(device, 0) if device == "cuda" else torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = shape.hidden
    config = LlamaConfig(hidden_size=hidden, intermediate_size=shape.intermediate, num_hidden_layers=6,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=256,
                         max_position_embeddings=4 * shape.context)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev_t):
            stack = LlamaModel(config).eval()
            head = torch.nn.Linear(hidden, shape.vocab, bias=False)
            draft = Eagle3Draft(Eagle3DraftConfig.make(
                hidden_size=hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                intermediate_size=shape.intermediate, vocab_size=shape.vocab, draft_vocab_size=shape.draft_vocab,
                target_hidden_size=hidden, num_aux=3,
            ), with_embedding=True).eval()
    finally:
        torch.set_default_dtype(previous)
    layers = list(stack.layers)
    memo: dict[tuple[str, Any], float] = {}

    def stack_ms(depth: int, tokens: tuple[int, int]) -> float:
        stack.layers = torch.nn.ModuleList(layers[:depth])
        stack.config.num_hidden_layers = depth
        x = torch.randn(*tokens, hidden, device=dev_t, dtype=dtype)
        pos = torch.arange(tokens[1], device=dev_t).expand(tokens[0], -1)
        return _median_ms(lambda: stack(inputs_embeds=x, position_ids=pos, use_cache=False), dev_t)

    def layer_ms(tokens: tuple[int, int]) -> float:
        # Two depths cancel the fixed cost (rotary, mask, final norm); never below zero from noise.
        if ("layer", tokens) not in memo:
            memo["layer", tokens] = max((stack_ms(6, tokens) - stack_ms(2, tokens)) / 4, 0.0)
        return memo["layer", tokens]

    def head_ms(n: int) -> float:
        if ("head", n) not in memo:
            x = torch.randn(n, hidden, device=dev_t, dtype=dtype)
            memo["head", n] = _median_ms(lambda: head(x), dev_t)
        return memo["head", n]

    def draft_ms(batch: int, k: int, verified: int = 3) -> float:
        cache = draft.new_cache(batch, capacity=2 * shape.context)
        ctx_aux = [torch.randn(batch, shape.context, hidden, device=dev_t, dtype=dtype) for _ in range(3)]
        ids = torch.randint(0, shape.vocab, (batch, shape.context), device=dev_t)
        draft.propose(ctx_aux, ids, cache, num_tokens=1)  # the context, in the draft's cache
        aux = [a[:, :verified] for a in ctx_aux]
        return _median_ms(lambda: draft.propose(aux, ids[:, :verified], cache, num_tokens=k), dev_t, repeats=10)

    alpha = acceptance_alpha(PUBLIC_TAU_K3, 3)
    dev = device_name(device)
    out: list[Result] = []
    with torch.inference_mode():
        for c in cs:
            plain = shape.num_layers * layer_ms((c, 1)) + head_ms(c)
            for k in ks:
                tau = expected_tau(alpha, k)
                verify = shape.num_layers * layer_ms((c, k + 1)) + head_ms(c * (k + 1))
                drafting = draft_ms(c, k)
                speedup = tau * plain / (verify + drafting)
                goal = GOAL_GPU_C1 if c == 1 else 1.0
                out.append(Result(
                    f"P3.projection_70b.speedup.c{c}.k{k}", speedup, f">= {goal:g}", "x (projection)", speedup >= goal, dev,
                    command,
                    detail=(f"PROJECTION, not a run: tau {tau:.2f} (public tau(3)={PUBLIC_TAU_K3:g}, alpha {alpha:.3f}) x plain "
                            f"step {plain:.2f} ms / (verify {verify:.2f} ms + draft {drafting:.2f} ms); {shape.num_layers} "
                            f"layers of H={hidden} I={shape.intermediate}, vocab {shape.vocab}, {str(dtype)[6:]}, "
                            "costs measured on one device"),
                ))
    return out


if __name__ == "__main__":
    sys.exit(main())
