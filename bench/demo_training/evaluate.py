"""Evaluation: greedy speculative decoding of the written checkpoints in one process
(``reference_speculative_generate``) on held-out prompts: mean acceptance length per k (tokens per verify
step, accepted drafts + 1) and whether every output equals the target's plain greedy output; and
``--eval-only``, which re-measures existing checkpoints.

Imports pipespec's engine and transformers (lazily); nothing of vllm.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.demo_training.export import checkpoint_sizes, load_target
from bench.demo_training.presets import Preset
from bench.demo_training.record import finish, run_record
from pipespec.bench.corpus import eval_prompts, load_corpus
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.info import TargetInfo
from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint
from pipespec.engine.reference import reference_speculative_generate

Log = Callable[[str], None]


def evaluate(target: Any, draft: Eagle3Draft, aux_ids: Sequence[int], prompts: Sequence[Sequence[int]],
             new_tokens: int, ks: Sequence[int], log: Log) -> dict[str, Any]:
    """Mean acceptance length per k, and whether every speculative output equals plain greedy."""
    t0 = time.perf_counter()
    plain = [reference_speculative_generate(target, draft, aux_ids, pr, new_tokens, 0)[0] for pr in prompts]
    result: dict[str, Any] = {"prompts": len(prompts), "new_tokens": new_tokens, "k": {}}
    for k in ks:
        steps_all: list[int] = []
        lossless = True
        for pr, want in zip(prompts, plain):
            got, steps = reference_speculative_generate(target, draft, aux_ids, pr, new_tokens, k)
            lossless &= got == want
            steps_all.extend(steps)
        mean = sum(steps_all) / len(steps_all)
        result["k"][str(k)] = {"mean_acceptance_length": mean, "verify_steps": len(steps_all), "lossless": lossless}
        log(f"k={k}: mean acceptance length {mean:.3f} over {len(steps_all)} verify steps; lossless={lossless}")
    result["seconds"] = time.perf_counter() - t0
    result["sample_output_ids"] = plain[0] if plain else []
    return result


def evaluate_checkpoints(
    target_dir: Path, draft_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int, device: str, log: Log,
    ks: Sequence[int] = (3, 5),
) -> tuple[dict[str, Any], dict[str, str]]:
    """Load the written checkpoints (float32) and measure them; also a decoded sample continuation."""
    from transformers import AutoTokenizer

    target = load_target(target_dir, device)
    loaded = load_draft_checkpoint(draft_dir, TargetInfo.from_config(target.config), dtype=torch.float32,
                                   device=device, target_embed=target.get_input_embeddings())
    log(f"evaluating {draft_dir} ({loaded.info.format_name}, aux ids {list(loaded.info.aux_layers)}, convention "
        f"{loaded.info.aux_convention}) against {target_dir} on {len(prompts)} prompts")
    evaluation = evaluate(target, loaded.model, loaded.info.aux_layers, prompts, new_tokens, ks, log)
    tok = AutoTokenizer.from_pretrained(target_dir)
    sample = {"prompt": tok.decode(prompts[0]) if prompts else "",
              "greedy_continuation": tok.decode(evaluation.pop("sample_output_ids"))}
    return evaluation, sample


def eval_only(args: argparse.Namespace, argv: Sequence[str] | None, preset_name: str, p: Preset, log: Log) -> int:
    """Re-measure existing checkpoints (``DIR/target``, ``DIR/draft``) on this machine's held-out prompts."""
    from transformers import AutoTokenizer

    root: Path = args.eval_only
    target_dir, draft_dir = root / "target", root / "draft"
    _, held_texts, corpus = load_corpus(p.max_corpus_chars)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = eval_prompts(tokenizer, held_texts, p.eval_prompts, p.eval_prompt_len, args.seed)
    evaluation, sample = evaluate_checkpoints(target_dir, draft_dir, prompts, p.eval_new_tokens, args.device, log)
    metrics = {
        **run_record(argv, args.device, preset_name, p, args.seed),
        "evaluated": str(root),
        "corpus": {k: corpus[k] for k in ("root", "heldout_files")},
        "evaluation": evaluation,
        "sample": sample,
        "sizes": checkpoint_sizes(target_dir, draft_dir),
    }
    return finish(metrics, args.out / "eval.json", args.json, log)
