"""``pipespec zoo``: verify the HF adaptation over every causal-LM type of the installed transformers.

For each type: build a tiny random float32 model, adapt its decoder with ``pipespec.adapt``, run it as
P in-process stages (default P = 1, 2, 3; uneven partitions), compare with the unadapted model (see
``pipespec.integrations.transformers.zoo.runner``). Prints a table (``--json``: the list DESIGN.md specifies) and, with
``--write-coverage FILE``, writes the markdown coverage report (``make zoo`` writes docs/coverage.md).
Exit status 1 when any type ``failed``: an adaptation that ran but disagreed is a bug.

``--engine vllm`` checks vLLM-native adaptation instead: every PP decoder of the installed vLLM, adapted
by ``adapt_vllm_module`` and checked inside vLLM at PP=1 and PP=2 (``pipespec.integrations.vllm.zoo``;
vLLM is imported only then, so this module stays importable without it).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from pipespec.cli.args import int_list, positive_int
from pipespec.errors import UsageError

HELP = "verify adaptation over every causal-LM type of the installed transformers (or vLLM: --engine vllm)"
ENGINES = ("transformers", "vllm")
NEEDS_VLLM = "pipespec zoo --engine vllm needs vLLM >= 0.32 installed; run it in .venv-vllm (make venv-vllm)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=ENGINES, default="transformers",
        help="transformers (default): HF modeling code; vllm: every PP decoder of the installed vLLM, checked inside vLLM",
    )
    parser.add_argument(
        "--files", metavar="A.py,B.py",
        help="--engine vllm only: these model files (paths under the vllm package or base names; default: all)",
    )
    parser.add_argument("--model-types", metavar="A,B", help="only these model types (default: every causal-LM type installed)")
    parser.add_argument("--pp", type=int_list, default=[1, 2, 3], metavar="1,2,3", help="pipeline sizes to check (default 1,2,3)")
    parser.add_argument("--json", action="store_true", help='print [{"model_type", "status", "reason", "max_abs_err"}, ...]')
    parser.add_argument(
        "--decode-steps", type=int, default=0, metavar="K",
        help="also decode K tokens after the prefill, each stage with its own stage cache (default 0: one forward)",
    )
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument("--write-coverage", metavar="FILE", help="write the markdown coverage report to FILE (atomically)")


def _model_types(text: str | None) -> list[str] | None:
    from pipespec.integrations.transformers.zoo.tiny import causal_lm_model_types

    if text is None:
        return None
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if not wanted:
        raise UsageError("--model-types is empty: give comma-separated model types such as llama,qwen2")
    known = set(causal_lm_model_types())
    unknown = [t for t in wanted if t not in known]
    if unknown:
        raise UsageError(
            f"unknown model type {unknown[0]!r}: not in the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES "
            f"({len(known)} types; e.g. {', '.join(sorted(known)[:5])}, ...)"
        )
    return list(dict.fromkeys(wanted))


def _pp_sizes(values: Sequence[int]) -> list[int]:
    sizes = list(dict.fromkeys(values))
    if not sizes:
        raise UsageError("--pp is empty: give pipeline sizes such as 1,2,3")
    bad = [p for p in sizes if p < 1]
    if bad:
        raise UsageError(f"--pp {bad[0]} is invalid: a pipeline has at least 1 stage")
    return sizes


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the ``--jobs`` workers)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class _Progress:
    """A one-line progress bar on stderr, drawn only on a terminal (logs and pipes stay clean)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, done: int, total: int, result: Any) -> None:
        self.counts[result.status] += 1
        if not self.enabled:
            return
        width = 30
        filled = width * done // total
        bar = "#" * filled + "-" * (width - filled)
        tally = " ".join(f"{k} {self.counts[k]}" for k in ("verified", "declined", "failed"))
        self.stream.write(f"\r[{bar}] {done}/{total} {tally}  {result.model_type[:24]:<24}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


def format_table(results: Sequence[Any]) -> str:
    rows = [("model type", "status", "shape", "max abs err", "reason")]
    for r in results:
        err = "-" if r.max_abs_err is None else f"{r.max_abs_err:.2g}"
        reason = r.reason if len(r.reason) <= 110 else r.reason[:107] + "..."
        rows.append((r.model_type, r.status, r.shape, err, reason))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    counts = collections.Counter(r.status for r in results)
    lines.append(f"{len(results)} types: " + ", ".join(f"{counts[s]} {s}" for s in ("verified", "declined", "failed")))
    return "\n".join(line.rstrip() for line in lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


#: The closing section of docs/coverage.md (kept here so that `make zoo` regenerates it too).
VLLM_ZOO_SECTION = """## vLLM zoo

The same question for vLLM-native adapters is answered by `pipespec zoo --engine vllm` (`make zoo-vllm`, in
`.venv-vllm`), whose report is [coverage-vllm.md](coverage-vllm.md). It runs every model file of the installed
vLLM (`vllm/model_executor/models/`, `vllm/models/`) through `adapt_vllm_module`, builds each PP decoder tiny
inside vLLM itself (its own `VllmConfig`, `set_current_vllm_config`, `initialize_model`, CPU, float32, seeded
weights by parameter name) and checks it in vLLM's own process groups (`init_distributed_environment` +
`initialize_model_parallel`, gloo on 127.0.0.1): at PP=1 the aux states the adapted `*ForCausalLM` returns
after `set_aux_hidden_state_layers` equal the unadapted model's residual stream at the same ids (hooks on its
layers; max abs error 1e-5), `supports_eagle3` holds and the decoder sets `supports_aux_hidden_states_over_pp`
itself; at PP=2 two processes (`get_pp_group()`) build their stages, rank 0's `IntermediateTensors` carry
exactly the aux keys `pipespec.contract.layout.plan_layout` plans for stage 0, and rank 1, fed rank 0's tensors through
a pipe, returns aux states equal to the PP=1 values (ids 0, the stage boundary, the id after it and N). One
PP=1 worker and one PP=2 pair stay alive and every model streams through them with a per-model timeout.
Attention is not exercised: without the model runner's metadata and KV cache vLLM's CPU attention returns
its output buffer unwritten, so the harness zeroes every attention layer's output (attention, MLA and
Mamba/linear-attention mixers) in both models; the embedding, norms, MLP/MoE, the residual stream, the layer
loop and its aux capture and packing run as vLLM runs them.
"""


def coverage_markdown(results: Sequence[Any], meta: dict[str, Any]) -> str:
    """The coverage report: counts by status and by forward shape, the goals, then one row per type."""
    from pipespec.integrations.transformers.zoo.runner import SHAPES, STATUSES
    from pipespec.integrations.transformers.zoo.tiny import FIXES

    counts = collections.Counter(r.status for r in results)
    by_shape: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in SHAPES}
    for r in results:
        by_shape.setdefault(r.shape, collections.Counter())[r.status] += 1
    llama_like = [r for r in results if r.shape in ("llama", "llama-like")]
    gpt2 = [r for r in results if r.shape == "gpt2"]
    hf_checked = [r for r in results if r.hf_hidden_states_match is not None]
    differ = [r.model_type for r in hf_checked if not r.hf_hidden_states_match]
    pp = ",".join(map(str, meta["pp"]))
    out = [
        "# Zoo coverage",
        "",
        "<!-- generated by `pipespec zoo --write-coverage docs/coverage.md` (`make zoo`); do not edit, regenerate -->",
        "",
        f"Every causal-LM type of the installed transformers ({meta['transformers']}, torch {meta['torch']}), built as a "
        f"tiny random float32 model, adapted with `pipespec.adapt` and run as P = {pp} in-process stages (uneven "
        f"partitions; aux ids 0, every stage boundary, N and EAGLE3's defaults), compared with the unadapted model: "
        f"final hidden state and every aux id, relative error <= {meta['rel_tol']:g}"
        + (
            f", after the prefill and after each of {meta['decode_steps']} decode steps (every stage with its own "
            "`pipespec.integrations.transformers.stage_cache` cache; the reference with its own cache)."
            if meta["decode_steps"]
            else " (one forward, no cache; `--decode-steps K` adds decoding with per-stage caches)."
        ),
        "",
        f"Generated {meta['date']} in {meta['wall_s']:.1f} s wall, {meta['cpu_s']:.1f} s CPU "
        f"({meta['jobs']} {'processes' if meta['jobs'] > 1 else 'process'}, one torch thread each; {meta['cpus']} CPUs, "
        f"load average {meta['load']:.1f} at the start, so other processes' share of the cores is in the wall time).",
        "",
        "## Counts",
        "",
        "| status | types |",
        "|---|---|",
    ]
    out += [f"| {s} | {counts[s]} |" for s in STATUSES]
    out += [f"| **total** | **{len(results)}** |", "", "| forward shape | types | verified | declined | failed |", "|---|---|---|---|---|"]
    for key, label in SHAPES.items():
        c = by_shape.get(key, collections.Counter())
        out.append(f"| {label} | {sum(c.values())} | {c['verified']} | {c['declined']} | {c['failed']} |")
    out += [
        "",
        "## Goals",
        "",
        f"- Llama-like (exact loop + variants): {sum(r.status == 'verified' for r in llama_like)} of {len(llama_like)} verified "
        "(goal: at least 110 of 120; the issue counted 120 with its own grouping, this table labels each type by "
        "`pipespec.integrations.transformers.zoo.runner.classify_forward_shape` on the decoder actually run, a multimodal model's text decoder).",
        f"- GPT2-style: {sum(r.status == 'verified' for r in gpt2)} of {len(gpt2)} verified (goal: at least 5 of 10).",
        f"- failed: {counts['failed']} (goal: 0).",
        "",
        "## What the reference showed about HF's `hidden_states`",
        "",
        f"Of {len(hf_checked)} types whose reference ran with N+1 hidden states: `hidden_states[L]` is the input of layer L "
        f"for every L < N in {sum(bool(r.hf_hidden_states_match) for r in hf_checked)}; the last entry equals the post-norm "
        f"`last_hidden_state` in {sum(bool(r.hf_last_is_post_norm) for r in hf_checked)} (so aux id N is captured before the "
        "norm, by a hook, not read from HF's list)."
        + (f" `hidden_states[L]` differs from the layer input in: {', '.join(differ)}." if differ else ""),
        "",
        f"Tiny models: {sum(not r.reason.startswith('could not build tiny model') for r in results)} of {len(results)} built; "
        f"{sum(bool(r.fixes) for r in results)} needed a per-type fix (`pipespec.integrations.transformers.zoo.tiny.FIXES`).",
        "",
        "## Per-type fixes of the tiny recipe",
        "",
        "| fix | why the generic recipe is not enough |",
        "|---|---|",
        *[f"| {name} | {_cell(fix.reason)} |" for name, fix in sorted(FIXES.items())],
        "",
        "## Per type",
        "",
        "| model type | status | shape | decoder class | layers | max abs err | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        err = "" if r.max_abs_err is None else f"{r.max_abs_err:.2g}"
        out.append(
            f"| {r.model_type} | {r.status} | {SHAPES.get(r.shape, r.shape)} | {_cell(r.decoder_class)} | "
            f"{'' if r.num_layers is None else r.num_layers} | {err} | {_cell(r.reason)} |"
        )
    out += ["", VLLM_ZOO_SECTION.rstrip()]
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return _run_vllm(args)
    if args.files is not None:
        raise UsageError("--files is for --engine vllm; with the transformers engine use --model-types")
    types = _model_types(args.model_types)
    pp = _pp_sizes(args.pp)
    if args.decode_steps < 0:
        raise UsageError(f"--decode-steps {args.decode_steps} is invalid: give 0 (one forward) or a positive count")
    import torch
    import transformers

    from pipespec.integrations.transformers.zoo.runner import REL_TOL, run_zoo

    progress = _Progress(sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    wall, cpu = time.perf_counter(), _cpu_seconds()
    try:
        results = run_zoo(types, pp, progress=progress, jobs=args.jobs, decode_steps=args.decode_steps)
    finally:
        progress.close()
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    if args.json:
        print(json.dumps([r.to_json() for r in results]))
    else:
        print(format_table(results))
        print(f"{wall:.1f} s wall, {cpu:.1f} s CPU")
    if args.write_coverage:
        from pipespec.codegen import write_atomic

        meta = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "pp": pp,
            "rel_tol": REL_TOL,
            "date": datetime.date.today().isoformat(),
            "wall_s": wall,
            "cpu_s": cpu,
            "jobs": args.jobs,
            "decode_steps": args.decode_steps,
            "load": load,
            "cpus": os.cpu_count(),
        }
        write_atomic(args.write_coverage, coverage_markdown(results, meta))
        print(f"wrote {args.write_coverage}", file=sys.stderr)
    return 1 if any(r.status == "failed" for r in results) else 0


# ------------------------------------------------------------------------------------ --engine vllm
def _require_vllm() -> str:
    """vLLM's version, or a UsageError with the one line that says where to run this."""
    try:
        import vllm
        from vllm.model_executor.models.interfaces import EagleModelMixin
    except ImportError:
        raise UsageError(NEEDS_VLLM) from None
    if not hasattr(EagleModelMixin, "pack_local_aux_hidden_states"):
        raise UsageError(f"{NEEDS_VLLM} (found vLLM {vllm.__version__} without EagleModelMixin.pack_local_aux_hidden_states)")
    return str(vllm.__version__)


def _vllm_files(text: str | None) -> list[str]:
    """The model files to check; reads the installed vllm package's files without importing vLLM (so a
    bad --files value is one line, before vLLM's import-time warnings)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(NEEDS_VLLM)
    from pipespec.integrations.vllm.zoo import decoder_files

    every = decoder_files()
    if text is None:
        return every
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if not wanted:
        raise UsageError("--files is empty: give comma-separated vLLM model files such as llama.py,qwen2.py")
    known = set(every) | {os.path.basename(f) for f in every}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise UsageError(
            f"--files {unknown[0]!r}: not a model file of the installed vLLM with intermediate_tensors "
            "(give a path under the vllm package such as model_executor/models/llama.py, or a base name such as llama.py)"
        )
    return decoder_files(wanted)


class _VllmProgress:
    """tqdm bars on stderr: the codemod over the files, then the checks per decoder."""

    def __init__(self, files: int) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = tqdm(total=files, desc="adapting", unit="file", file=sys.stderr, leave=False)
        self.counts: collections.Counter[str] = collections.Counter()

    def adapting(self, rel: str) -> None:
        self.bar.set_postfix_str(rel.rsplit("/", 1)[-1], refresh=False)
        self.bar.update(1)

    def start(self, decoders: int) -> None:
        self.bar.close()
        self.bar = self._tqdm(total=decoders, desc="checking", unit="decoder", file=sys.stderr)

    def done(self, row: Any) -> None:
        self.counts[row.status] += 1
        self.bar.set_postfix_str(" ".join(f"{k} {v}" for k, v in sorted(self.counts.items())), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _run_vllm(args: argparse.Namespace) -> int:
    files = _vllm_files(args.files)
    version = _require_vllm()
    import torch
    import transformers

    from pipespec.integrations.vllm.zoo import coverage_markdown, inherited_flag_verdicts, run_vllm_zoo

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    progress = _VllmProgress(len(files))
    wall = time.perf_counter()
    try:
        results = run_vllm_zoo(files, progress=progress)
    finally:
        progress.close()
    wall = time.perf_counter() - wall
    verdicts = inherited_flag_verdicts()
    if args.json:
        print(json.dumps([r.to_json() for r in results]))
    else:
        print(_vllm_table(results))
        print(f"{wall:.1f} s wall")
    if args.write_coverage:
        from pipespec.codegen import write_atomic

        command = "pipespec zoo --engine vllm --write-coverage " + args.write_coverage
        if args.files:
            command += f" --files {args.files}"
        meta = {
            "command": command, "vllm": version, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "wall_s": wall, "load": load, "cpus": os.cpu_count(),
        }
        write_atomic(args.write_coverage, coverage_markdown(results, verdicts, meta))
        print(f"wrote {args.write_coverage}", file=sys.stderr)
    return 1 if any(r.status == "failed" for r in results) else 0


def _vllm_table(results: Sequence[Any]) -> str:
    rows = [("file", "decoder", "status", "reason")]
    for r in results:
        reason = r.reason if len(r.reason) <= 110 else r.reason[:107] + "..."
        rows.append((r.file, r.class_name, r.status, reason))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    counts = collections.Counter(r.status for r in results)
    lines.append(f"{len(results)} decoders: " + ", ".join(f"{counts[s]} {s}" for s in ("verified", "supported", "declined", "failed")))
    return "\n".join(line.rstrip() for line in lines)
