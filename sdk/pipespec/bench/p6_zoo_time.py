"""P6 — the zoo's wall time: ``pipespec zoo --json`` over every causal-LM type, on 2 cores.

Runs the real CLI in a subprocess (what a user or CI would run, interpreter start included) with
``--jobs 2`` (``--quick``: 1) and reports its wall time, the CPU time it used, and the per-status counts from its JSON
(a ``failed`` type is an adaptation that ran but disagreed with the unadapted model: goal 0).
``--quick`` checks a handful of types only. A CPU benchmark: under ``--device cuda`` it is skipped (the
zoo never touches a GPU, and the GPU host's core count says nothing about the 2-core figure).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import time

from pipespec.bench.common import Result, device_name

NAME = "p6"
DESCRIPTION = "the zoo's wall time (pipespec zoo --json, 2 jobs)"
CPU_FEASIBLE = True
QUICK_TYPES = ("llama", "qwen2", "gpt2")
JOBS = 2  # the 2 cores of the figure; --quick runs in one process (worker start-up would dominate)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(quick: bool, device: str, command: str) -> list[Result]:
    if device == "cuda":
        print("p6: the zoo is a CPU benchmark; skipped under --device cuda (run `pipespec bench p6`)", file=sys.stderr)
        return []
    jobs = 1 if quick else JOBS
    args = ["zoo", "--json", "--jobs", str(jobs)]
    if quick:
        args += ["--model-types", ",".join(QUICK_TYPES)]
    cmd = [sys.executable, "-c", "import sys; from pipespec.cli import main; sys.exit(main())", *args]
    cpu0, started = _children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    wall, cpu = time.perf_counter() - started, _children_cpu_s() - cpu0
    if proc.returncode not in (0, 1):  # 1 = some type failed: still a complete report
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"pipespec zoo exited with {proc.returncode}: {tail}")
    rows = json.loads(proc.stdout)
    counts = collections.Counter(r["status"] for r in rows)
    dev = device_name(device)
    scope = f"{len(rows)} types" + (f" ({', '.join(QUICK_TYPES)})" if quick else " (every causal-LM type installed)")
    load = os.getloadavg()[0]
    failed = [r["model_type"] for r in rows if r["status"] == "failed"]
    return [
        Result("P6.zoo_wall_s", wall, "-", "s", None, dev, command,
               detail=f"{scope}, --jobs {jobs}, {cpu:.1f} s CPU, load average {load:.1f} at the end"),
        Result("P6.verified", float(counts["verified"]), "-", "types", None, dev, command,
               detail=f"declined {counts['declined']}, of {len(rows)}"),
        Result("P6.failed", float(len(failed)), "0", "types", not failed, dev, command,
               detail=("failed: " + ", ".join(failed)) if failed else "no adaptation disagreed with its model"),
    ]
