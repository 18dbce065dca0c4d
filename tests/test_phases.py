"""Where decoding time goes (``pipespec.engine.phases``): every stage reports host seconds per phase of
its rounds (``phase_s``), and ``PIPESPEC_PROFILE=DIR`` writes a torch profile per stage; both through a
real two-stage ``pipespec generate`` on the shipped demo pair."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipespec.cli import main
from pipespec.cli.demo import shipped_pair
from pipespec.engine.phases import FIRST_SPANS, PHASE_SYNC_ENV, PROFILE_ENV, PY_PROFILE_ENV, PhaseClock

pytestmark = pytest.mark.timeout(300)


def generate(capsys: pytest.CaptureFixture[str], k: int, tokens: int = 12) -> dict[str, Any]:
    target, draft = shipped_pair()
    args = ["generate", "--target", str(target), "--draft", str(draft), "--pp", "2", "--prompt-ids", "5,6,7,8,9,10",
            "--max-new-tokens", str(tokens), "--num-spec-tokens", str(k), "--ignore-eos", "--json", "--timeout", "60",
            "--spec-policy", "always"]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_every_stage_reports_its_phases_within_its_decode_time(capsys: pytest.CaptureFixture[str]) -> None:
    result = generate(capsys, k=3)
    first, last = result["stages"]
    rounds = result["rounds"]
    # Stage 0 embeds and sends; the last stage receives, samples and drafts; both read each round's message.
    assert {"inputs", "forward", "send", "message", "apply", "settle", "publish"} <= set(first["phase_s"])
    assert {"inputs", "recv", "forward", "sample", "draft", "publish"} <= set(last["phase_s"])
    assert "send" not in last["phase_s"] and "recv" not in first["phase_s"]
    for stage in (first, last):
        phases = stage["phase_s"]
        # One forward per round here (one prompt): the prefill and every verify step.
        assert phases["forward"]["n"] == stage["forwards"] == rounds
        assert sum(p["s"] for p in phases.values()) <= stage["decode_s"] + 1e-3
        for p in phases.values():
            assert p["ms_per"] * p["n"] == pytest.approx(1e3 * p["s"], abs=0.06)  # s is rounded to 0.1 ms
            assert p["ms_per"] <= p["max_ms"] + 1e-3 and p["max_ms"] <= 1e3 * p["s"] + 0.06  # the longest span
        assert list(phases) == sorted(phases, key=lambda name: -phases[name]["s"])  # largest first
        # The first spans one by one: the first 16 of each phase (12 tokens: 12 forwards), in order.
        spans = stage["phase_first_ms"]
        assert set(spans) == set(phases)
        for name, kept in spans.items():
            assert len(kept) == min(phases[name]["n"], FIRST_SPANS)
            assert max(kept) <= phases[name]["max_ms"] + 1e-3 and sum(kept) <= 1e3 * phases[name]["s"] + 0.06
    # Every round's message is read once (the last one by the turn that finds nothing left to launch).
    assert first["phase_s"]["message"]["n"] == rounds


def test_plain_decoding_has_no_draft_phase(capsys: pytest.CaptureFixture[str]) -> None:
    result = generate(capsys, k=0)
    assert not {"draft", "draft_backlog"} & set(result["stages"][-1]["phase_s"])


def profiled(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, out: Path, env: str) -> list[str]:
    """A short drafting run with the profile of ``env`` written to ``out``: the files there."""
    monkeypatch.setenv(env, str(out))
    generate(capsys, k=3, tokens=6)
    return sorted(p.name for p in out.iterdir())


def test_profile_directory_gets_one_operator_table_per_stage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "profile"
    assert profiled(capsys, monkeypatch, out, PROFILE_ENV) == ["stage0_ops.txt", "stage1_ops.txt"]
    last = (out / "stage1_ops.txt").read_text()
    assert last.startswith("# stage 1 on cpu") and "aten::mm" in last


def test_python_profile_writes_each_stages_functions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "py"
    files = profiled(capsys, monkeypatch, out, PY_PROFILE_ENV)
    assert files == ["stage0_py.prof", "stage0_py.txt", "stage1_py.prof", "stage1_py.txt"]
    last = (out / "stage1_py.txt").read_text()
    assert last.startswith("# stage 1 on cpu") and "# sorted by cumulative" in last
    assert "(_turn)" in last and "(_draft)" in last  # the rounds and the last stage's drafting, by name
    assert "(_draft)" not in (out / "stage0_py.txt").read_text()


def test_bad_settings_are_usage_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PHASE_SYNC_ENV, "maybe")
    with pytest.raises(Exception, match=f"{PHASE_SYNC_ENV}='maybe'"):
        PhaseClock(__import__("torch").device("cpu"))
    monkeypatch.delenv(PHASE_SYNC_ENV)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(PROFILE_ENV, str(blocker))
    target, draft = shipped_pair()
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--pp", "2", "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "3", "--json", "--timeout", "60"])
    assert code == 2
    assert f"{PROFILE_ENV}=" in capsys.readouterr().err
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "a"))
    monkeypatch.setenv(PY_PROFILE_ENV, str(tmp_path / "b"))
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--pp", "2", "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "3", "--json", "--timeout", "60"])
    assert code == 2
    assert f"set {PROFILE_ENV} or {PY_PROFILE_ENV}, not both" in capsys.readouterr().err
