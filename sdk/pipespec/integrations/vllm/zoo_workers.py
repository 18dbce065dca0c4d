"""The vLLM zoo's worker processes: one PP=1 worker and one PP=2 pair, kept alive while the zoo streams
models through them, each request with a timeout, and a worker that dies or hangs restarted (its log's
last line in the reason).

Each worker runs ``pipespec.integrations.vllm.harness.serve`` in a spawned process (vLLM's own process
groups over gloo on 127.0.0.1, a free port per group). Imports vLLM only through the harness, in the
workers; this module itself imports the standard library and the harness.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import tempfile
from typing import Any

from pipespec.integrations.vllm.harness import serve

__all__ = ["REQUEST_TIMEOUT_S", "START_TIMEOUT_S", "WorkerPool"]

#: Seconds one model may take in one worker request before the worker is restarted.
REQUEST_TIMEOUT_S = 90.0
#: Seconds a (re)started worker may take to import vLLM and join its process group.
START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerPool:
    """The PP=1 worker and the PP=2 pair; ``ask`` sends one request and waits at most the timeout."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: dict[str, tuple[Any, Any]] = {}
        self.logs = tempfile.mkdtemp(prefix="pipespec-vllm-zoo-logs-")
        self.start("pp1")
        self.start("pp2")

    def start(self, group: str) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        ranks = ["pp1"] if group == "pp1" else ["pp2-0", "pp2-1"]
        init = f"tcp://127.0.0.1:{_free_port()}"
        for rank, name in enumerate(ranks):
            parent, child = self.ctx.Pipe()
            log = os.path.join(self.logs, f"{name}.log")
            open(log, "w").close()  # a restarted worker's log starts empty: its tail is its own
            proc = self.ctx.Process(target=serve, args=(child, len(ranks), rank, init, log), daemon=True,
                                    name=f"zoo-{name}")
            proc.start()
            child.close()
            self.workers[name] = (proc, parent)

    def _ready(self, name: str) -> None:
        proc, conn = self.workers[name]
        if getattr(proc, "_zoo_ready", False):
            return
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"worker {name} did not start within {START_TIMEOUT_S:.0f} s")
        kind, _ = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"worker {name} answered {kind!r} at start")
        proc._zoo_ready = True  # noqa: SLF001 - a flag on our own process object

    def ask(self, name: str, request: tuple[str, tuple[Any, ...]]) -> tuple[str, Any]:
        try:
            self._ready(name)
            proc, conn = self.workers[name]
            conn.send(request)
            if conn.poll(REQUEST_TIMEOUT_S):
                return conn.recv()  # type: ignore[no-any-return]
            reason = f"timed out after {REQUEST_TIMEOUT_S:.0f} s"
        except (EOFError, OSError, RuntimeError) as exc:
            reason = f"died ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''}; last log line: {self._last_words(name)})"
        self.restart("pp1" if name == "pp1" else "pp2")
        return "error", f"{name} worker {reason}; restarted it"

    def _last_words(self, name: str) -> str:
        try:
            with open(os.path.join(self.logs, f"{name}.log"), encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return "none"
        return lines[-1][:300] if lines else "none"

    def restart(self, group: str) -> None:
        names = ["pp1"] if group == "pp1" else ["pp2-0", "pp2-1"]
        for name in names:
            proc, conn = self.workers.pop(name)
            proc.kill()
            proc.join(10)
            conn.close()
        self.start(group)

    def close(self) -> None:
        for _proc, conn in self.workers.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, conn in self.workers.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
        self.workers.clear()
        shutil.rmtree(self.logs, ignore_errors=True)
