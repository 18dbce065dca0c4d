"""Faults: ports, signals and dead stages end a run with one clear line, no orphans and no hang (gloo, CPU).

What tests/test_generate_failures.py already pins (kill stage 1 of 3 under ``pipespec generate`` → the
launcher names it and stops the rest; Ctrl-C to the whole foreground group → every stage ends) is not
repeated. This file adds the cases around it:

* a busy rendezvous port: the ``env://`` entry point (torchrun-less launch, e.g. under a batch system)
  refuses with one line naming the port; ``pipespec generate`` never uses a fixed port, so neither a
  busy ``MASTER_PORT`` nor a second pipeline running at the same time can collide with it;
* signals to the launcher alone (``kill -INT`` / ``kill -9`` of the ``pipespec generate`` process, not
  its group): every process of the run — stages, forkserver, resource tracker — is gone soon after;
* a stage killed with no supervisor at all (one ``python -m pipespec.engine`` per rank, ``env://``):
  every other stage must notice on its own, exit non-zero within 60 s, and name the dead stage — also
  when it only lost an echo (a neighbour that exited on its own loss) or when the dead stage hosted
  the rendezvous store.

Stage pids come from the ``-v`` log lines; "no orphans" is checked over the whole session the run was
started in (``start_new_session``), which catches helper processes a pid list would miss.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target
from pipespec.pp.launch import StageContext, run_stages

BIN = Path(sys.executable).parent
PIPESPEC = str(BIN / "pipespec")
PYTHON = sys.executable
KILL_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("faults")
    target = write_tiny_target(root / "target", "llama", num_layers=6, seed=71)
    draft = write_tiny_draft(root / "draft", AutoConfig.from_pretrained(target), format="B", seed=72)
    return target, draft


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Enough work (40 prompts x 400 tokens) that a run is always interrupted mid-decoding."""
    path = tmp_path_factory.mktemp("prompts") / "many.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": [i + 1, 2, 3]}) + "\n" for i in range(40)))
    return path


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A port some other program is listening on, for the length of the block."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until_session_empty(sid: int, within: float) -> list[int]:
    deadline = time.monotonic() + within
    left = session_processes(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_processes(sid)
    return left


def kill_session(sid: int) -> None:
    for pid in session_processes(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Lines:
    """A process's stderr, read on a thread so a silent or stuck process can never block the test."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        stream = proc.stderr
        assert stream is not None
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(stream.readline, "")), daemon=True)
        self.thread.start()

    def text(self) -> str:
        return "".join(self.lines)

    def has(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in list(self.lines))


def wait_for(condition: object, within: float, what: str, *procs: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def decode_flags(pair: tuple[Path, Path], prompts: Path, pp: int) -> list[str]:
    target, draft = pair
    return ["--target", str(target), "--draft", str(draft), "--pp", str(pp), "--prompts-file", str(prompts),
            "--max-new-tokens", "400", "--num-spec-tokens", "1", "--ignore-eos", "--timeout", "30", "-v", "--json"]


# ------------------------------------------------------------------------------------------ ports
@pytest.mark.timeout(180)
def test_busy_rendezvous_port_is_one_clear_line(pair: tuple[Path, Path]) -> None:
    """``env://`` rank 0 cannot host the store on a busy MASTER_PORT: exit 1, one line naming the port."""
    target, draft = pair
    with busy_port() as port:
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        proc = subprocess.run(
            [PYTHON, "-m", "pipespec.engine", "--target", str(target), "--draft", str(draft), "--pp", "2",
             "--prompt-ids", "1,2", "--max-new-tokens", "2", "--timeout", "20"],
            env=env, capture_output=True, text=True, timeout=150,
        )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (
        f"pipespec.engine: error: stage 0: RendezvousError: cannot host the rendezvous store at 127.0.0.1:{port}: "
        "the port is already in use by another process; choose a free port (torchrun --master-port, or MASTER_PORT)"
    )


def _sum_ranks(ctx: StageContext, offset: int) -> int:
    """Every stage contributes rank + offset; the sum proves the group holds exactly this pipeline's stages."""
    value = torch.tensor([ctx.rank + offset], dtype=torch.int64)
    dist.all_reduce(value)
    time.sleep(1.0)  # keep both pipelines' groups alive at the same time
    return int(value.item())


@pytest.mark.timeout(240)
def test_launcher_never_collides_on_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy MASTER_PORT in the environment and a second pipeline running at the same time change nothing:
    the launcher's store binds a port the OS picks, and each pipeline's stages find their own store."""
    with busy_port() as port:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        results: dict[int, object] = {}

        def pipeline(offset: int) -> None:
            try:
                results[offset] = run_stages(_sum_ranks, offset, 3, timeout_s=60)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                results[offset] = exc

        threads = [threading.Thread(target=pipeline, args=(offset,)) for offset in (0, 100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)
    # 3 stages: 0 + 1 + 2 (+ 3 x offset); a mixed-up group would give another sum or fail to form.
    assert results == {0: [3, 3, 3], 100: [303, 303, 303]}, results


# ------------------------------------------------------------------------------------------ signals
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sig", "code", "message"), [
    (signal.SIGINT, 130, "pipespec: interrupted"),
    (signal.SIGKILL, -signal.SIGKILL, "the launcher is gone; exiting"),
], ids=["sigint", "sigkill"])
def test_a_signal_to_the_launcher_alone_leaves_no_process_behind(
    pair: tuple[Path, Path], long_prompts: Path, sig: signal.Signals, code: int, message: str,
) -> None:
    """``kill -INT`` (the launcher stops the stages) or ``kill -9`` (the stages' watchdogs notice the
    launcher is gone) of the ``pipespec generate`` process only: the whole session empties."""
    proc = subprocess.Popen([PIPESPEC, "generate", *decode_flags(pair, long_prompts, 3)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    err = Lines(proc)
    try:
        wait_for(lambda: all(err.has(rf"^\[stage {r}\] layers ") for r in range(3)), 240, "every stage to load", proc)
        time.sleep(1.0)
        helpers = session_processes(proc.pid)
        assert len(helpers) >= 4, helpers  # the launcher and three stages at least
        os.kill(proc.pid, sig)
        proc.wait(KILL_DEADLINE_S)
        left = wait_until_session_empty(proc.pid, 15)
    finally:
        kill_session(proc.pid)
        proc.wait(10)
    err.thread.join(5)
    assert proc.returncode == code, err.text()
    assert not left, f"processes outlived the launcher: {left}"
    assert message in err.text(), err.text()
    assert "Traceback" not in err.text()


# ------------------------------------------------------------------------------------------ dead stage
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dead", [1, 0], ids=["middle-stage", "store-host"])
def test_without_a_supervisor_every_survivor_names_the_dead_stage(
    pair: tuple[Path, Path], long_prompts: Path, dead: int,
) -> None:
    """One process per stage and no launcher (``env://``): kill one mid-generation. Each survivor exits 1
    within 60 s with one line naming the dead stage — directly, through the pipeline's first recorded
    loss (a survivor whose neighbour exited on its own loss), or as the store host that is gone."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([PYTHON, "-m", "pipespec.engine", *decode_flags(pair, long_prompts, 3)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True))
    errs = [Lines(p) for p in procs]
    ended: dict[int, float] = {}
    try:
        wait_for(lambda: all(e.has(r"^\[stage \d\] layers ") for e in errs), 240, "every stage to load", *procs)
        time.sleep(1.0)
        procs[dead].kill()
        killed_at = time.monotonic()
        for rank, p in enumerate(procs):
            if rank != dead:
                p.wait(KILL_DEADLINE_S)
                ended[rank] = time.monotonic() - killed_at
    finally:
        for p in procs:
            kill_session(p.pid)
            p.wait(10)
    for e in errs:
        e.thread.join(5)
    for rank, p in enumerate(procs):
        if rank == dead:
            continue
        text = errs[rank].text()
        assert p.returncode == 1, text
        assert ended[rank] < KILL_DEADLINE_S
        assert "Traceback" not in text and "frame #" not in text, text
        lines = [line for line in text.splitlines() if line.startswith("pipespec.engine: error: ")]
        assert len(lines) == 1, text
        assert lines[0].startswith(f"pipespec.engine: error: stage {rank}: PeerLostError: "), lines[0]
        if dead == 0:
            names_dead = re.search(r"from stage 0 failed|stage 0, its host, is gone", lines[0])
        else:
            names_dead = re.search(rf"(from|to) stage {dead} failed", lines[0])
        assert names_dead, f"stage {rank} does not name dead stage {dead}: {lines[0]}"
