"""``--retrain-draft DIR``: EAGLE3's recipe proper. Keep DIR/target (copied to OUT), let it write greedy
continuations of distinct training-file prompts, compute its aux states over them once, and train a new
draft (from scratch, or from ``--init-draft``'s trained draft, its MLP pruned) with unrolled test-time
training on them; held-out-file generations, never trained on, pick the draft kept. Evaluated on the
demo's prompts and on held-out prompts at k = 3.

Imports pipespec (aux ids, the demo's prompts) and transformers; nothing of vllm.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.demo_training.draft_model import draft_parameters, draft_vocabulary, make_draft, pruned_draft
from bench.demo_training.draft_training import train_draft_on_generations
from bench.demo_training.evaluate import evaluate_checkpoints
from bench.demo_training.export import checkpoint_sizes, configure_device, export_draft, load_target
from bench.demo_training.generations import aux_features, greedy_generations
from bench.demo_training.heldout import HeldOut
from bench.demo_training.presets import GenerationRecipe, Preset
from bench.demo_training.record import finish, run_record
from pipespec.bench.corpus import eval_prompts, generation_prompts, load_corpus
from pipespec.contract.layout import eagle3_default_aux_ids
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.errors import UsageError

Log = Callable[[str], None]
_RECIPE_FLAGS = (("sequences", "gen_sequences"), ("steps", "draft_steps"), ("batch_size", "batch_size"),
                 ("lr", "draft_lr"), ("gen_batch", "gen_batch"), ("heldout_sequences", "heldout_sequences"),
                 ("prompt_len", "gen_prompt_len"), ("new_tokens", "gen_new_tokens"),
                 ("draft_vocab_size", "draft_vocab_size"), ("draft_intermediate_size", "draft_intermediate_size"),
                 ("aux_layers", "aux_layers"))


def recipe_from_args(args: argparse.Namespace, base: GenerationRecipe | None = None,
                     skip: Sequence[str] = ()) -> GenerationRecipe:
    """``base`` (default: the recipe's defaults), overridden by the flags given (but the ``skip`` ones)."""
    given = {field: getattr(args, flag) for field, flag in _RECIPE_FLAGS
             if flag not in skip and getattr(args, flag) is not None}
    return replace(base or GenerationRecipe(), **given)


@dataclass(frozen=True)
class TrainingData:
    """The target's generations (``seqs``), their aux states, the held-out generations and evaluation prompts."""

    seqs: torch.Tensor
    feats: torch.Tensor
    heldout: HeldOut
    eval_prompts: list[list[int]]
    aux_ids: tuple[int, ...]


def _training_data(target: Any, tokenizer: Any, recipe: GenerationRecipe, p: Preset, seed: int, device: str,
                   phases: dict[str, float], started: float, log: Log) -> tuple[TrainingData, dict[str, Any]]:
    """The data and the corpus description; ``generations_s`` counts from ``started`` (loading the target)."""
    train_texts, held_texts, corpus = load_corpus(p.max_corpus_chars)
    prompts = generation_prompts(tokenizer, train_texts, recipe.sequences, recipe.prompt_len, seed).to(device)
    held = eval_prompts(tokenizer, held_texts, p.eval_prompts, p.eval_prompt_len, seed)
    seqs = greedy_generations(target, prompts, recipe.new_tokens, recipe.gen_batch, log)
    phases["generations_s"] = time.perf_counter() - started
    t = time.perf_counter()
    aux_ids = recipe.aux_layers or tuple(eagle3_default_aux_ids(int(target.config.num_hidden_layers)))
    feats = aux_features(target, seqs, aux_ids, recipe.gen_batch)
    phases["aux_states_s"] = time.perf_counter() - t
    log(f"data: {seqs.shape[0]} greedy generations of {recipe.new_tokens} tokens after {recipe.prompt_len}-token "
        f"prompts; aux states {tuple(feats.shape)} fp16 ({feats.numel() * 2 / 1e6:.0f} MB)")
    t = time.perf_counter()
    held_prompts = generation_prompts(tokenizer, held_texts, recipe.heldout_sequences, p.eval_prompt_len,
                                      seed + 1).to(device)
    heldout = HeldOut.generate(target, held_prompts, p.eval_new_tokens, p.ttt_steps, aux_ids, recipe.gen_batch)
    phases["heldout_data_s"] = time.perf_counter() - t
    log(f"held-out: {recipe.heldout_sequences} greedy generations after {p.eval_prompt_len}-token prompts from "
        f"held-out files (never trained on; acceptance replayed at k={p.ttt_steps} over {p.eval_new_tokens} tokens)")
    return TrainingData(seqs, feats, heldout, held, aux_ids), corpus


def _starting_draft(init_from: Path | None, target: Any, p: Preset, recipe: GenerationRecipe,
                    generated: torch.Tensor, aux_ids: Sequence[int], log: Log,
                    ) -> tuple[Eagle3Draft, torch.Tensor, dict[str, Any]]:
    """(draft, its vocabulary as target ids, where it started): ``init_from`` pruned, or fresh on the
    generations' most frequent tokens."""
    sizes = replace(p, hidden_size=int(target.config.hidden_size), num_heads=int(target.config.num_attention_heads),
                    num_kv_heads=int(target.config.num_key_value_heads),
                    draft_intermediate_size=recipe.draft_intermediate_size)
    if init_from is None:
        vocab = int(target.config.vocab_size)
        if recipe.draft_vocab_size > vocab:  # e.g. a --quick target (320 tokens): the draft keeps them all
            log(f"draft: vocabulary {vocab} (the target's whole vocabulary; the recipe's is {recipe.draft_vocab_size})")
        draft_ids = draft_vocabulary(generated.cpu(), vocab, min(recipe.draft_vocab_size, vocab))
        return make_draft(sizes, target.config, draft_ids, aux_ids), draft_ids, {"from": "scratch"}
    draft, init = pruned_draft(init_from, target, sizes, aux_ids)
    log(f"draft: starting from {init_from} ({init['intermediate_from']} -> {init['intermediate_to']} MLP units, "
        "the least used pruned; its vocabulary kept)")
    return draft, draft.to_target_ids(torch.arange(draft.d2t.numel())), init


def _evaluate(target_dir: Path, draft_dir: Path, data: TrainingData, tokenizer: Any, p: Preset, device: str,
              log: Log) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(on the demo's prompts, on held-out prompts, a sample), both at k = 3."""
    from pipespec.cli.demo import SHIPPED_PROMPTS

    demo_prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in SHIPPED_PROMPTS]
    demo_eval, _ = evaluate_checkpoints(target_dir, draft_dir, demo_prompts, 64, device, log, ks=(3,))
    evaluation, sample = evaluate_checkpoints(target_dir, draft_dir, data.eval_prompts, p.eval_new_tokens, device,
                                              log, ks=(3,))
    return demo_eval, evaluation, sample


def check_aux_layers(aux_layers: tuple[int, ...] | None, target_dir: Path) -> None:
    """``--aux-layers`` against the target's layer count, before anything is loaded or written."""
    if aux_layers is None:
        return
    config = target_dir / "config.json"
    if not config.is_file():
        raise UsageError(f"--retrain-draft: {config} not found (DIR must hold target/ with a config.json)")
    num_layers = int(json.loads(config.read_text())["num_hidden_layers"])
    if aux_layers[-1] > num_layers:
        raise UsageError(f"--aux-layers {','.join(map(str, aux_layers))}: id {aux_layers[-1]} is past the target's "
                         f"{num_layers} layers ({config}); use ids 0..{num_layers} (id {num_layers} is the last "
                         "layer's output, before the final norm)")


def retrain_draft(args: argparse.Namespace, argv: Sequence[str] | None, preset_name: str, p: Preset, log: Log,
                  recipe: GenerationRecipe | None = None, trained: dict[str, Any] | None = None) -> int:
    """``--retrain-draft DIR``: keep DIR/target, train a new draft on its greedy generations (from scratch, or
    from ``--init-draft``), on ``--device``. ``recipe`` (default: from the flags) and ``trained`` (the target's
    training record and phases, when the same command just trained it) come from the pair trainer."""
    from transformers import AutoTokenizer

    recipe = recipe or recipe_from_args(args, p.draft_recipe)
    source: Path = args.retrain_draft / "target"
    out: Path = args.out
    target_dir, draft_dir = out / "target", out / "draft"
    if target_dir.resolve() != source.resolve():
        shutil.copytree(source, target_dir, dirs_exist_ok=True)
    phases: dict[str, float] = dict(trained["phases_s"]) if trained else {}
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    device = args.device
    configure_device(device)  # generation grows the key length every step
    target = load_target(target_dir, device)
    data, corpus = _training_data(target, tokenizer, recipe, p, args.seed, device, phases, started, log)
    generated = data.seqs[:, recipe.prompt_len :].reshape(-1)
    draft, draft_ids, init = _starting_draft(args.init_draft, target, p, recipe, generated, data.aux_ids, log)
    draft.to(device)
    coverage = float(torch.isin(generated.cpu(), draft_ids.cpu()).float().mean())
    draft_params = draft_parameters(draft)
    log(f"draft: EAGLE3, {draft_params:,} parameters (+ the target's embedding, shared), aux ids "
        f"{list(data.aux_ids)}, draft vocab {draft_ids.numel()} (covers {coverage:.1%} of generated tokens), "
        f"{p.ttt_steps} TTT steps")
    draft_stats = train_draft_on_generations(draft, target, data.feats, data.seqs, recipe, p.ttt_steps, args.seed,
                                             log, args.max_train_s, data.heldout)
    phases["draft_training_s"] = draft_stats["seconds"]
    export_draft(draft, draft_dir, data.aux_ids)
    demo_eval, evaluation, sample = _evaluate(target_dir, draft_dir, data, tokenizer, p, device, log)
    phases["evaluation_s"] = demo_eval["seconds"] + evaluation["seconds"]
    metrics = {
        **run_record(argv, device, preset_name, p, args.seed),
        "recipe": {"kind": "EAGLE3 training-time test on the target's own greedy generations", **asdict(recipe),
                   "ttt_steps": p.ttt_steps, "target": str(source)},
        "corpus": corpus,
        "target": {"parameters": sum(q.numel() for q in target.parameters()),
                   **(trained["target"] if trained else {"kept_from": str(source)})},
        "draft": {"parameters": draft_params, "aux_layers": list(data.aux_ids), "format": "B", "init": init,
                  "draft_vocab_coverage_of_generations": coverage, **draft_stats},
        "demo_prompts_evaluation": demo_eval,
        "evaluation": evaluation,
        "sample": sample,
        "sizes": checkpoint_sizes(target_dir, draft_dir),
        "phases_s": phases,
        "total_s": sum(phases.values()),
    }
    return finish(metrics, out / "metrics.json", args.json, log)
