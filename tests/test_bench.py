"""The benchmark driver's machine-readable output, the CPU side of the GPU-only P3 projection, ``--pair``,
and the training script's presets and wall-time cap.

Ratios are never asserted here (they are measured by ``pipespec bench``, not timed in unit tests): these
tests pin the output contract scripts rely on and that the projection code runs and does its arithmetic.
"""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipespec.contract.layout import eagle3_default_aux_ids

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"id", "value", "goal", "unit", "meets", "device", "command"}


def _bench_json(*args: str) -> list[dict[str, Any]]:
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
    from pipespec.bench.p3_speedup import acceptance_alpha, expected_tau

    alpha = acceptance_alpha(3.0, 3)
    assert 0.8 < alpha < 0.82
    assert expected_tau(alpha, 3) == pytest.approx(3.0, abs=1e-9)
    taus = [expected_tau(alpha, k) for k in (0, 1, 3, 5)]
    assert taus[0] == 1.0 and taus == sorted(taus) and taus[-1] < 1 / (1 - alpha)


@pytest.mark.timeout(240)
def test_the_70b_projection_runs_on_cpu_at_toy_size_and_labels_itself() -> None:
    """The GPU-only projection path (real LlamaModel, real Eagle3Draft.propose) at toy dimensions."""
    from pipespec.bench.p3_speedup import TargetShape, acceptance_alpha, expected_tau, project_70b

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


# ------------------------------------------------------------------------------------------ --pair
def _tiny_pair(root: Path) -> Path:
    from transformers import AutoConfig

    from pipespec.engine.tiny_checkpoints import write_tiny_draft, write_tiny_target

    target = write_tiny_target(root / "target", "llama", seed=1)
    write_tiny_draft(root / "draft", AutoConfig.from_pretrained(target), seed=2)
    return root


@pytest.mark.timeout(240)
def test_p3_quick_runs_on_the_given_pair_and_records_it(tmp_path: Path) -> None:
    pair = _tiny_pair(tmp_path / "pair").resolve()
    out = tmp_path / "out"
    rows = _bench_json("p3", "--quick", "--pair", str(pair), "--out", str(out))
    by_id = {r["id"]: r for r in rows}
    assert {"P3.speedup.c1.k3", "P3.speedup.c8.k3", "P3.speedup.c1.k3.adaptive", "P3.speedup.c8.k3.adaptive",
            "P3.acceptance.c1.k3", "P3.acceptance.c8.k3"} <= set(by_id)
    for c in (1, 8):
        row = by_id[f"P3.speedup.c{c}.k3"]
        assert f"pair {pair}: llama target, 4 layers" in row["detail"], row["detail"]
        assert row["value"] > 0 and f"--pair {pair}" in row["command"]
    # One raw record per generate run, written as each finished, naming the pair too.
    runs = [json.loads(line) for line in (out / "p3_runs.jsonl").read_text().splitlines()]
    assert [(r["c"], r["k"], r["spec_policy"]) for r in runs] == [
        (c, k, policy) for c in (1, 8) for k, policy in ((0, "always"), (3, "always"), (3, "adaptive"))
    ]
    assert all(str(pair) in r["pair"] and r["generate"]["tokens_per_s"] > 0 for r in runs)
    assert json.loads((out / "p3.json").read_text()) == rows
    # The policy rows: adaptive / the better of always and plain, with the adaptive run's decision trace.
    rates = {(r["c"], r["k"], r["spec_policy"]): r["generate"]["tokens_per_s"] for r in runs}
    for c in (1, 8):
        row = by_id[f"P3.policy.c{c}"]
        assert row["value"] == pytest.approx(rates[c, 3, "adaptive"] / max(rates[c, 3, "always"], rates[c, 0, "always"]))
        assert row["goal"] == ">= 0.97" and "adaptive rounds speculative" in row["detail"]
        # One repeat: the paired figure (each repeat's own ratio, then the median) is the same ratio.
        assert f"its better fixed run: {row['value']:.3f})" in row["detail"], row["detail"]
        trace = next(r["generate"]["policy_trace"] for r in runs if (r["c"], r["spec_policy"]) == (c, "adaptive"))
        assert trace["spec_rounds"] + trace["plain_rounds"] == len(trace["rounds"]) > 0
        assert trace["load_checks"] <= trace["load_changes"] and f"load changes [{trace['load_changes']}]" in row["detail"]


@pytest.mark.timeout(400)
def test_p3_policy_script_writes_the_policy_rows_at_pp1_with_a_control_and_pools_calls(tmp_path: Path) -> None:
    """``python -m pipespec.bench.p3_speedup`` (the command for a one-GPU measurement) on CPU at PP = 1, tiny sizes, with the
    A/A control and a lead-in; then ``--pool`` over two calls' runs gives the rows of their runs together."""
    pair = _tiny_pair(tmp_path / "pair").resolve()
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pipespec.bench.p3_speedup", "--pp", "1", "--c", "2", "--tokens", "6", "--repeats", "2", "--control",
         "--pair", str(pair), "--out", str(out)],
        capture_output=True, text=True, timeout=380, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["id"]: r for r in json.loads((out / "p3_policy.json").read_text())}
    assert list(rows) == ["P3.control.c2.pp1", "P3.policy.c2.pp1"]
    assert "PP=1" in rows["P3.policy.c2.pp1"]["detail"] and rows["P3.policy.c2.pp1"]["value"] > 0
    runs = [json.loads(line) for line in (out / "p3_runs.jsonl").read_text().splitlines()]
    assert [r["lead_in"] for r in runs] == [True] + [False] * 8 and all(r["pp"] == 1 for r in runs)
    counted = [r for r in runs if not r["lead_in"]]
    assert sorted((r["k"], r["spec_policy"]) for r in counted) == sorted(
        [(0, "always"), (3, "always"), (3, "adaptive"), (3, "control")] * 2)
    rates: dict[str, list[float]] = {}
    for r in counted:
        rates.setdefault(r["spec_policy"] + str(r["k"]), []).append(r["generate"]["tokens_per_s"])
    median = statistics.median
    assert rows["P3.control.c2.pp1"]["value"] == pytest.approx(median(rates["control3"]) / median(rates["always3"]))
    assert rows["P3.control.c2.pp1"]["meets"] is None
    # Pooled: the same file twice stands for two calls; the rows are the medians over both.
    gz = tmp_path / "again.jsonl.gz"
    gz.write_bytes(gzip.compress((out / "p3_runs.jsonl").read_bytes()))
    pooled = subprocess.run([sys.executable, "-m", "pipespec.bench.p3_speedup", "--pool", str(out / "p3_runs.jsonl"), str(gz),
                             "--out", str(tmp_path / "pooled")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            check=False)
    assert pooled.returncode == 0, pooled.stderr[-2000:]
    rows2 = {r["id"]: r for r in json.loads((tmp_path / "pooled" / "p3_policy_pooled.json").read_text())}
    best = max(median(rates["always3"] * 2), median(rates["always0"] * 2))
    assert rows2["P3.policy.c2.pp1"]["value"] == pytest.approx(median(rates["adaptive3"] * 2) / best)
    assert "medians of 4 interleaved" in rows2["P3.policy.c2.pp1"]["detail"] and "2 calls pooled" in rows2["P3.policy.c2.pp1"]["detail"]
    # Runs of other settings, or a line that is not a run, are one usage error naming the file and line.
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({**r, "new_tokens": 7}) + "\n" for r in runs[:2]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text((out / "p3_runs.jsonl").read_text().splitlines()[0] + "\n{not json\n")
    for bad, says in ((other, f"{other}:1: new_tokens = 7, but the first run pooled has 6"), (broken, f"{broken}:2: not a run")):
        proc = subprocess.run([sys.executable, "-m", "pipespec.bench.p3_speedup", "--pool", str(out / "p3_runs.jsonl"), str(bad),
                               "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              check=False)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "bad" / "p3_policy_pooled.json").exists()


@pytest.mark.parametrize("case", ["missing", "no_draft", "other_bench"])
def test_bad_pair_is_one_usage_line(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pipespec.cli import main

    root = tmp_path / "pair"
    name = "p3"
    if case == "no_draft":
        (root / "target").mkdir(parents=True)
        (root / "target" / "config.json").write_text("{}")
    elif case == "other_bench":
        _tiny_pair(root)
        name = "p5"
    capsys.readouterr()  # the checkpoint writer's progress bars
    assert main(["bench", name, "--quick", "--pair", str(root)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipespec: error: --pair"), captured.err
    expected = {"missing": f"{root}: no such directory", "no_draft": f"{root / 'draft'} is missing",
                "other_bench": "not by 'p5'"}[case]
    assert expected in lines[0]
    assert captured.out == ""


# ---------------------------------------------------------------------------------- train_demo
def _train_demo() -> Any:
    """The command (``bench/train_demo.py``) and the steps it runs (``bench/demo_training``), by module."""
    sys.path.insert(0, str(ROOT))
    import types

    import bench.train_demo as command
    from bench.demo_training import draft_model, draft_training, presets, target_training

    return types.SimpleNamespace(main=command.main, parse_args=command.parse_args, preset_for=command.preset_for,
                                 PRESETS=presets.PRESETS, make_target=target_training.make_target,
                                 train_target=target_training.train_target, make_draft=draft_model.make_draft,
                                 draft_vocabulary=draft_model.draft_vocabulary, train_draft=draft_training.train_draft)


def test_medium_preset_builds_a_50_to_60m_target_and_its_draft() -> None:
    td = _train_demo()
    p = td.PRESETS["medium"]
    target = td.make_target(p, p.vocab_size, eos_id=0)
    params = sum(q.numel() for q in target.parameters())
    assert 50e6 <= params <= 60e6, params
    config = target.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size) == (
        p.hidden_size, p.num_layers, p.intermediate_size, p.vocab_size)
    assert config.num_attention_heads % config.num_key_value_heads == 0 and config.tie_word_embeddings
    aux = eagle3_default_aux_ids(p.num_layers)
    draft = td.make_draft(p, config, torch.arange(p.draft_vocab_size), aux)
    assert draft.lm_head.out_features == p.draft_vocab_size < p.vocab_size
    assert draft.fc.in_features == len(aux) * p.hidden_size
    assert draft.midlayer.mlp.gate_proj.out_features == p.draft_intermediate_size


def test_preset_and_quick_are_mutually_exclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    td = _train_demo()
    with pytest.raises(SystemExit) as exc:
        td.main(["--out", str(tmp_path), "--quick", "--preset", "medium"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("flags", "message"), [
    (["--retrain-draft", "sdk/pipespec/demo", "--aux-layers", "2,5,9"], "id 9 is past the target's 8 layers"),
    (["--retrain-draft", "sdk/pipespec/demo", "--aux-layers", "2,x"], "give comma-separated layer ids"),
    (["--aux-layers", "2,5,8"], "--aux-layers needs --retrain-draft DIR"),
])
def test_bad_aux_layers_are_one_usage_line_and_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             flags: list[str], message: str) -> None:
    td = _train_demo()
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[1]
    flags = [str(root / f) if f.startswith("sdk/") else f for f in flags]
    try:
        code = td.main(["--out", str(out), *flags])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--vocab-size", "256"], "256 is below 257"),
    (["--vocab-size", "512", "--retrain-draft", "sdk/pipespec/demo"], "--vocab-size trains a new tokenizer"),
])
def test_bad_vocab_size_is_one_usage_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             flags: list[str], message: str) -> None:
    td = _train_demo()
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        td.main(["--out", str(out), *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_vocab_size_overrides_the_preset_and_the_draft_keeps_a_smaller_vocabulary_whole() -> None:
    td = _train_demo()
    from bench.demo_training.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 50], 270)
    assert 257 <= len(tokenizer) <= 270
    stream = torch.tensor([0, 3, 3, 5, 7, 7, 7], dtype=torch.int32)
    assert td.draft_vocabulary(stream, 9, 512).tolist() == list(range(9))
    assert td.draft_vocabulary(stream, 9, 2).tolist() == [3, 7]
    name, p = td.preset_for(td.parse_args(["--out", "x", "--vocab-size", "512", "--batch-size", "32"]))
    demo = td.PRESETS["demo"]
    assert (name, p.vocab_size, p.batch_size, p.hidden_size) == ("demo", 512, 32, demo.hidden_size)
    assert (demo.vocab_size, demo.batch_size) != (512, 32)


@pytest.mark.timeout(300)
def test_a_preset_with_a_draft_recipe_trains_the_target_then_the_draft_on_its_generations(tmp_path: Path) -> None:
    """One command, both steps (the ``demo`` preset's shape at smoke size): the draft is EAGLE3's recipe on the
    target's own greedy generations, and metrics.json keeps the target's training record beside the recipe."""
    td = _train_demo()
    from bench.demo_training.pair import train_pair
    from bench.demo_training.presets import GenerationRecipe

    recipe = GenerationRecipe(sequences=12, prompt_len=8, new_tokens=10, gen_batch=12, steps=3, batch_size=4,
                              draft_vocab_size=512, draft_intermediate_size=32, heldout_sequences=4)
    p = replace(td.PRESETS["quick"], target_steps=4, batch_size=4, seq_len=32, eval_prompts=2, eval_new_tokens=8,
                draft_recipe=recipe)
    args = td.parse_args(["--out", str(tmp_path), "--quick", "--draft-steps", "2"])
    assert train_pair(args, [], "quick", p, lambda _msg: None, 0.0) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["recipe"]["kind"].startswith("EAGLE3 training-time test")
    assert (metrics["recipe"]["sequences"], metrics["recipe"]["steps"], metrics["recipe"]["batch_size"]) == (12, 2, 4)
    assert metrics["target"]["steps_run"] == 4 and metrics["target"]["parameters"] > 0
    assert metrics["draft"]["steps_run"] == 2 and metrics["draft"]["init"] == {"from": "scratch"}
    assert {"corpus_and_tokenizer_s", "target_training_s", "generations_s", "draft_training_s"} <= set(
        metrics["phases_s"])
    assert metrics["settings"]["draft_recipe"]["sequences"] == 12
    assert (tmp_path / "target" / "config.json").is_file() and (tmp_path / "draft" / "config.json").is_file()


def test_training_loops_stop_at_the_wall_time_cap_and_say_so() -> None:
    td = _train_demo()
    p = replace(td.PRESETS["quick"], target_steps=3, draft_steps=3, batch_size=2, seq_len=16)
    torch.manual_seed(0)
    stream = torch.randint(0, 64, (400,), dtype=torch.int32)
    target = td.make_target(p, 64, eos_id=0)
    logs: list[str] = []
    capped = td.train_target(target, stream, p, "cpu", 0, logs.append, max_s=1e-9)
    assert (capped["steps_run"], capped["planned_steps"], capped["time_capped"]) == (1, 3, True)
    assert any("stopping after 1 of 3 steps" in line for line in logs)
    full = td.train_target(target, stream, p, "cpu", 0, logs.append)
    assert (full["steps_run"], full["time_capped"], full["max_train_s"]) == (3, False, None)
    aux = eagle3_default_aux_ids(p.num_layers)
    draft = td.make_draft(p, target.config, td.draft_vocabulary(stream, 64, 32), aux)
    stats = td.train_draft(draft, target, aux, stream, p, "cpu", 0, logs.append, max_s=1e-9)
    assert (stats["steps_run"], stats["planned_steps"], stats["time_capped"]) == (1, 3, True)


@pytest.mark.timeout(240)
def test_pipeline_sweep_script_measures_fixed_length_prompts_and_writes_its_files(tmp_path: Path) -> None:
    """``python -m pipespec.bench.pipeline_microbatches``: both schedules run side by side through real stage
    processes, with prompts of the given length, and the outputs of the two schedules are compared."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pipespec.bench.pipeline_microbatches", "--device", "cpu", "--c", "3", "--tokens", "3", "--repeats", "1",
         "--prompt-len", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["id"]: row for row in json.loads((out / "pipeline_sweep.json").read_text())}
    assert set(rows) == {"pipeline.ratio.c3.p40", "pipeline.tokens_per_s.c3.p40.mb1", "pipeline.tokens_per_s.c3.p40.mb2",
                         "pipeline.default.c3.p40"}
    # c = 3 at k = 3: 8 tokens per micro-batch forward with two, below the CPU threshold: one.
    assert "default --micro-batches picked 1 (one micro-batch: 2 would carry 8 tokens per forward each, < 16 on cpu" in (
        rows["pipeline.default.c3.p40"]["detail"])
    ratio = rows["pipeline.ratio.c3.p40"]
    assert "outputs identical" in ratio["detail"] and "prompts of 40 tokens" in ratio["detail"]
    assert ratio["value"] == pytest.approx(rows["pipeline.tokens_per_s.c3.p40.mb2"]["value"]
                                           / rows["pipeline.tokens_per_s.c3.p40.mb1"]["value"])
    runs = [json.loads(line) for line in (out / "pipeline_runs.jsonl").read_text().splitlines()]
    assert [r["micro_batches"] for r in runs] == [1, 2, 0]  # 0: no --micro-batches (the default rule)
    # The default's row: the count it picked (1, its own run pooled in) ÷ the better of 1 and 2.
    rate = {r["micro_batches"]: r["generate"]["tokens_per_s"] for r in runs}
    one = (rate[1] + rate[0]) / 2
    assert rows["pipeline.default.c3.p40"]["value"] == pytest.approx(one / max(one, rate[2]))
    assert [r["generate"]["micro_batches"] for r in runs] == [1, 2, 1]
    assert all(r["prompt_len"] == 40 and len(r["generate"]["outputs"]) == 3 for r in runs)
    assert all(len(o["output_ids"]) == 3 for r in runs for o in r["generate"]["outputs"])


def test_pipeline_sweep_script_refuses_bad_concurrencies(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipespec.bench.pipeline_microbatches", "--c", "8,x", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert proc.returncode == 2 and "--c '8,x'" in proc.stderr


def test_p3_runs_one_c_after_another_each_after_a_lead_in_of_its_own_c() -> None:
    """Each c's runs come together, in a carry-over balanced order (``pipespec.bench.run_order``), after one unmeasured
    run of the same c; every variant is measured ``repeats`` times, at every place of a repeat equally often."""
    from pipespec.bench.p3_speedup import CONTROL, interleaved, policy_runs

    runs = policy_runs([1, 8], control=True)
    assert {r[2] for r in runs} == {"always", "adaptive", CONTROL}
    order = interleaved(runs, 12)
    assert sorted(run for run, counted in order if counted) == sorted(runs * 12)
    for c in (1, 8):
        mine = [(run, counted) for run, counted in order if run[0] == c]
        assert [counted for _, counted in mine] == [False] + [True] * 48  # one lead-in, first
        assert order.index(mine[0]) == 0 or order[order.index(mine[0]) - 1][0][0] != c
        seq = [run for run, _ in mine]
        follows: dict[tuple[tuple[int, int, str], tuple[int, int, str]], int] = {}
        for before, after in zip(seq, seq[1:]):
            follows[before, after] = follows.get((before, after), 0) + 1
        assert len(follows) == 12 and set(follows.values()) == {4}, follows  # 4 variants, 12 = 4 x 3 repeats
        places = {run: sorted(seq[1:][i * 4:(i + 1) * 4].index(run) for i in range(12)) for run in set(seq)}
        assert all(p == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3] for p in places.values()), places
    assert [counted for _, counted in interleaved(runs, 1)] == [True] * 8  # one repeat: no lead-in


