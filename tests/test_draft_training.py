"""Draft training matches draft inference, and the shipped demo pair really speculates.

The test-time-training forward of ``bench/train_demo.py`` computes every root's unrolled chain at once
with a hand-built attention pattern; if that pattern differed from what the draft's KV cache holds at
inference, the shipped draft would be trained for a different model than the one that runs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pipespec.demo import demo_available, demo_draft_dir, demo_target_dir
from pipespec.engine.draft_checkpoint import TargetInfo, inspect_draft_checkpoint, load_draft_checkpoint
from pipespec.engine.testing import make_random_draft, reference_speculative_generate

ROOT = Path(__file__).resolve().parents[1]


def _train_demo():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("pipespec_bench_train_demo", ROOT / "bench" / "train_demo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_forward_equals_inference_with_the_kv_cache(steps: int) -> None:
    """Root t, step i of the training forward == the draft after verifying 0..t, then i cached steps."""
    td = _train_demo()
    target = LlamaConfig(hidden_size=32, vocab_size=60, num_hidden_layers=6)
    draft = make_random_draft(target, num_aux=3, with_embedding=True, draft_vocab_size=40, seed=1).eval()
    gen = torch.Generator().manual_seed(3)
    length = 9
    ids = torch.randint(0, 60, (2, length), generator=gen)
    feats = torch.randn(2, length, 96, generator=gen)
    with torch.no_grad():
        trained = td.ttt_logits(draft, feats, ids, steps)
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


def test_lr_schedule_warms_up_then_decays_to_a_tenth() -> None:
    td = _train_demo()
    values = [td.lr_at(s, 100, 1.0) for s in range(100)]
    assert values[0] < values[4] <= 1.0 and abs(max(values) - 1.0) < 1e-9
    assert abs(values[-1] - 0.1) < 0.01 and all(a >= b for a, b in zip(values[5:], values[6:]))


@pytest.mark.skipif(not demo_available(), reason="the demo checkpoints are not installed with this package")
def test_shipped_demo_pair_is_small_loadable_and_documented() -> None:
    sizes = sum(f.stat().st_size for d in (demo_target_dir(), demo_draft_dir()) for f in d.rglob("*") if f.is_file())
    assert sizes <= 10_000_000
    tok = AutoTokenizer.from_pretrained(demo_target_dir())
    text = "def main():\n    return 0\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    target = AutoModelForCausalLM.from_pretrained(demo_target_dir(), dtype=torch.float32)
    assert sum(p.numel() for p in target.parameters()) <= 4_000_000
    info = inspect_draft_checkpoint(demo_draft_dir(), TargetInfo.from_config(target.config))
    assert info.format == "B" and info.aux_layers == (2, 4, 5) and info.aux_convention == "input"
    assert not info.has_embedding and info.config.draft_vocab_size < target.config.vocab_size


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
