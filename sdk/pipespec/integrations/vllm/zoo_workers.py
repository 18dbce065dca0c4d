"""The vLLM zoo's worker processes: one group of P processes per pipeline size P (a PP=1 worker, a PP=2
pair, a PP=3 trio by default), kept alive while the zoo streams models through them. A request goes to
every rank of a group at once and is answered within a timeout; a group with a worker that dies or hangs
is restarted whole (its ranks share vLLM's process groups), with the worker's last log line in the reason.

Each worker runs ``serve`` in a process forked by multiprocessing's fork server, which imports vLLM once
(``PRELOAD``) for every worker it forks, restarts included (a spawned worker spent ~15-30 s of CPU on that
import alone, six times over). A worker joins vLLM's own process groups over gloo on 127.0.0.1 (a free
port per group) and answers ``"pp1"`` (``harness.check_pp1``) and ``"rank"`` (``pp_ranks.run_rank``)
requests. This process never imports vLLM: the fork server and the workers do.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from pipespec.errors import PipespecError, one_line

__all__ = ["PRELOAD", "REQUEST_TIMEOUT_S", "START_TIMEOUT_S", "WORKER_MEMORY_BYTES", "WorkerPool", "serve"]

#: Seconds one model may take in one group request before the group is restarted.
REQUEST_TIMEOUT_S = 90.0
#: Seconds a (re)started worker may take to import vLLM and join its process group.
START_TIMEOUT_S = 180.0
#: Heap limit of a zoo worker (an idle one holds ~0.9 GB with vLLM imported).
WORKER_MEMORY_BYTES = 3 << 30
#: What the fork server imports once, before it forks any worker: the worker's own modules and the vLLM
#: modules every request needs (the model files are imported per model, in the worker).
PRELOAD = (
    "pipespec.integrations.vllm.harness", "pipespec.integrations.vllm.pp_ranks", "vllm.config",
    "vllm.distributed.parallel_state", "vllm.forward_context", "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.models.registry", "vllm.sequence", "vllm.v1.worker.gpu.pp_utils",
    "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _stdout_on_stderr() -> Iterator[None]:
    """This process's stdout pointed at its stderr while inside: the fork server (launched by the first
    start) keeps the descriptors it gets, and what it or its vLLM import prints must not reach stdout
    (``--json`` prints there); its errors still show."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _names(size: int) -> list[str]:
    return ["pp1"] if size == 1 else [f"pp{size}-{rank}" for rank in range(size)]


class WorkerPool:
    """One group of worker processes per pipeline size in ``sizes``; ``run`` sends one request to a group."""

    def __init__(self, sizes: Sequence[int] = (1, 2, 3)) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(PRELOAD))
        self.workers: dict[str, tuple[Any, Any]] = {}
        self.ready: set[str] = set()
        self.logs = tempfile.mkdtemp(prefix="pipespec-vllm-zoo-logs-")
        for size in sizes:
            self.start(size)

    def start(self, size: int) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        init = f"tcp://127.0.0.1:{_free_port()}"
        for rank, name in enumerate(_names(size)):
            parent, child = self.ctx.Pipe()
            log = os.path.join(self.logs, f"{name}.log")
            open(log, "w").close()  # a restarted worker's log starts empty: its tail is its own
            proc = self.ctx.Process(target=serve, args=(child, size, rank, init, log), daemon=True, name=f"zoo-{name}")
            try:
                with _stdout_on_stderr():  # the first start launches the fork server
                    proc.start()
            except EOFError:
                raise PipespecError(
                    "the vLLM zoo's fork server exited before forking a worker: importing "
                    f"{', '.join(PRELOAD)} failed in it (its error is above, on stderr)") from None
            child.close()
            self.workers[name] = (proc, parent)

    def _wait_ready(self, name: str, deadline: float) -> None:
        if name in self.ready:
            return
        _proc, conn = self.workers[name]
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"did not start within {START_TIMEOUT_S:.0f} s")
        kind, _ = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"answered {kind!r} at start")
        self.ready.add(name)

    def run(self, size: int, request: tuple[str, tuple[Any, ...]]) -> list[tuple[str, Any]]:
        """``request`` to every rank of group ``size``; one ``(kind, answer)`` per rank, in rank order.

        A rank that does not answer within ``REQUEST_TIMEOUT_S`` (or dies) makes every rank's answer an
        error naming it, and the group is restarted.
        """
        names = _names(size)
        current = names[0]
        try:
            start_by = time.monotonic() + START_TIMEOUT_S
            for current in names:
                self._wait_ready(current, start_by)
            for current in names:
                self.workers[current][1].send(request)
            answer_by = time.monotonic() + REQUEST_TIMEOUT_S
            answers = []
            for current in names:
                conn = self.workers[current][1]
                if not conn.poll(max(0.0, answer_by - time.monotonic())):
                    raise TimeoutError(f"timed out after {REQUEST_TIMEOUT_S:.0f} s")
                answers.append(conn.recv())
            return answers
        except (EOFError, OSError, RuntimeError) as exc:
            reason = f"died ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''}; last log line: {self._last_words(current)})"
            if isinstance(exc, TimeoutError):
                reason = str(exc)
        self.restart(size)
        return [("error", f"{current} worker {reason}; restarted its group")] * size

    def ask(self, name: str, request: tuple[str, tuple[Any, ...]]) -> tuple[str, Any]:
        """``request`` to the PP=1 worker (``name`` "pp1"): its ``(kind, answer)``."""
        if name != "pp1":
            raise ValueError(f"ask() serves the PP=1 worker only, not {name!r}: use run(size, request) for a group")
        return self.run(1, request)[0]

    def _last_words(self, name: str) -> str:
        try:
            with open(os.path.join(self.logs, f"{name}.log"), encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return "none"
        return lines[-1][:300] if lines else "none"

    def restart(self, size: int) -> None:
        for name in _names(size):
            proc, conn = self.workers.pop(name)
            self.ready.discard(name)
            proc.kill()
            proc.join(10)
            conn.close()
        self.start(size)

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
        self.ready.clear()
        shutil.rmtree(self.logs, ignore_errors=True)


def serve(conn: Any, world_size: int, rank: int, init_method: str, log_path: str = os.devnull) -> None:
    """Worker loop: join the process groups, then answer ``(kind, args)`` requests on ``conn`` until
    ``None``. Each request answers ``("ok", result)``, ``("mismatch", reason)`` or ``("error", reason)``.

    vLLM logs on stdout and stderr: both go to ``log_path`` (the parent's progress bar owns the
    terminal, and a worker that dies in native code leaves its last words there)."""
    from pipespec.integrations.vllm import harness, pp_ranks

    if log_path != os.devnull:
        harness.set_model_root(os.path.dirname(log_path))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    harness.init_rank(world_size, rank, init_method)
    # a model the recipe leaves large (an audio tower sized in code, not in its config) fails with an
    # allocation error instead of taking the shared machine's memory
    resource.setrlimit(resource.RLIMIT_DATA, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    conn.send(("ready", None))
    while True:
        request = conn.recv()
        if request is None:
            return
        kind, args = request
        try:
            if kind == "pp1":
                answer = harness.check_pp1(*args)
            elif kind == "rank":
                answer = pp_ranks.run_rank(*args)
            else:
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("ok", answer))
        except harness.AuxCheckError as exc:
            conn.send(("mismatch", str(exc)))
        except Exception as exc:  # noqa: BLE001 - every failure of one model is that model's reason
            traceback.print_exc()  # into the log: the answer is one line
            conn.send(("error", one_line(exc, limit=400)))
