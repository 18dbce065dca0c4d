"""``pipespec generate`` across real gloo processes is lossless: token-for-token equal to the target's own
``generate(do_sample=False)`` in float32, for P = 1..4, uneven partitions, k in {0, 1, 3, 5}, aux ids on
every stage boundary and ids 0 and N, batches, drafts in Format A and B with and without embed_tokens,
four model families and a sharded checkpoint.

Losslessness alone would not catch a wrong aux state (the target corrects any draft). So every run
also records which drafts each verify step checked (``--trace``): they must be identical for every P,
and equal to drafts recomputed from scratch from transformers' own hidden states (``oracle_drafts``).
Each launch runs several prompts, to keep the process start-ups few.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipespec.cli import main
from pipespec.cli.demo import shipped_pair
from pipespec.engine.draft_checkpoint.info import TargetInfo
from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint
from pipespec.engine.reference import target_aux_states
from pipespec.engine.tiny_checkpoints import write_agreeing_pair, write_tiny_draft, write_tiny_target
from pipespec.pp.loading import open_checkpoint

PROMPTS = [([5, 17, 3, 42, 8], 10), ([7], 12), ([40, 2, 2, 31, 9, 11, 47, 3, 1], 8)]


pytestmark = pytest.mark.usefixtures("one_thread_per_stage")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    out: dict[str, Path] = {}
    out["llama"] = write_tiny_target(root / "llama", "llama", num_layers=8, seed=1)
    cfg = AutoConfig.from_pretrained(out["llama"])
    out["llama_draft_b"] = write_tiny_draft(root / "llama_draft_b", cfg, format="B", seed=2)
    # Ids 0 and N, and one on each boundary of the partition (1, 2, 3, 2): 1, 3, 6.
    out["llama_draft_bound"] = write_tiny_draft(
        root / "llama_draft_bound", cfg, format="B", aux_layers=(0, 1, 3, 6, 8), with_embedding=True, seed=3
    )
    out["qwen2"] = write_tiny_target(root / "qwen2", "qwen2", num_layers=5, seed=4)
    out["qwen2_draft_a"] = write_tiny_draft(root / "qwen2_draft_a", AutoConfig.from_pretrained(out["qwen2"]), format="A", seed=5)
    out["mistral"] = write_tiny_target(root / "mistral", "mistral", num_layers=4, seed=6)
    out["mistral_draft_a"] = write_tiny_draft(
        root / "mistral_draft_a", AutoConfig.from_pretrained(out["mistral"]), format="A", with_embedding=True, seed=7
    )
    out["qwen3"] = write_tiny_target(root / "qwen3", "qwen3", num_layers=4, seed=8)
    out["qwen3_draft_b"] = write_tiny_draft(root / "qwen3_draft_b", AutoConfig.from_pretrained(out["qwen3"]), format="B", seed=9)
    out["sharded"] = write_tiny_target(root / "sharded", "llama", num_layers=6, seed=10, max_shard_size="40KB")
    out["sharded_draft"] = write_tiny_draft(root / "sharded_draft", AutoConfig.from_pretrained(out["sharded"]), seed=11)
    out["agree"], out["agree_draft"], _ = write_agreeing_pair(root / "agree", root / "agree_draft", num_layers=4)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": m}) + "\n" for p, m in PROMPTS))
    out["prompts"] = prompts
    return out


def generate(capsys: pytest.CaptureFixture[str], *args: str, policy: str = "always") -> dict[str, Any]:
    """Run the real CLI (it starts the stage processes) and parse its JSON."""
    capsys.readouterr()
    code = main(["generate", *args, "--json", "--trace", "--spec-policy", policy, "--timeout", "60"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@cache
def hf_model(path: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@cache
def oracle(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """The target alone: transformers' greedy generate."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@cache
def oracle_draft_model(target: str, draft: str) -> Any:
    model = hf_model(target)
    return load_draft_checkpoint(draft, TargetInfo.from_config(model.config), target_embed=model.model.embed_tokens).model


def oracle_drafts(target: str, draft: str, aux_layers: list[int], tokens: list[int], committed: int, k: int) -> list[int]:
    """The k drafts for a sequence with ``committed`` tokens in the cache and ``tokens[committed]`` pending,
    recomputed from scratch: aux states from transformers' hidden states, a fresh draft cache."""
    model, dmodel = hf_model(target), oracle_draft_model(target, draft)
    with torch.no_grad():
        _, aux = target_aux_states(model, torch.tensor([tokens[:committed]]), aux_layers)
        cache_ = dmodel.new_cache(1, capacity=committed + k + 2)
        return dmodel.propose(aux, torch.tensor([tokens[1 : committed + 1]]), cache_, k)[0].tolist()


def check_against_oracles(result: dict[str, Any], target: Path, draft: Path | None, prompts: list[tuple[list[int], int]],
                          k: int, check_drafts: bool = True) -> None:
    outputs = result["outputs"] if "outputs" in result else [result]
    assert len(outputs) == len(prompts)
    for out, (prompt, budget) in zip(outputs, prompts):
        assert out["output_ids"] == oracle(str(target), tuple(prompt), budget)
        assert len(out["acceptance_lengths"]) + out["plain_steps"] == out["num_steps"]
        assert all(1 <= a <= k + 1 for a in out["acceptance_lengths"])
        if not (check_drafts and draft is not None and k > 0):
            continue
        tokens = list(prompt) + out["output_ids"]
        committed = len(prompt)
        gains = iter(out["acceptance_lengths"])
        assert len(out["draft_trace"]) == out["num_steps"]
        for drafts in out["draft_trace"]:  # [] is a plain step (the speculation policy chose no drafts)
            if not drafts:
                committed += 1
                continue
            assert drafts == oracle_drafts(str(target), str(draft), result["aux_layers"], tokens, committed, k)
            committed += next(gains)


def by_step(result: dict[str, Any]) -> list[Any]:
    """What must not depend on P: tokens, acceptance, and the drafts every step checked."""
    return [(o["output_ids"], o["acceptance_lengths"], o["draft_trace"]) for o in result["outputs"]]


@pytest.mark.timeout(300)
def test_llama_is_lossless_and_identical_across_p(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """P = 1, 2 (even), 3 (uneven 1,4,3) and 4: same tokens as generate, same drafts and acceptance."""
    common = ["--target", str(ckpts["llama"]), "--draft", str(ckpts["llama_draft_b"]), "--prompts-file",
              str(ckpts["prompts"]), "--num-spec-tokens", "3"]
    base = generate(capsys, *common, "--pp", "1")
    assert base["aux_layers"] == [2, 4, 5] and base["aux_convention"] == "input"
    assert base["draft_embedding"] == "shared"
    check_against_oracles(base, ckpts["llama"], ckpts["llama_draft_b"], PROMPTS, 3)
    for extra in (["--pp", "2"], ["--pp", "3", "--partition", "1,4,3"], ["--pp", "4"]):
        result = generate(capsys, *common, *extra)
        assert by_step(result) == by_step(base), extra
        assert result["mean_acceptance_length"] == base["mean_acceptance_length"]
    assert result["partition"] == [2, 2, 2, 2]


@pytest.mark.timeout(300)
def test_aux_ids_zero_n_and_on_every_boundary(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Ids 0, 1, 3, 6, 8 with partition (1, 2, 3, 2): every boundary id belongs to the upstream stage."""
    common = ["--target", str(ckpts["llama"]), "--draft", str(ckpts["llama_draft_bound"]), "--prompts-file",
              str(ckpts["prompts"]), "--num-spec-tokens", "5"]
    base = generate(capsys, *common, "--pp", "1")
    assert base["aux_layers"] == [0, 1, 3, 6, 8]
    assert base["draft_embedding"] == "own"
    check_against_oracles(base, ckpts["llama"], ckpts["llama_draft_bound"], PROMPTS, 5)
    split = generate(capsys, *common, "--pp", "4", "--partition", "1,2,3,2")
    assert by_step(split) == by_step(base)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("family", "draft", "pp", "k", "convention"),
    [("qwen2", "qwen2_draft_a", "2", "3", "output"), ("mistral", "mistral_draft_a", "3", "1", "output"),
     ("qwen3", "qwen3_draft_b", "4", "5", "input")],
)
def test_model_families_single_prompt(
    ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str], family: str, draft: str, pp: str, k: str, convention: str
) -> None:
    prompt, budget = PROMPTS[0]
    result = generate(capsys, "--target", str(ckpts[family]), "--draft", str(ckpts[draft]), "--pp", pp,
                      "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(budget), "--num-spec-tokens", k)
    assert result["aux_convention"] == convention
    assert result["pp"] == int(pp) and len(result["stages"]) == int(pp)
    check_against_oracles(result, ckpts[family], ckpts[draft], [(prompt, budget)], int(k))


@pytest.mark.timeout(300)
def test_sharded_checkpoint_and_bytes_per_stage(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    result = generate(capsys, "--target", str(ckpts["sharded"]), "--draft", str(ckpts["sharded_draft"]), "--pp", "3",
                      "--prompts-file", str(ckpts["prompts"]), "--num-spec-tokens", "3")
    check_against_oracles(result, ckpts["sharded"], ckpts["sharded_draft"], PROMPTS, 3, check_drafts=False)
    inventory = open_checkpoint(ckpts["sharded"]).tensors
    embed = sum(t.nbytes for n, t in inventory.items() if n.startswith("model.embed_tokens."))
    total = sum(t.nbytes for t in inventory.values())
    stages = result["stages"]
    for s in stages:
        layers = sum(t.nbytes for n, t in inventory.items()
                     if n.startswith("model.layers.") and s["start_layer"] <= int(n.split(".")[2]) < s["end_layer"])
        extra = sum(t.nbytes for n, t in inventory.items() if n.startswith(("model.norm.", "lm_head."))) + embed \
            if s["rank"] == 2 else (embed if s["rank"] == 0 else 0)
        assert s["bytes_read"] == layers + extra
        assert s["checkpoint_bytes"] == total
    # The draft ships no embedding, so the last stage also reads the target's (shared with the draft).
    assert result["draft_embedding"] == "shared"
    assert sum(s["bytes_read"] for s in stages) == total + embed


@pytest.mark.timeout(300)
def test_agreeing_pair_reaches_full_acceptance(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    result = generate(capsys, "--target", str(ckpts["agree"]), "--draft", str(ckpts["agree_draft"]), "--pp", "2",
                      "--prompts-file", str(ckpts["prompts"]), "--num-spec-tokens", "3")
    check_against_oracles(result, ckpts["agree"], ckpts["agree_draft"], PROMPTS, 3)
    for out in result["outputs"]:
        assert out["acceptance_lengths"] == [4] * out["num_steps"]
    assert result["mean_acceptance_length"] == 4.0


@pytest.mark.timeout(300)
def test_plain_pipeline_decoding_without_a_draft(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    result = generate(capsys, "--target", str(ckpts["llama"]), "--pp", "3", "--partition", "4,1,3",
                      "--prompts-file", str(ckpts["prompts"]), "--num-spec-tokens", "0")
    check_against_oracles(result, ckpts["llama"], None, PROMPTS, 0)
    assert result["aux_layers"] == [] and result["aux_convention"] is None
    assert result["mean_acceptance_length"] == 1.0
    assert [o["num_steps"] for o in result["outputs"]] == [m - 1 for _, m in PROMPTS]


@pytest.mark.timeout(300)
def test_generation_stops_at_eos_like_generate(ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With an EOS id that greedy decoding reaches mid-way, the output ends there, EOS included."""
    prompt, _ = PROMPTS[0]
    free = oracle(str(ckpts["llama"]), tuple(prompt), 12)
    eos = next(t for t in free[3:] if t not in free[:3])
    target = shutil.copytree(ckpts["llama"], tmp_path / "eos")
    for name in ("config.json", "generation_config.json"):
        data = json.loads((target / name).read_text())
        data["eos_token_id"] = eos
        (target / name).write_text(json.dumps(data))
    result = generate(capsys, "--target", str(target), "--draft", str(ckpts["llama_draft_b"]), "--pp", "2",
                      "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12", "--num-spec-tokens", "3")
    expected = oracle(str(target), tuple(prompt), 12)
    assert expected[-1] == eos and len(expected) < 12
    assert result["output_ids"] == expected
    assert result["eos_token_ids"] == [eos]


@pytest.mark.timeout(300)
@pytest.mark.skipif(shipped_pair() is None, reason="no trained demo pair (with a tokenizer) shipped in pipespec/demo")
def test_text_prompt_is_tokenized_and_decoded(capsys: pytest.CaptureFixture[str]) -> None:
    """--prompt TEXT goes through the target's tokenizer; the report shows the text; ids match generate."""
    from transformers import AutoTokenizer

    pair = shipped_pair()
    assert pair is not None
    target, draft = pair
    text = "def parse(line):\n"
    capsys.readouterr()
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--pp", "2", "--prompt", text,
                 "--max-new-tokens", "12", "--num-spec-tokens", "3"]) == 0
    report = capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompt = tuple(tokenizer(text)["input_ids"])
    expected = oracle(str(target), prompt, 12)
    assert f"output ids: {expected}" in report
    assert f"text: {tokenizer.decode(expected)!r}" in report
    assert re.search(r"steps \d+, mean acceptance length [\d.]+, [\d.]+ tokens/s, pp 2 partition \[\d+, \d+\], k 3", report)


@pytest.mark.timeout(300)
def test_overlap_aux_transport_is_lossless_and_equals_relay(ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """--aux-transport overlap (each aux state sent when captured; ids on every boundary, so the aliased
    boundary keys too) gives the same tokens and the same checked drafts as relay, for every forward
    overlapped and for prefills only (the two modes mixed on one pair of stages)."""
    common = ["--target", str(ckpts["llama"]), "--draft", str(ckpts["llama_draft_bound"]), "--pp", "4",
              "--partition", "1,2,3,2", "--prompts-file", str(ckpts["prompts"]), "--num-spec-tokens", "3"]
    relay = generate(capsys, *common)
    every = generate(capsys, *common, "--aux-transport", "overlap", "--overlap-min-tokens", "1")
    prefill = generate(capsys, *common, "--aux-transport", "overlap", "--overlap-min-tokens", "5")
    assert by_step(every) == by_step(relay) == by_step(prefill)
    sent = [[s.get("overlap_messages_sent", 0) for s in r["stages"]] for r in (relay, every, prefill)]
    assert sum(sent[0]) == 0 and all(n > 0 for n in sent[1][:-1]) and 0 < sum(sent[2]) < sum(sent[1]), sent
    check_against_oracles(every, ckpts["llama"], ckpts["llama_draft_bound"], PROMPTS, 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backlog", "graphs"), [("256", "off"), ("3", "off"), ("3", "on")])
def test_adaptive_policy_is_lossless_and_resumes_drafting_with_full_context(
    ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    backlog: str, graphs: str,
) -> None:
    """The default policy measures both modes, so a long run has plain steps (no drafts) and speculative
    steps after them; the draft must then propose from its full context (the positions verified while
    not speculating, ingested late): every speculative step's drafts equal the from-scratch oracle. With a
    backlog of 3 positions the draft also ingests in the middle of plain stretches (the stage processes
    inherit the environment). With ``--cuda-graphs on`` (emulated on CPU) the verify forwards and the
    proposals run on fixed buffers and the backlog is ingested into the fixed draft storage."""
    monkeypatch.setenv("PIPESPEC_DRAFT_BACKLOG", backlog)
    prompts = [([5, 17, 3, 42, 8], 160), ([7, 9], 150)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": m}) + "\n" for p, m in prompts))
    result = generate(capsys, "--target", str(ckpts["llama"]), "--draft", str(ckpts["llama_draft_b"]), "--pp", "2",
                      "--prompts-file", str(path), "--num-spec-tokens", "3", "--cuda-graphs", graphs, policy="adaptive")
    check_against_oracles(result, ckpts["llama"], ckpts["llama_draft_b"], prompts, 3)
    assert result["spec_policy"] == "adaptive" and result["plain_rounds"] > 0
    resumed = [
        any(before == [] and after for before, after in zip(o["draft_trace"], o["draft_trace"][1:]))
        for o in result["outputs"]
    ]
    assert any(resumed), "no speculative step followed a plain one"
    last = result["stages"][-1]
    assert last["draft_backlog"] == int(backlog) and last["draft_ingests"] >= 1
    if graphs == "on":
        assert last["graph_replays"] > 0 and last["draft_graph_replays"] > 0 and last["draft_eager_proposals"] == 0


@pytest.mark.timeout(300)
def test_sliding_window_model_runs_one_forward_per_sequence_and_stays_lossless(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A window shorter than the outputs: holes cannot be masked in a sliding window, so every sequence
    runs as its own forward (``batched_forwards`` false), several sequences and micro-batches at P = 2."""
    target = write_tiny_target(tmp_path / "mistral", "mistral", num_layers=4, seed=12, sliding_window=6)
    draft = write_tiny_draft(tmp_path / "draft", AutoConfig.from_pretrained(target), format="B", seed=13)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": m}) + "\n" for p, m in PROMPTS))
    result = generate(capsys, "--target", str(target), "--draft", str(draft), "--pp", "2", "--prompts-file", str(path),
                      "--num-spec-tokens", "3", "--micro-batches", "2")
    assert result["batched_forwards"] is False and result["micro_batches"] == 2
    check_against_oracles(result, target, draft, PROMPTS, 3)
