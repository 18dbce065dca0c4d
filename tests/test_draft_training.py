"""Draft training matches draft inference, and the shipped demo pair really speculates.

The test-time-training forward of ``bench/train_demo.py`` (``bench/demo_training/draft_model.py``) computes
every root's unrolled chain at once with a hand-built attention pattern; if that pattern differed from what the draft's KV cache holds at
inference, the shipped draft would be trained for a different model than the one that runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pipespec.bench.corpus import generation_prompts
from pipespec.demo import demo_available, demo_draft_dir, demo_target_dir
from pipespec.engine.draft_checkpoint.info import TargetInfo
from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint
from pipespec.engine.draft_checkpoint.read import inspect_draft_checkpoint
from pipespec.engine.reference import reference_speculative_generate
from pipespec.engine.tiny_checkpoints import make_random_draft

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ``bench`` is the repository's, not an installed package

from bench.demo_training.draft_model import draft_vocabulary, make_draft, pruned_draft, ttt_logits  # noqa: E402
from bench.demo_training.draft_training import train_draft_on_generations  # noqa: E402
from bench.demo_training.generations import aux_features, greedy_generations  # noqa: E402
from bench.demo_training.heldout import HeldOut, heldout_metrics, ttt_hits, verify_walk  # noqa: E402
from bench.demo_training.loop import lr_at  # noqa: E402
from bench.demo_training.presets import PRESETS, GenerationRecipe  # noqa: E402


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_forward_equals_inference_with_the_kv_cache(steps: int) -> None:
    """Root t, step i of the training forward == the draft after verifying 0..t, then i cached steps."""
    target = LlamaConfig(hidden_size=32, vocab_size=60, num_hidden_layers=6)
    draft = make_random_draft(target, num_aux=3, with_embedding=True, draft_vocab_size=40, seed=1).eval()
    gen = torch.Generator().manual_seed(3)
    length = 9
    ids = torch.randint(0, 60, (2, length), generator=gen)
    feats = torch.randn(2, length, 96, generator=gen)
    with torch.no_grad():
        trained = ttt_logits(draft, feats, ids, steps)
        for row in range(2):
            for root in range(length - 1):
                cache = draft.new_cache(1)
                hidden = draft(ids[row : row + 1, 1 : root + 2], draft.combine_aux(feats[row : row + 1, : root + 1]), cache)
                last = hidden[:, -1:]
                for i in range(steps):
                    if root + 1 + i >= length:
                        break  # past the window: padding in training, masked from the loss
                    if i > 0:
                        last = draft(ids[row : row + 1, root + 1 + i : root + 2 + i], last, cache)
                    want = draft.logits(last)[0, 0]
                    got = trained[i][row, root]
                    assert torch.allclose(got, want, atol=1e-4), (row, root, i, (got - want).abs().max())


def _tiny_target():  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, vocab_size=60, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def test_generations_are_the_targets_greedy_tokens_and_the_labels_follow_them() -> None:
    """``--retrain-draft`` trains on the target's own outputs: every generated token is the argmax of a
    from-scratch forward over what precedes it, so the label the loss reads for root t at step i,
    ``x[t + 2 + i]``, is the target's greedy choice wherever the mask lets it count (t + 2 + i >= prompt)."""
    target = _tiny_target()
    prompt_len, new = 5, 7
    prompts = torch.randint(0, 60, (3, prompt_len), generator=torch.Generator().manual_seed(0))
    seqs = greedy_generations(target, prompts, new, batch=2, log=lambda _msg: None)
    assert seqs.shape == (3, prompt_len + new) and torch.equal(seqs[:, :prompt_len], prompts)
    with torch.no_grad():
        greedy = target(input_ids=seqs, use_cache=False).logits.argmax(-1)
    assert torch.equal(seqs[:, prompt_len:], greedy[:, prompt_len - 1 : -1])
    feats = aux_features(target, seqs, (2, 3, 4), batch=2)
    assert feats.shape == (3, prompt_len + new, 96) and feats.dtype == torch.float16


def test_init_draft_keeps_the_draft_when_nothing_is_pruned_and_prunes_the_weakest_units(tmp_path: Path) -> None:
    """``--init-draft``: the trained draft's weights carried over; cutting the MLP keeps the units with the
    largest output norms."""
    from dataclasses import replace

    from pipespec.engine.draft_checkpoint.write import save_draft_checkpoint

    target = _tiny_target()
    sizes = replace(PRESETS["quick"], hidden_size=32, num_heads=4, num_kv_heads=2, draft_intermediate_size=48)
    aux = (2, 3, 4)
    draft = make_draft(sizes, target.config, torch.arange(0, 60, 2), aux)
    save_draft_checkpoint(draft, tmp_path / "d", format="B", aux_layers=aux, include_embedding=False, dtype=torch.float32,
                          verifier="test", num_speculative_tokens=3)
    same, info = pruned_draft(tmp_path / "d", target, sizes, aux)
    assert info["intermediate_from"] == info["intermediate_to"] == 48
    want = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens.")}
    got = {k: v for k, v in same.state_dict().items() if not k.startswith("embed_tokens.")}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    cut, info = pruned_draft(tmp_path / "d", target, replace(sizes, draft_intermediate_size=40), aux)
    assert cut.midlayer.mlp.up_proj.weight.shape == (40, 32) and info["intermediate_to"] == 40
    mlp = draft.midlayer.mlp
    score = mlp.down_proj.weight.norm(dim=0) * mlp.up_proj.weight.norm(dim=1)
    kept = score.topk(40).indices.sort().values
    assert torch.equal(cut.midlayer.mlp.down_proj.weight, mlp.down_proj.weight[:, kept])
    with pytest.raises(RuntimeError, match="cannot grow"):
        pruned_draft(tmp_path / "d", target, replace(sizes, draft_intermediate_size=64), aux)


def test_lr_schedule_warms_up_then_decays_to_a_tenth() -> None:
    values = [lr_at(s, 100, 1.0) for s in range(100)]
    assert values[0] < values[4] <= 1.0 and abs(max(values) - 1.0) < 1e-9
    assert abs(values[-1] - 0.1) < 0.01 and all(a >= b for a, b in zip(values[5:], values[6:]))


@pytest.mark.skipif(not demo_available(), reason="the demo checkpoints are not installed with this package")
def test_shipped_demo_pair_is_small_loadable_and_documented() -> None:
    sizes = sum(f.stat().st_size for d in (demo_target_dir(), demo_draft_dir()) for f in d.rglob("*") if f.is_file())
    assert sizes <= 8_000_000  # issue 16: the shipped weights stay small (8 MB)
    tok = AutoTokenizer.from_pretrained(demo_target_dir())
    text = "def main():\n    return 0\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    target = AutoModelForCausalLM.from_pretrained(demo_target_dir(), dtype=torch.float32)
    assert sum(p.numel() for p in target.parameters()) <= 4_000_000
    info = inspect_draft_checkpoint(demo_draft_dir(), TargetInfo.from_config(target.config))
    assert info.format == "B" and info.aux_layers == (2, 4, 5) and info.aux_convention == "input"
    assert not info.has_embedding and info.config.draft_vocab_size <= target.config.vocab_size


@pytest.mark.timeout(300)
@pytest.mark.skipif(not demo_available(), reason="the demo checkpoints are not installed with this package")
def test_shipped_draft_speculates_losslessly() -> None:
    """Identical to plain greedy and clearly above one token per verify step (a random draft gets ~1)."""
    target = AutoModelForCausalLM.from_pretrained(demo_target_dir(), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(demo_target_dir())
    prompt = tok("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.", add_special_tokens=False)["input_ids"]
    loaded = _load(target, TargetInfo.from_config(target.config), None)
    plain, _ = reference_speculative_generate(target, loaded.model, (2, 4, 5), prompt, 32, 0)
    got, steps = reference_speculative_generate(target, loaded.model, loaded.info.aux_layers, prompt, 32, 3)
    assert got == plain
    assert sum(steps) / len(steps) >= 1.5, steps


def _load(target, info: TargetInfo, convention):  # type: ignore[no-untyped-def]
    return load_draft_checkpoint(demo_draft_dir(), info, aux_convention=convention,
                                 target_embed=target.get_input_embeddings())


def _shipped_pair():  # type: ignore[no-untyped-def]
    target = AutoModelForCausalLM.from_pretrained(demo_target_dir(), dtype=torch.float32).eval()
    return target, _load(target, TargetInfo.from_config(target.config), None)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not demo_available(), reason="the demo checkpoints are not installed with this package")
def test_replayed_acceptance_is_the_engines_on_every_verify_step() -> None:
    """What training reports about held-out generations is what inference measures: the acceptance that
    ``verify_walk`` replays from the training forward's hits equals ``reference_speculative_generate``'s
    (``propose`` on its KV cache) step for step, and the in-vocabulary agreement (the training batches'
    count) exceeds the agreement over every label by the labels the draft vocabulary lacks."""
    target, loaded = _shipped_pair()
    draft, aux = loaded.model.eval(), loaded.info.aux_layers
    tok = AutoTokenizer.from_pretrained(demo_target_dir())
    texts = ["import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]
    prompt_len, new, k = 12, 40, 3
    prompts = torch.tensor([tok(t, add_special_tokens=False)["input_ids"][:prompt_len] for t in texts])
    seqs = greedy_generations(target, prompts, new + k - 1, batch=2, log=lambda _msg: None)
    held = HeldOut(seqs, aux_features(target, seqs, aux, batch=2), prompt_len, new)
    with torch.no_grad():
        hits = ttt_hits(draft, held.feats.float(), seqs, k)
    replayed = [verify_walk([h[b : b + 1] for h in hits], prompt_len, new) for b in range(2)]
    engine = [reference_speculative_generate(target, draft, aux, p.tolist(), new, k) for p in prompts]
    for b, (out, steps) in enumerate(engine):
        assert out == seqs[b, prompt_len : prompt_len + new].tolist()
        assert replayed[b] == steps, (b, replayed[b], steps)
    metrics = heldout_metrics(draft, held, k, chunk=1)
    all_steps = [s for _, steps in engine for s in steps]
    assert metrics["mean_acceptance_length"] == sum(all_steps) / len(all_steps) > 1.3
    assert metrics["verify_steps"] == len(all_steps)
    coverage = metrics["draft_vocab_coverage"]
    for every, in_vocab in zip(metrics["top1_agreement_per_step"], metrics["top1_agreement_in_vocab_per_step"],
                               strict=True):
        assert abs(every - in_vocab * coverage) < 1e-9


@pytest.mark.timeout(300)
def test_training_keeps_the_draft_whose_heldout_acceptance_it_reports() -> None:
    """``train_draft_on_generations`` with held-out generations returns the best logged draft, and the
    acceptance it reports for it is what the engine measures when that draft decodes the held-out prompts."""
    from dataclasses import replace

    target = _tiny_target()
    aux = (2, 3, 4)
    gen = torch.Generator().manual_seed(1)
    recipe = GenerationRecipe(sequences=16, prompt_len=6, new_tokens=14, gen_batch=8, steps=30, batch_size=4,
                              lr=3e-3, draft_vocab_size=40, draft_intermediate_size=48)
    seqs = greedy_generations(target, torch.randint(0, 60, (16, 6), generator=gen), 14, 8, lambda _msg: None)
    feats = aux_features(target, seqs, aux, 8)
    held_prompts = torch.randint(0, 60, (3, 8), generator=gen)
    held_seqs = greedy_generations(target, held_prompts, 12 + 2, 8, lambda _msg: None)
    held = HeldOut(held_seqs, aux_features(target, held_seqs, aux, 8), 8, 12)
    sizes = replace(PRESETS["quick"], hidden_size=32, num_heads=4, num_kv_heads=2, draft_intermediate_size=48)
    draft_ids = draft_vocabulary(seqs[:, 6:].reshape(-1), 60, 40)
    draft = make_draft(sizes, target.config, draft_ids, aux)
    lines: list[str] = []
    record = train_draft_on_generations(draft, target, feats, seqs, recipe, 3, 0, lines.append, held=held)
    kept = record["heldout"]
    logged = [float(line.split("acceptance (k=3) ")[1].split()[0]) for line in lines if "held-out generations" in line]
    assert len(logged) >= 2 and abs(kept["mean_acceptance_length"] - max(logged)) < 5e-4 and max(logged) > 1.0
    steps = [s for p in held_prompts for s in reference_speculative_generate(target, draft, aux, p.tolist(), 12, 3)[1]]
    assert sum(steps) / len(steps) == kept["mean_acceptance_length"]


def test_a_capped_run_measures_its_last_step_on_the_heldout_generations_and_keeps_it() -> None:
    """At ``--max-train-s`` the one draft loop stops after the first step, says so, measures the held-out
    generations once more for the last step run, and records a capped run whose kept draft is that step's."""
    from dataclasses import replace

    target = _tiny_target()
    aux = (2, 3, 4)
    gen = torch.Generator().manual_seed(2)
    recipe = GenerationRecipe(sequences=8, prompt_len=6, new_tokens=10, gen_batch=8, steps=5, batch_size=4,
                              lr=3e-3, draft_vocab_size=40, draft_intermediate_size=48)
    seqs = greedy_generations(target, torch.randint(0, 60, (8, 6), generator=gen), 10, 8, lambda _msg: None)
    held = HeldOut.generate(target, torch.randint(0, 60, (2, 8), generator=gen), 8, 3, aux, 8)
    assert held.seqs.shape == (2, 8 + 8 + 2) and held.prompt_len == 8
    sizes = replace(PRESETS["quick"], hidden_size=32, num_heads=4, num_kv_heads=2, draft_intermediate_size=48)
    draft = make_draft(sizes, target.config, draft_vocabulary(seqs[:, 6:].reshape(-1), 60, 40), aux)
    lines: list[str] = []
    record = train_draft_on_generations(draft, target, aux_features(target, seqs, aux, 8), seqs, recipe, 3, 0,
                                        lines.append, max_s=1e-9, held=held)
    assert (record["steps_run"], record["planned_steps"], record["time_capped"]) == (1, 5, True)
    assert any("stopping after 1 of 5 steps" in line for line in lines)
    measured = [line for line in lines if "held-out generations" in line]
    assert len(measured) == 2 and all(line.startswith("draft  step     0 ") for line in measured)
    assert record["heldout"]["kept_step"] == 0 and record["heldout_eval_s"] > 0
    assert record["top1_agreement_counts"].startswith("training batches")


@pytest.mark.skipif(not demo_available(), reason="the demo checkpoints are not installed with this package")
def test_generation_prompts_are_distinct_even_where_file_starts_repeat() -> None:
    """Every third draw starts at a file's first line; with few files those repeat, and a repeated prompt is a
    repeated greedy generation (memorized, not learned). The prompts returned are distinct, seeded, and
    each is the tokenization's prefix of the text at a line start of a file."""
    tok = AutoTokenizer.from_pretrained(demo_target_dir())
    texts = [f"def f{i}(x):\n" + "".join(f"{j}{i} = x\n" for j in range(25)) for i in range(6)]
    prompts = generation_prompts(tok, texts, 40, 6, seed=0)
    rows = [tuple(r) for r in prompts.tolist()]
    assert prompts.shape == (40, 6) and len(set(rows)) == 40
    assert sum(r == tuple(tok(t, add_special_tokens=False)["input_ids"][:6]) for t in texts for r in rows) == 6
    assert torch.equal(prompts, generation_prompts(tok, texts, 40, 6, seed=0))
    with pytest.raises(RuntimeError, match="distinct generation prompts"):
        generation_prompts(tok, texts[:1], 100, 6, seed=0)
