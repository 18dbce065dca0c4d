"""``pipespec demo`` (what ``make demo`` runs): real stage processes, parity with P=1 and plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipespec.cli import main
from pipespec.cli.demo import shipped_pair

pytestmark = pytest.mark.usefixtures("one_thread_per_stage")


@pytest.mark.timeout(300)
def test_constructed_demo_reaches_full_acceptance_and_parity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    args = ["demo", "--pair", "constructed", "--cache-dir", str(cache), "--max-new-tokens", "13", "--num-spec-tokens", "3",
            "--repeats", "1"]
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["pair"] == "constructed" and summary["pp"] == 2
    assert summary["parity_with_p1"] and summary["parity_with_plain_decoding"]
    assert summary["mean_acceptance_length"] == 4.0
    assert [len(o["output_ids"]) for o in summary["outputs"]] == [13, 13, 13]
    assert [s["rank"] for s in summary["stages"]] == [0, 1]
    built = (cache / "target" / "model.safetensors").stat().st_mtime_ns

    # The second run reuses the cached pair and prints the human report.
    assert main(args) == 0
    report = capsys.readouterr().out
    assert (cache / "target" / "model.safetensors").stat().st_mtime_ns == built
    assert "mean acceptance length 4.00 tokens/step" in report
    assert "parity: P=2 with drafts vs P=1 with drafts vs P=2 plain decoding: identical token for token" in report


@pytest.mark.timeout(300)
@pytest.mark.skipif(shipped_pair() is None, reason="no trained demo pair shipped in pipespec/demo yet")
def test_shipped_demo_pair_runs_with_parity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--pair", "shipped", "--max-new-tokens", "16", "--repeats", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    # Tokens/s is the median of each mode's interleaved runs (of two: their mean).
    assert summary["repeats"] == 2 and len(summary["tokens_per_s_repeats"]) == 2
    assert summary["tokens_per_s"] == pytest.approx(sum(summary["tokens_per_s_repeats"]) / 2)
    assert summary["plain_tokens_per_s"] == pytest.approx(sum(summary["plain_tokens_per_s_repeats"]) / 2)
    assert summary["parity_with_p1"] and summary["parity_with_plain_decoding"]
    assert all("text" in o for o in summary["outputs"])
    assert 1.0 <= summary["mean_acceptance_length"] <= 4.0
    # Tokens/s with and without drafts in the same run, and the policy's decision trace.
    assert summary["speedup"] == pytest.approx(summary["tokens_per_s"] / summary["plain_tokens_per_s"], abs=1e-3)
    assert summary["spec_policy"] == "adaptive" and summary["micro_batches"] == 1  # 3 prompts: 8 tokens per forward
    policy = summary["policy"]
    assert policy["spec_rounds"] + policy["plain_rounds"] >= max(o["num_steps"] for o in summary["outputs"])
    assert all({"round", "mode", "reason"} <= set(d) for d in policy["trace"])
