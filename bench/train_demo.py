"""Train the demo pair that `make demo` ships: a small Llama target and its EAGLE3 draft.

Reproduces ``sdk/pipespec/demo/`` from nothing but the Python standard library's own source (every
machine with Python has it), seeded::

    python bench/train_demo.py --out /tmp/demo --device cuda      # the shipped pair, one command: the target,
                                                                  # then its draft on 131072 of the target's
                                                                  # greedy generations (~7 min on one H200)
    python bench/train_demo.py --out /tmp/demo --quick            # ~1-2 min on 2 CPU cores: smoke size
    python bench/train_demo.py --out /tmp/pair --device cuda --preset medium --max-train-s 200
                                                                  # a ~51M target for GPU speedup runs (~5 min on one H200)
    python bench/train_demo.py --retrain-draft sdk/pipespec/demo --out /tmp/d4 --device cuda --threads 8
                                                                  # keep the demo target, train a new draft
                                                                  # by the preset's recipe (flags override it)

The shipped pair (``--preset demo``, the default; 2026-12-02, one H200, 416 s) has a 3.2M target over a
320-token vocabulary, trained for 800 steps of 128, and a 0.48M draft; at k = 3 it accepts 3.43 tokens per
step replayed on 256 held-out generations, 3.37 on 24 held-out prompts and 3.92 on the demo's prompts.
The pair before it (``--preset full``: 1024 tokens, 6000 steps of 64, its draft by the same recipe at 8000 steps) reached 2.47,
2.47 and 2.24, and no draft change moved it (aux ids, MLP width, draft vocabulary). A smaller vocabulary
makes each token more predictable, and a target trained for fewer passes over the corpus (~4 against ~25)
writes more regular text that a one-layer draft follows: 2400 steps of 128 at 320 tokens gave 3.06 /
2.99 / 2.70. The price is the text: the shipped target repeats itself more ("a list of list of ...").
docs/benchmarks.md, "Sixth pass", has the runs.

``--retrain-draft DIR`` is EAGLE3's recipe proper: the target (DIR/target, kept and copied to OUT) writes
greedy continuations of prompts from the training files, its aux states over them are computed once,
and the draft is trained with the unrolled test-time-training steps on them, each step's label being
the token the target wrote (``--init-draft DIR`` starts from a trained draft instead of from scratch,
its MLP cut to the recipe's size). On the 2-core CPU machine (2026-12-01, shared with four other
agents) 2048 generations and ~700 steps from the shipped draft raised the training agreement to 0.79
per step but lowered held-out acceptance (k = 3) from 2.21 to 1.94 — too few generations for the steps
(overfitting); it needs the GPU's data rate.

What the training batches report is in-sample: on one H200 (16384 generations, 6000 steps of 64, ~23
passes over the data, a third of the prompts copies of ~560 file starts) they said 0.85 agreement per
TTT step while the engine measured 2.105 tokens per step on held-out prompts. The engine is right: on
fresh generations (CPU, prompts of Python 3.11's train / held-out split, another seed) the same draft agrees
0.74 (train-file prompts) and 0.60 (held-out-file prompts) with
in-vocabulary labels, 0.69/0.55 counting every label, and ``verify_walk`` over those hits gives 2.33 and
1.92, equal to ``reference_speculative_generate`` on the same prompts step for step. So ``--retrain-draft``
now draws distinct prompts, generates ``--heldout-sequences`` continuations of held-out-file prompts that
are never trained on, logs their replayed acceptance (the figure inference measures) beside the training
batches' agreement, and keeps the draft of the logged step where it was best.

The previous draft (2026-12-01, one H200, ``--retrain-draft`` on the 1024-token target with 8000 steps)
replayed 2.47 tokens per step on 256 held-out generations, up from 2.31 with a 512-token draft vocabulary
(which covered 93.1% of the target's generated tokens) and an MLP of 416 at 5000 steps; the training
agreement per TTT step stopped near 0.72-0.73 in both. With the 320-token target it reaches 0.90.

The code lives in ``bench/demo_training/``, a module per step below (its ``__init__`` lists them); this
file is the command.

Steps, each timed in ``metrics.json``:

1. corpus: ``Lib/**/*.py`` of the running interpreter's stdlib (site-packages excluded), split into
   train and held-out files by a hash of the relative path, so the split does not depend on file order;
2. tokenizer: byte-level BPE trained with ``tokenizers``, saved as a ``PreTrainedTokenizerFast``
   (``AutoTokenizer.from_pretrained(target_dir)`` loads it);
3. target: ``LlamaForCausalLM`` (tied embedding; ≤ 4M parameters in the quick, demo and full presets, 51M in
   medium), next-token cross-entropy;
4. draft: EAGLE3 (``pipespec.engine.draft``) on the frozen target's aux states at the default ids
   ``(2, N//2, N-3)``; in the demo preset (and ``--retrain-draft``) on the target's own greedy generations
   (``demo_training/retrain.py``), else (quick, full, medium) on corpus windows, trained to match the
   target's next-next-token distribution over a pruned draft
   vocabulary (the most frequent tokens, mapped back by ``d2t``), with ``--ttt-steps`` unrolled steps of
   test-time training: step i feeds the draft its own step i-1 output and attends to the verified
   positions plus its own earlier steps of the same chain — exactly what the draft's KV cache holds at
   inference;
5. export: target as an HF checkpoint (fp16) + tokenizer, draft in Format B (fp16, no ``embed_tokens``:
   it shares the target's), both reloaded from disk for the evaluation;
6. evaluation: greedy speculative decoding in one process (``reference_speculative_generate``) on
   held-out prompts at k = 3 and 5: mean acceptance length (tokens per verify step, accepted drafts + 1)
   and a check that every output equals the target's plain greedy output.

The corpus is the stdlib of the Python that runs the script, so figures differ slightly between Python
versions; ``metrics.json`` records the version, torch version, device, preset, and the command.

Presets (``--preset``; ``--quick`` is ``--preset quick``): ``quick`` is a CPU smoke test, ``demo`` the
shipped pair (the default), ``full`` the 1024-token target shipped before it (3.3M parameters), ``medium`` a
target big enough that a GPU decode step is more than
kernel launches, for the speedup benchmark (``pipespec bench p3 --pair DIR``), meant for one H200 in bf16
autocast. Medium's sizes and the estimate behind its step counts:

- target: vocab 8192 (BPE), H = 640, 10 layers, 10 heads / 5 KV heads (head dim 64), I = 1728, tied
  embedding: 50.7M parameters, all of them in matmuls (the tied embedding is the lm_head). Training
  costs 6 × 50.7M ≈ 304 MFLOP per token plus ≈ 23 MFLOP of causal attention at 512 tokens (10 layers,
  forward + backward) ≈ 327 MFLOP per token; a step is 64 × 512 tokens ≈ 10.7 TFLOP. At an effective
  100–200 TFLOP/s (eager bf16 autocast, small matrices) that is 54–107 ms per step, ~71 ms at 150:
  2200 steps ≈ 2.6 min (2–4 min over that range).
- draft: H = 640, I = 1728, draft vocab 4096: 9.2M parameters in matmuls. A step runs the frozen target
  forward (≈ 108 MFLOP per token) and 3 unrolled TTT steps of the draft (≈ 55 MFLOP per token each for
  forward + backward, plus a dense 511 × 511 attention), ≈ 290 MFLOP per token or 9.5 TFLOP per step,
  with more memory-bound work (fp32 loss over 8192-wide target logits per TTT step): ~90 ms per step
  assumed, 1200 steps ≈ 1.8 min.
- corpus: the whole stdlib (≈ 31M characters of Python 3.11's, ≈ 8.5M tokens at vocab 8192); BPE
  training took 4.0 s and encoding 7.3 s on 2 CPU cores (corpus read 0.6 s), so that phase is well
  under a minute anywhere. The target sees ≈ 72M tokens (≈ 8.5 passes over the corpus).
- evaluation: 10 held-out prompts of 64 tokens, 96 new tokens, k = 3 and 5 (the one-process reference
  decoder recomputes the target over the whole sequence per step: ~0.5k forwards per prompt, seconds
  on a GPU).

``--max-train-s S`` stops target training and (separately) draft training once S seconds of wall time
have passed — a safety cap for a fixed device budget; ``metrics.json`` then records the steps actually
run and ``time_capped: true``. The learning-rate schedule stays the one of the planned steps, so a
capped run simply ends before its cosine decay is complete.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

if not __package__:  # run as a script (or loaded from its path): make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.demo_training.evaluate import eval_only  # noqa: E402
from bench.demo_training.pair import train_pair  # noqa: E402
from bench.demo_training.presets import PRESETS, Preset  # noqa: E402
from bench.demo_training.retrain import check_aux_layers, retrain_draft  # noqa: E402
from pipespec.cli.args import positive_int  # noqa: E402
from pipespec.errors import UsageError  # noqa: E402

__all__ = ["main", "parse_args", "preset_for"]


def _positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number (``unit`` names it in the error)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({unit})") from None
        if not value > 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number ({unit})")
        return value

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (target/, draft/, metrics.json)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--preset", choices=tuple(PRESETS),
                      help="sizes and steps: quick (CPU smoke test), demo (the shipped pair: target, then the draft "
                           "on its greedy generations; default), full (the earlier 1024-token demo target), medium "
                           "(a 51M target for GPU speedup runs, one H200)")
    size.add_argument("--quick", action="store_true", help="the same as --preset quick (1-2 min on 2 CPU cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch (default 2)")
    parser.add_argument("--target-steps", type=int, help="override the preset's target training steps")
    parser.add_argument("--draft-steps", type=int, help="override the preset's draft training steps")
    parser.add_argument("--ttt-steps", type=int, help="override the preset's unrolled test-time-training steps")
    parser.add_argument("--eval-prompts", type=int, help="override the preset's number of held-out prompts")
    parser.add_argument("--max-corpus-chars", type=int, help="override the preset's corpus size cap")
    parser.add_argument("--batch-size", type=positive_int, help="override the preset's sequences per training step")
    parser.add_argument("--vocab-size", type=_vocab_size, metavar="V",
                        help="override the preset's BPE vocabulary (>= 257: the 256 bytes and the end-of-text token); "
                             "pair training only")
    parser.add_argument("--max-train-s", type=_positive("seconds"), metavar="SECONDS",
                        help="stop target training, and separately draft training, after SECONDS of wall time "
                             "(the LR schedule stays the planned steps'; metrics.json records the steps run)")
    parser.add_argument("--eval-only", type=Path, metavar="DIR",
                        help="train nothing: measure DIR/target + DIR/draft (e.g. sdk/pipespec/demo) into OUT/eval.json")
    parser.add_argument("--retrain-draft", type=Path, metavar="DIR",
                        help="keep DIR/target (e.g. sdk/pipespec/demo) and train a new draft from scratch on its own "
                             "greedy generations (EAGLE3's training-time test): OUT/target, OUT/draft")
    parser.add_argument("--init-draft", type=Path, metavar="DIR",
                        help="--retrain-draft: start from this trained draft (its MLP pruned to the recipe's size, "
                             "its vocabulary kept) instead of from scratch")
    parser.add_argument("--draft-lr", type=_positive("a learning rate"), metavar="LR",
                        help="--retrain-draft: peak learning rate (default 2e-3)")
    parser.add_argument("--gen-batch", type=positive_int,
                        help="--retrain-draft: sequences generated (and their aux states computed) at once (default 64)")
    parser.add_argument("--gen-sequences", type=positive_int,
                        help="--retrain-draft: greedy generations to train on (default 1536)")
    parser.add_argument("--gen-prompt-len", type=positive_int,
                        help="--retrain-draft: tokens of training-file text each generation continues (default 24)")
    parser.add_argument("--gen-new-tokens", type=positive_int,
                        help="--retrain-draft: tokens the target generates per sequence (default 104)")
    parser.add_argument("--heldout-sequences", type=positive_int,
                        help="--retrain-draft: generations after held-out-file prompts, never trained on, on which "
                             "acceptance is replayed during training and the best draft kept (default 64)")
    parser.add_argument("--draft-vocab-size", type=positive_int,
                        help="--retrain-draft: the draft's vocabulary, the target's most generated tokens (default "
                             "1024, capped at the target's vocabulary)")
    parser.add_argument("--draft-intermediate-size", type=positive_int,
                        help="--retrain-draft: the draft layer's MLP width (default 256)")
    parser.add_argument("--aux-layers", type=_aux_ids, metavar="IDS",
                        help="--retrain-draft: the target's aux ids the draft reads, comma-separated input-index ids "
                             "0..N (default EAGLE3's (2, N // 2, N - 3); N = the output of the last layer, pre-norm)")
    parser.add_argument("--json", action="store_true", help="print metrics.json to stdout at the end")
    args = parser.parse_args(argv)
    if args.vocab_size is not None and (args.retrain_draft is not None or args.eval_only is not None):
        parser.error("--vocab-size trains a new tokenizer and target: it does not go with --retrain-draft or "
                     "--eval-only (they keep DIR/target's)")
    if args.aux_layers is not None and args.retrain_draft is None:
        parser.error("--aux-layers needs --retrain-draft DIR (the pair trainer uses EAGLE3's default ids)")
    return args


def _vocab_size(text: str) -> int:
    """An argparse type: a BPE vocabulary of at least the 256 byte tokens and the end-of-text token."""
    value = positive_int(text)
    if value < 257:
        raise argparse.ArgumentTypeError(f"{value} is below 257: byte-level BPE needs the 256 bytes and <|endoftext|>")
    return value


def _aux_ids(text: str) -> tuple[int, ...]:
    """An argparse type: ``2,5,8`` -> (2, 5, 8), sorted and deduplicated (the contract's order)."""
    try:
        ids = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated layer ids, e.g. 2,5,8") from None
    if not ids or ids[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more ids >= 0, e.g. 2,5,8")
    return tuple(ids)


def preset_for(args: argparse.Namespace) -> tuple[str, Preset]:
    """(name, sizes) of the run: ``--preset`` (or ``--quick``; default ``demo``) with the flags that override it."""
    name = args.preset or ("quick" if args.quick else "demo")
    overrides = {k: v for k, v in (("target_steps", args.target_steps), ("draft_steps", args.draft_steps),
                                   ("ttt_steps", args.ttt_steps), ("eval_prompts", args.eval_prompts),
                                   ("max_corpus_chars", args.max_corpus_chars), ("batch_size", args.batch_size),
                                   ("vocab_size", args.vocab_size))
                 if v is not None}
    return name, replace(PRESETS[name], **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    preset_name, p = preset_for(args)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("train_demo: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    if args.retrain_draft is not None:
        try:
            check_aux_layers(args.aux_layers, args.retrain_draft / "target")
        except UsageError as exc:
            print(f"train_demo: error: {exc}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    if args.eval_only is not None:
        return eval_only(args, argv, preset_name, p, log)
    if args.retrain_draft is not None:
        return retrain_draft(args, argv, preset_name, p, log)
    return train_pair(args, argv, preset_name, p, log, start)


if __name__ == "__main__":
    sys.exit(main())
