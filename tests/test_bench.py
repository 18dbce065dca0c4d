"""The benchmark driver's machine-readable output, and the CPU side of the GPU-only P3 projection.

Ratios are never asserted here (they are measured by ``pipespec bench``, not timed in unit tests): these
tests pin the output contract scripts rely on and that the projection code runs and does its arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"id", "value", "goal", "unit", "meets", "device", "command"}


def _bench_json(*args: str) -> list[dict[str, object]]:
    cmd = [sys.executable, "-c", "import sys; from pipespec.cli import main; sys.exit(main())", "bench", *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)  # stdout is the JSON list only; tables went to stderr
    assert isinstance(rows, list) and rows
    for row in rows:
        assert REQUIRED <= set(row), row
        assert isinstance(row["value"], (int, float)) and isinstance(row["meets"], (bool, type(None)))
        assert row["command"].startswith("pipespec bench ") and "--quick" in row["command"]
    return rows


@pytest.mark.timeout(240)
def test_p4_quick_json_has_the_required_keys() -> None:
    rows = _bench_json("p4", "--quick")
    assert [r["id"] for r in rows] == ["P4.hot_path_us"]
    assert rows[0]["unit"] == "us/step" and rows[0]["value"] > 0


@pytest.mark.timeout(240)
def test_p2_quick_json_reports_every_decode_size_through_real_processes() -> None:
    rows = _bench_json("p2", "--quick")
    ids = {r["id"] for r in rows}
    for tokens in (1, 4, 16, 64):
        assert {f"P2.aux_over_plain.T{tokens}", f"P2.separate_over_packed.T{tokens}"} <= ids
    for row in rows:
        assert row["value"] > 0
        if row["id"].startswith("P2.aux_over_plain"):
            assert row["goal"] == "<= 1.2" and row["meets"] == (row["value"] <= 1.2)


def test_acceptance_model_hits_the_public_tau_and_grows_with_k() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.p3_speedup import acceptance_alpha, expected_tau

    alpha = acceptance_alpha(3.0, 3)
    assert 0.8 < alpha < 0.82
    assert expected_tau(alpha, 3) == pytest.approx(3.0, abs=1e-9)
    taus = [expected_tau(alpha, k) for k in (0, 1, 3, 5)]
    assert taus[0] == 1.0 and taus == sorted(taus) and taus[-1] < 1 / (1 - alpha)


@pytest.mark.timeout(240)
def test_the_70b_projection_runs_on_cpu_at_toy_size_and_labels_itself() -> None:
    """The GPU-only projection path (real LlamaModel, real Eagle3Draft.propose) at toy dimensions."""
    sys.path.insert(0, str(ROOT))
    from bench.p3_speedup import TargetShape, acceptance_alpha, expected_tau, project_70b

    shape = TargetShape(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, draft_vocab=128, num_layers=4, context=32)
    rows = project_70b([1, 3], [1, 2], "pipespec bench p3", device="cpu", shape=shape)
    assert [r.id for r in rows] == [f"P3.projection_70b.speedup.c{c}.k{k}" for c in (1, 2) for k in (1, 3)]
    alpha = acceptance_alpha(3.0, 3)
    for row in rows:
        assert row.unit == "x (projection)" and row.detail.startswith("PROJECTION, not a run")
        k = int(row.id.rsplit(".k", 1)[1])
        # value = tau(k) * plain / (verify + draft), with the three costs printed in the detail
        plain = float(row.detail.split("plain step ")[1].split(" ms")[0])
        verify = float(row.detail.split("verify ")[1].split(" ms")[0])
        draft = float(row.detail.split("draft ")[1].split(" ms")[0])
        assert row.value == pytest.approx(expected_tau(alpha, k) * plain / (verify + draft), rel=0.02, abs=0.01)
        assert row.goal == (">= 2.3" if row.id.endswith(("c1.k1", "c1.k3")) else ">= 1")
