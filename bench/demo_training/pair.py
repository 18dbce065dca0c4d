"""The main flow: from the stdlib corpus to the shipped pair, each step timed in ``metrics.json``:
corpus and tokenizer, target training, draft training on corpus windows, export, evaluation.

Imports pipespec (aux ids, draft) and transformers through the modules it calls; nothing of vllm.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.demo_training.draft_model import draft_parameters, draft_vocabulary, make_draft
from bench.demo_training.draft_training import train_draft
from bench.demo_training.evaluate import evaluate_checkpoints
from bench.demo_training.export import (
    checkpoint_sizes,
    configure_device,
    export_draft,
    export_target,
    load_target,
)
from bench.demo_training.presets import Preset
from bench.demo_training.record import finish, run_record
from bench.demo_training.retrain import recipe_from_args, retrain_draft
from bench.demo_training.target_training import make_target, train_target
from bench.demo_training.tokenizer import EOS, encode_stream, train_tokenizer
from pipespec.bench.corpus import eval_prompts, load_corpus
from pipespec.contract.layout import eagle3_default_aux_ids

Log = Callable[[str], None]


def _corpus_and_tokenizer(p: Preset, seed: int, log: Log) -> tuple[Any, torch.Tensor, list[list[int]], dict[str, Any]]:
    """(tokenizer, training token stream, held-out prompts, corpus description)."""
    train_texts, held_texts, corpus = load_corpus(p.max_corpus_chars)
    tokenizer = train_tokenizer(train_texts, p.vocab_size)
    stream = encode_stream(tokenizer, train_texts)
    prompts = eval_prompts(tokenizer, held_texts, p.eval_prompts, p.eval_prompt_len, seed)
    corpus.update(train_tokens=int(stream.numel()), vocab_size=len(tokenizer))
    log(f"corpus: {corpus['train_files']} files, {corpus['train_chars']:,} chars -> {stream.numel():,} tokens "
        f"(vocab {len(tokenizer)}); {len(prompts)} held-out prompts")
    return tokenizer, stream, prompts, corpus


def train_pair(args: argparse.Namespace, argv: Sequence[str] | None, preset_name: str, p: Preset, log: Log,
               start: float) -> int:
    """Train target and draft from nothing into ``args.out`` (``target/``, ``draft/``, ``metrics.json``)."""
    device, out = args.device, Path(args.out)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    tokenizer, stream, prompts, corpus = _corpus_and_tokenizer(p, args.seed, log)
    phases["corpus_and_tokenizer_s"] = time.perf_counter() - t

    target = make_target(p, len(tokenizer), tokenizer.convert_tokens_to_ids(EOS))
    target_params = sum(q.numel() for q in target.parameters())
    log(f"target: Llama, {target_params:,} parameters, N={p.num_layers}, H={p.hidden_size}")
    target_stats = train_target(target, stream, p, device, args.seed, log, args.max_train_s)
    phases["target_training_s"] = target_stats["seconds"]
    target_dir, draft_dir = out / "target", out / "draft"
    export_target(target, tokenizer, target_dir)
    if p.draft_recipe is not None:  # EAGLE3's recipe proper: the draft learns from the target's own generations
        del target
        recipe = recipe_from_args(args, p.draft_recipe, skip=("batch_size",))  # --batch-size: the target's
        trained = {"target": target_stats, "phases_s": phases}
        return retrain_draft(argparse.Namespace(**{**vars(args), "retrain_draft": out}), argv, preset_name, p, log,
                             recipe, trained)

    # Everything from here on uses the shipped (fp16-rounded) weights, reloaded from disk.
    configure_device(device)
    target = load_target(target_dir, device)
    aux_ids = eagle3_default_aux_ids(p.num_layers)
    draft_ids = draft_vocabulary(stream, len(tokenizer), p.draft_vocab_size)
    draft = make_draft(p, target.config, draft_ids, aux_ids)
    draft_params = draft_parameters(draft)
    log(f"draft: EAGLE3, {draft_params:,} parameters (+ the target's embedding, shared), aux ids {list(aux_ids)}, "
        f"draft vocab {draft_ids.numel()}, {p.ttt_steps} TTT steps")
    draft_stats = train_draft(draft, target, aux_ids, stream, p, device, args.seed, log, args.max_train_s)
    phases["draft_training_s"] = draft_stats["seconds"]
    export_draft(draft, draft_dir, aux_ids)

    evaluation, sample = evaluate_checkpoints(target_dir, draft_dir, prompts, p.eval_new_tokens, device, log)
    phases["evaluation_s"] = evaluation["seconds"]
    metrics = {
        **run_record(argv, device, preset_name, p, args.seed),
        "corpus": corpus,
        "target": {"parameters": target_params, **target_stats},
        "draft": {"parameters": draft_params, "aux_layers": list(aux_ids), "format": "B", **draft_stats},
        "evaluation": evaluation,
        "sample": sample,
        "sizes": checkpoint_sizes(target_dir, draft_dir),
        "phases_s": phases,
        "total_s": time.perf_counter() - start,
    }
    return finish(metrics, out / "metrics.json", args.json, log)
