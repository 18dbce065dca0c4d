"""Start the stage processes of a pipeline, or join a ``torchrun`` world; fail loudly, never hang.

Two ways in, one stage function ``fn(ctx: StageContext, payload) -> result``:

* ``run_stages(fn, payload, world_size, ...)`` — what ``pipespec generate`` uses. The launcher process
  owns a ``TCPStore`` bound to port 0 (the OS picks a free port, so no port is ever assumed and there is
  no bind race between finding a port and using it), starts one process per stage, and waits on every
  stage's pipe and process sentinel at once. The first stage that fails — an exception, a non-zero exit,
  a signal — stops the others, and the launcher raises ``StageFailedError`` naming that stage. When
  several stages fail, the root cause wins over the echoes: an error raised by a stage's own code beats
  a dead process, which beats a peer that only noticed a lost connection.
* ``run_under_torchrun(fn, payload, ...)`` — ``env://`` rendezvous from ``RANK``/``WORLD_SIZE``/
  ``MASTER_ADDR``/``MASTER_PORT`` (torchrun sets them and restarts or stops the world on failures).

Every stage process runs a watchdog thread: it ends the process when the launcher (or, under torchrun,
the parent agent) disappears — so Ctrl-C or a killed launcher leaves no orphans — and when a blocking
transport call has waited longer than the collective timeout plus a grace period (a hung NCCL call
does not always honour its timeout). Every process group is created with ``timeout=``.

Processes are forked from a ``forkserver`` that preloaded torch and transformers (Linux): starting P
stages then costs one import, not P imports competing for the same cores. ``PIPESPEC_START_METHOD``
(``spawn``/``forkserver``) overrides it. The forkserver keeps the environment it started with, so the
launcher passes the ``PIPESPEC_*`` variables explicitly.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipespec.errors import PipespecError, UsageError

START_METHOD_ENV = "PIPESPEC_START_METHOD"
# Imported once by the forkserver, before any stage forks from it: the heavy, model-independent part of
# what a stage imports (torch, transformers' modeling machinery, libcst for pipespec.adapt, the draft).
PRELOAD = [
    "torch", "torch.distributed", "safetensors", "transformers", "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto", "libcst",
    "pipespec.engine.worker", "pipespec.engine.draft_checkpoint", "pipespec.integrations.transformers.adapt",
    "pipespec.integrations.transformers.stage_cache",
]
WATCHDOG_GRACE_S = 30.0
# The rendezvous-store key where the first stage that loses a peer records what it lost (first writer
# wins), and how long a failing stage waits on the store for it.
LOST_PEER_KEY = "pipespec/first_lost_peer"
STORE_PROBE_S = 5.0
LOSS_SETTLE_S = 0.5
# After the first failure, how long to wait for a more telling report from another stage.
ROOT_CAUSE_GRACE_S = 3.0
TERMINATE_GRACE_S = 5.0


class StageFailedError(PipespecError):
    """One stage of the pipeline failed; the message names the stage and the cause."""

    def __init__(self, message: str, rank: int, exit_code: int = 1) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class PeerLostError(PipespecError):
    """A blocking send/receive/broadcast with another stage failed or timed out.

    Raised by the transport so the launcher can tell an echo (this stage lost its peer) from a root
    cause (the peer's own error).
    """


@dataclass
class _Watch:
    """What a blocking call is waiting for, and since when (read by the watchdog thread)."""

    what: str | None = None
    since: float = 0.0
    limit: float | None = None  # seconds this wait may take (None: the collective timeout + grace)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class StageContext:
    """What a stage function knows about its place in the world."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout: timedelta
    launcher: str  # "pipespec" or "torchrun"
    verbose: bool = False
    # How long a stage may wait for the others to finish loading (the first collective after loading);
    # None: the collective timeout. Large checkpoints load for minutes; steps should fail in seconds.
    load_timeout: timedelta | None = None
    _watch: _Watch = field(default_factory=_Watch, repr=False)
    # The rendezvous store and who hosts it: lets a stage that only lost an echo (a peer that exited
    # because *its* peer died) name the stage that died first. ``None``: no record is kept.
    store: Any = field(default=None, repr=False)
    store_host: str = "the launcher"
    store_address: tuple[str, int] | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def log(self, message: str, always: bool = False) -> None:
        """One line on stderr prefixed with the stage (``verbose`` unless ``always``)."""
        if always or self.verbose:
            # One write of the whole line: stages share stderr, and a separate newline write interleaves.
            sys.stderr.write(f"[stage {self.rank}] {message}\n")
            sys.stderr.flush()

    def first_lost_peer(self, failed: str) -> str:
        """Record ``failed`` (this stage's failed call) as the pipeline's first loss unless another stage
        was first; returns a suffix naming the first loss when it was another stage's, else ``""``.

        Without a supervisor each stage only sees the peer it was talking to, which may be a survivor
        that exited on its own loss; the first record names the stage that really died.
        """
        if self.store is None:
            return ""
        mine = f"stage {self.rank}: {failed}"
        unreachable = f"; the rendezvous store is unreachable too ({self.store_host} is gone)"
        if self.store_address is not None:
            # Probe with a fresh connection first: a store call on a dead host makes torch log a C++ stack.
            # A killed host closes its sockets one by one; let it finish before the probe is believed.
            time.sleep(LOSS_SETTLE_S)
            try:
                socket.create_connection(self.store_address, timeout=STORE_PROBE_S).close()
            except OSError:
                return unreachable
        try:
            self.store.set_timeout(timedelta(seconds=STORE_PROBE_S))
            first = self.store.compare_set(LOST_PEER_KEY, "", mine)
        except Exception:  # noqa: BLE001 - the store's host is gone too
            return unreachable
        text = first.decode(errors="replace") if isinstance(first, bytes) else str(first)
        return "" if text == mine else f"; first failure in the pipeline: {text}"

    @property
    def group_timeout(self) -> timedelta:
        """The process group's own timeout: long enough for the post-loading barrier."""
        return max(self.timeout, self.load_timeout or self.timeout)

    @contextlib.contextmanager
    def waiting(self, what: str, limit: timedelta | None = None) -> Iterator[None]:
        """Mark a blocking call for the watchdog; ``what`` names the peer in the hang message."""
        with self._watch.lock:
            self._watch.what, self._watch.since = what, time.monotonic()
            self._watch.limit = limit.total_seconds() + WATCHDOG_GRACE_S if limit is not None else None
        try:
            yield
        finally:
            with self._watch.lock:
                self._watch.what = None


def describe_exit(exitcode: int | None) -> str:
    """``-9`` → ``killed by SIGKILL``; ``3`` → ``exited with code 3``."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


# --------------------------------------------------------------------------------------------- stage side
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_watchdog(ctx: StageContext, launcher_pid: int | None) -> None:
    parent = os.getppid()
    limit = ctx.timeout.total_seconds() + WATCHDOG_GRACE_S

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or (launcher_pid is not None and not _pid_alive(launcher_pid)):
                ctx.log("the launcher is gone; exiting", always=True)
                os._exit(1)
            with ctx._watch.lock:
                what, since, allowed = ctx._watch.what, ctx._watch.since, ctx._watch.limit or limit
            if what is not None and time.monotonic() - since > allowed:
                ctx.log(f"no progress for {allowed:.0f} s while waiting for {what}; exiting", always=True)
                os._exit(1)

    threading.Thread(target=loop, name="pipespec-watchdog", daemon=True).start()


def _pick_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was given but no CUDA device is visible to this process")
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"stage with local rank {local_rank} needs GPU {local_rank} but only {torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def _report(exc: BaseException) -> tuple[str, bool, int]:
    """(one-line message, is it only a lost peer, exit code) for an exception in a stage."""
    if isinstance(exc, PipespecError):
        return f"{type(exc).__name__}: {exc}", isinstance(exc, PeerLostError), exc.exit_code
    return f"{type(exc).__name__}: {exc}", False, 1


def _child_main(
    rank: int, world_size: int, port: int, device_type: str, timeout_s: float, load_timeout_s: float | None,
    verbose: bool, fn: Callable[[StageContext, Any], Any], payload: Any, conn: mpc.Connection, env: dict[str, str], launcher_pid: int,
) -> None:
    """Entry point of a stage process started by ``run_stages``."""
    os.environ.update(env)
    code = 1
    ctx = StageContext(
        rank=rank, world_size=world_size, device=torch.device("cpu"), backend=backend_for(device_type),
        timeout=timedelta(seconds=timeout_s), launcher="pipespec", verbose=verbose,
        load_timeout=timedelta(seconds=load_timeout_s) if load_timeout_s else None,
    )
    _start_watchdog(ctx, launcher_pid)
    try:
        ctx.device = _pick_device(device_type, rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, ctx.timeout)
        with ctx.waiting("the other stages to join the process group"):
            dist.init_process_group(ctx.backend, store=store, rank=rank, world_size=world_size, timeout=ctx.group_timeout)
        ctx.store, ctx.store_address = store, ("127.0.0.1", port)
        ctx.log(f"pid {os.getpid()} joined the {ctx.backend} process group on {ctx.device}")
        result = fn(ctx, payload)
        conn.send(("ok", result))
        code = 0
    except KeyboardInterrupt:
        code = 130
        with contextlib.suppress(Exception):
            conn.send(("interrupted", None))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher as a message
        message, peer_lost, code = _report(exc)
        if not isinstance(exc, PipespecError):
            traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send(("error", (message, peer_lost, code)))
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: gloo/NCCL threads of a broken group can block a normal exit.
        os._exit(code)


# ----------------------------------------------------------------------------------------- launcher side
@dataclass
class _Failure:
    rank: int
    message: str
    kind: int  # 0: the stage's own error, 1: died without a report, 2: lost a peer
    exit_code: int
    at: float


def _context(start_method: str | None) -> Any:
    method = start_method or os.environ.get(START_METHOD_ENV) or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    )
    if method not in ("spawn", "forkserver"):
        raise UsageError(f"{START_METHOD_ENV}={method!r} is not supported: use spawn or forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _failure_error(failures: dict[int, _Failure], world_size: int) -> StageFailedError:
    cause = min(failures.values(), key=lambda f: (f.kind, f.at))
    others = sorted(r for r in range(world_size) if r != cause.rank)
    tail = f"; stopped stage{'s' if len(others) != 1 else ''} {', '.join(map(str, others))}" if others else ""
    return StageFailedError(f"stage {cause.rank} {cause.message}{tail}", rank=cause.rank, exit_code=cause.exit_code)


def run_stages(
    fn: Callable[[StageContext, Any], Any],
    payload: Any,
    world_size: int,
    *,
    device_type: str = "cpu",
    timeout_s: float = 300.0,
    load_timeout_s: float | None = None,
    verbose: bool = False,
    start_method: str | None = None,
    on_start: Callable[[list[int]], None] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, payload)`` in ``world_size`` fresh processes; return each stage's result by rank.

    Raises ``StageFailedError`` naming the failing stage (after stopping every other stage), or
    ``KeyboardInterrupt`` after stopping every stage.
    """
    if world_size < 1:
        raise UsageError(f"a pipeline needs at least 1 stage, got {world_size}")
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise UsageError(f"--device cuda with {world_size} stages needs {world_size} GPUs; {torch.cuda.device_count()} are visible")
    mpctx = _context(start_method)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if k.startswith("PIPESPEC_")}
    procs, conns = [], {}
    try:
        for rank in range(world_size):
            reader, writer = mpctx.Pipe(duplex=False)
            p = mpctx.Process(
                target=_child_main,
                args=(rank, world_size, store.port, device_type, timeout_s, load_timeout_s, verbose, fn, payload, writer,
                      env, os.getpid()),
                name=f"pipespec-stage-{rank}",
                daemon=True,
            )
            p.start()
            writer.close()
            procs.append(p)
            conns[rank] = reader
        if on_start is not None:
            on_start([p.pid for p in procs])
        return _supervise(procs, conns, world_size)
    finally:
        _stop(procs)
        for c in conns.values():
            c.close()
        del store


def _supervise(procs: list[Any], conns: dict[int, mpc.Connection], world_size: int) -> list[Any]:
    results: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    open_conns = dict(conns)
    running = {rank: p for rank, p in enumerate(procs)}
    first_failure_at: float | None = None
    while running or open_conns:
        if first_failure_at is not None and time.monotonic() - first_failure_at > ROOT_CAUSE_GRACE_S:
            break
        waitables: list[Any] = list(open_conns.values()) + [p.sentinel for p in running.values()]
        ready = set(mpc.wait(waitables, timeout=0.5))
        for rank, conn in list(open_conns.items()):
            if conn not in ready:
                continue
            try:
                kind, body = conn.recv()
            except (EOFError, OSError):
                del open_conns[rank]
                continue
            if kind == "ok":
                results[rank] = body
            elif kind == "error":
                message, peer_lost, code = body
                failures[rank] = _Failure(rank, f"failed: {message}", 2 if peer_lost else 0, code, time.monotonic())
            elif kind == "interrupted":
                raise KeyboardInterrupt
        for rank, p in list(running.items()):
            if p.sentinel in ready or not p.is_alive():
                p.join()
                del running[rank]
                if p.exitcode != 0 and rank not in failures and rank not in results:
                    # Drain a report that raced with the exit before calling it a silent death.
                    conn = open_conns.get(rank)
                    if conn is not None and conn.poll():
                        continue
                    failures[rank] = _Failure(rank, describe_exit(p.exitcode), 1, 1, time.monotonic())
                if rank in open_conns and not open_conns[rank].poll():
                    del open_conns[rank]
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
            if any(f.kind == 0 for f in failures.values()):
                break
        if failures and any(f.kind == 0 for f in failures.values()):
            break
    if failures:
        raise _failure_error(failures, world_size)
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise StageFailedError(f"stage {missing[0]} exited without a result", rank=missing[0])
    return [results[r] for r in range(world_size)]


class RendezvousError(PipespecError):
    """A stage could not start or join the process group (port in use, unreachable rank 0, mismatched world)."""


def _rendezvous_error(exc: BaseException) -> RendezvousError:
    """One line for a failed ``env://`` rendezvous: which address, and what to change."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    text = " ".join(str(exc).split())
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return RendezvousError(
            f"cannot host the rendezvous store at {where}: the port is already in use by another "
            "process; choose a free port (torchrun --master-port, or MASTER_PORT)"
        )
    return RendezvousError(
        f"cannot join the process group at {where} ({type(exc).__name__}: {text[:300]}): check that "
        "every stage has the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE and that rank 0 is running"
    )


def _default_store() -> tuple[Any, str]:
    """The ``env://`` group's store and its host (torchrun's agent, else rank 0); ``(None, ...)`` if unknown."""
    host = "the torchrun agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "stage 0, its host,"
    try:
        return dist.distributed_c10d._get_default_store(), host
    except Exception:  # noqa: BLE001 - a private helper: without it, stages just keep no loss record
        return None, host


def run_under_torchrun(
    fn: Callable[[StageContext, Any], Any], payload: Any, *, device_type: str = "cpu", timeout_s: float = 300.0,
    load_timeout_s: float | None = None, verbose: bool = False,
) -> Any:
    """Run this process's stage of a world that ``torchrun`` set up (``env://`` rendezvous)."""
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise UsageError(f"{exc.args[0]} is not set: run this entry point under torchrun, or use `pipespec generate`") from None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ctx = StageContext(
        rank=rank, world_size=world_size, device=torch.device("cpu"), backend=backend_for(device_type),
        timeout=timedelta(seconds=timeout_s), launcher="torchrun", verbose=verbose,
        load_timeout=timedelta(seconds=load_timeout_s) if load_timeout_s else None,
    )
    _start_watchdog(ctx, None)
    ctx.device = _pick_device(device_type, local_rank)
    with ctx.waiting("the other stages to join the process group (env://)"):
        try:
            dist.init_process_group(ctx.backend, init_method="env://", rank=rank, world_size=world_size, timeout=ctx.group_timeout)
        except Exception as exc:  # noqa: BLE001 - DistNetworkError / DistStoreError / RuntimeError variants
            raise _rendezvous_error(exc) from None
    ctx.store, ctx.store_host = _default_store()
    with contextlib.suppress(KeyError, ValueError):
        ctx.store_address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    try:
        return fn(ctx, payload)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
