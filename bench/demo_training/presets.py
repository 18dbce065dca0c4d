"""Every size and step count of a training run (``--preset``) and ``--retrain-draft``'s recipe.

Pure data: imports nothing of torch, transformers or pipespec.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationRecipe:
    """How ``--retrain-draft`` builds its data and trains: EAGLE3's recipe on the target's own outputs."""

    sequences: int = 1536
    prompt_len: int = 24
    new_tokens: int = 104
    gen_batch: int = 64
    steps: int = 1500
    batch_size: int = 16
    lr: float = 2e-3
    # The full vocabulary of the demo target: 512 tokens covered only 93.1% of its generations, and held-out
    # acceptance rose from 2.31 to 2.47 with it (docs/benchmarks.md); the MLP pays for the wider head, so
    # the shipped weights (fp16) stay under 8 MB.
    draft_vocab_size: int = 1024
    draft_intermediate_size: int = 256
    aux_layers: tuple[int, ...] | None = None  # the target's aux ids the draft reads (None: EAGLE3's default)
    heldout_sequences: int = 64  # generations after held-out-file prompts, never trained on (HeldOut)


@dataclass(frozen=True)
class Preset:
    """Every size and step count of one training run."""

    max_corpus_chars: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    target_steps: int
    target_lr: float
    draft_vocab_size: int
    draft_intermediate_size: int
    draft_steps: int
    draft_lr: float
    ttt_steps: int
    eval_prompts: int
    eval_prompt_len: int
    eval_new_tokens: int
    # How the draft is trained: None, on corpus windows (``train_draft``); a recipe, on the target's own greedy
    # generations, as ``--retrain-draft`` does (EAGLE3's recipe proper), right after the target in one command.
    draft_recipe: GenerationRecipe | None = None


PRESETS = {
    "quick": Preset(
        max_corpus_chars=400_000, vocab_size=320, hidden_size=48, num_layers=8, num_heads=4, num_kv_heads=2,
        intermediate_size=96, seq_len=64, batch_size=8, target_steps=120, target_lr=4e-3,
        draft_vocab_size=192, draft_intermediate_size=96, draft_steps=60, draft_lr=3e-3, ttt_steps=2,
        eval_prompts=3, eval_prompt_len=32, eval_new_tokens=24,
    ),
    "full": Preset(
        max_corpus_chars=40_000_000, vocab_size=1024, hidden_size=192, num_layers=8, num_heads=6, num_kv_heads=2,
        intermediate_size=512, seq_len=256, batch_size=64, target_steps=6000, target_lr=2e-3,
        draft_vocab_size=512, draft_intermediate_size=512, draft_steps=5000, draft_lr=1.5e-3, ttt_steps=3,
        eval_prompts=24, eval_prompt_len=64, eval_new_tokens=96,
    ),
    # The shipped demo pair (the default): the full preset's shapes over a 320-token vocabulary, the target
    # trained for 800 steps of 128, then the draft on 131072 of its greedy generations (EAGLE3's recipe).
    # Against the 1024-token full preset (6000 steps of 64, then the same recipe), held-out acceptance at
    # k = 3 rose from 2.47 to 3.36 (one H200, docs/benchmarks.md "Sixth pass").
    "demo": Preset(
        max_corpus_chars=40_000_000, vocab_size=320, hidden_size=192, num_layers=8, num_heads=6, num_kv_heads=2,
        intermediate_size=512, seq_len=256, batch_size=128, target_steps=800, target_lr=2e-3,
        draft_vocab_size=320, draft_intermediate_size=256, draft_steps=6000, draft_lr=2e-3, ttt_steps=3,
        eval_prompts=24, eval_prompt_len=64, eval_new_tokens=96,
        draft_recipe=GenerationRecipe(sequences=131072, prompt_len=12, new_tokens=148, gen_batch=4096, steps=6000,
                                      batch_size=256, lr=2e-3, draft_vocab_size=320, draft_intermediate_size=256,
                                      heldout_sequences=256),
    ),
    "medium": Preset(
        max_corpus_chars=40_000_000, vocab_size=8192, hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=5,
        intermediate_size=1728, seq_len=512, batch_size=64, target_steps=2200, target_lr=1.2e-3,
        draft_vocab_size=4096, draft_intermediate_size=1728, draft_steps=1200, draft_lr=1e-3, ttt_steps=3,
        eval_prompts=10, eval_prompt_len=64, eval_new_tokens=96,
    ),
}
