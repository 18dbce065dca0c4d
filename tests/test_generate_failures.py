"""Failures end every stage with a message naming the stage; bad input is refused before any stage starts;
the torchrun entry point gives the same answer as ``pipespec generate``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pipespec.cli import main
from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target

BIN = Path(sys.executable).parent


pytestmark = pytest.mark.usefixtures("one_thread_per_stage")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_target(root / "target", "llama", num_layers=6, seed=21)
    draft = write_tiny_draft(root / "draft", AutoConfig.from_pretrained(target), format="B", seed=22)
    return target, draft


def _pids(stderr_lines: list[str]) -> dict[int, int]:
    found = {}
    for line in stderr_lines:
        m = re.match(r"\[stage (\d+)\] pid (\d+) joined", line)
        if m:
            found[int(m.group(1))] = int(m.group(2))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class LongRun:
    """A CLI run long enough (many prompts x many tokens) to be interrupted mid-decoding; stderr is read
    on a thread so that a silent process can never block the test."""

    def __init__(self, pair: tuple[Path, Path], tmp_path: Path, pp: int) -> None:
        prompts = tmp_path / "many.jsonl"
        prompts.write_text("".join(json.dumps({"prompt_ids": [i + 1, 2, 3]}) + "\n" for i in range(40)))
        target, draft = pair
        self.pp = pp
        self.proc = subprocess.Popen(
            [str(BIN / "pipespec"), "generate", "--target", str(target), "--draft", str(draft), "--pp", str(pp),
             "--prompts-file", str(prompts), "--max-new-tokens", "400", "--num-spec-tokens", "1", "--ignore-eos",
             "--timeout", "30", "-v", "--json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        stream = self.proc.stderr
        assert stream is not None
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(stream.readline, "")), daemon=True)
        self.reader.start()

    def wait_until_decoding(self) -> dict[int, int]:
        """Stage pids, once every stage has joined and the last one has loaded its weights."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.proc.poll() is None:
            seen = list(self.lines)
            loaded = any(re.match(rf"\[stage {self.pp - 1}\] layers .* read", line) for line in seen)
            if loaded and len(_pids(seen)) == self.pp:
                time.sleep(1.0)
                return _pids(seen)
            time.sleep(0.2)
        self.kill()
        raise AssertionError("the run never reached decoding:\n" + "".join(self.lines))

    def finish(self, timeout: float) -> str:
        self.proc.wait(timeout=timeout)
        self.reader.join(5)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.mark.timeout(300)
def test_killing_one_stage_ends_all_stages_naming_it(pair: tuple[Path, Path], tmp_path: Path) -> None:
    run = LongRun(pair, tmp_path, pp=3)
    try:
        pids = run.wait_until_decoding()
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        err = run.finish(60)
        assert time.monotonic() - killed_at < 60
    finally:
        run.kill()
    assert run.proc.returncode == 1, err
    assert "pipespec: error: stage 1 killed by SIGKILL; stopped stages 0, 2" in err
    time.sleep(0.5)
    assert not [p for p in pids.values() if _alive(p)], "stage processes outlived the launcher"


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_stage(pair: tuple[Path, Path], tmp_path: Path) -> None:
    run = LongRun(pair, tmp_path, pp=2)
    try:
        pids = run.wait_until_decoding()
        os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        err = run.finish(60)
    finally:
        run.kill()
    assert run.proc.returncode == 130, err
    assert "interrupted" in err
    time.sleep(0.5)
    assert not [p for p in pids.values() if _alive(p)], "stage processes outlived Ctrl-C"


@pytest.mark.timeout(300)
def test_a_stage_error_names_the_stage(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor missing from layer 5 fails stage 2 (layers [4, 6)) only; the message says so."""
    target = shutil.copytree(pair[0], tmp_path / "broken")
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["model.layers.5.self_attn.k_proj.weight"]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    code = main(["generate", "--target", str(target), "--draft", str(pair[1]), "--pp", "3", "--prompt-ids", "1,2",
                 "--max-new-tokens", "4", "--timeout", "30"])
    err = capsys.readouterr().err
    assert code == 1
    assert re.search(r"stage 2 failed: CheckpointError: tensor 'model.layers.5.self_attn.k_proj.weight' is missing", err), err
    assert "stopped stages 0, 1" in err


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--pp", "7"], 2, "pipeline size 7 is larger than num_layers 6"),
        (["--pp", "2", "--partition", "1,2"], 2, "partition \\[1, 2\\] sums to 3"),
        (["--pp", "2", "--prompt-ids", "1,500"], 2, "token id 500 is outside the target vocabulary"),
        (["--pp", "2", "--no-draft"], 2, "needs --draft DIR"),
        (["--pp", "2", "--prompt", "hello"], 1, "--prompt TEXT needs a tokenizer"),
        (["--pp", "2", "--other-draft"], 1, "draft was trained for another target|does not match the target"),
    ],
)
def test_bad_requests_are_refused_before_any_stage_starts(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    extra: list[str], code: int, message: str,
) -> None:
    import pipespec.pp.launch as launch

    def no_launch(*_a: object, **_k: object) -> None:
        raise AssertionError("stage processes were started for a request that can be refused up front")

    monkeypatch.setattr(launch, "run_stages", no_launch)
    target, draft = pair
    args = ["generate", "--target", str(target), "--max-new-tokens", "3"]
    if "--no-draft" not in extra:
        if "--other-draft" in extra:
            other = write_tiny_target(tmp_path / "other", "llama", num_layers=6, hidden_size=16, num_attention_heads=2,
                                      num_key_value_heads=1)
            draft = write_tiny_draft(tmp_path / "other_draft", AutoConfig.from_pretrained(other))
        args += ["--draft", str(draft)]
    args += [e for e in extra if e not in ("--no-draft", "--other-draft")]
    if "--prompt-ids" not in args and "--prompt" not in args:
        args += ["--prompt-ids", "1,2"]
    capsys.readouterr()
    assert main(args) == code
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.count("\n") == 1, "one line on stderr"


@pytest.mark.timeout(300)
def test_torchrun_entry_point_matches_pipespec_generate(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    flags = ["--target", str(target), "--draft", str(draft), "--pp", "2", "--partition", "4,2", "--prompt-ids", "9,8,7,6",
             "--max-new-tokens", "9", "--num-spec-tokens", "3", "--json", "--timeout", "60"]
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
         "-m", "pipespec.engine", *flags],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    via_torchrun = json.loads(proc.stdout)
    assert main(["generate", *flags]) == 0
    direct = json.loads(capsys.readouterr().out)
    for key in ("output_ids", "acceptance_lengths", "aux_layers", "aux_convention", "partition"):
        assert via_torchrun[key] == direct[key], key
    assert [s["bytes_read"] for s in via_torchrun["stages"]] == [s["bytes_read"] for s in direct["stages"]]
