"""Train the demo pair that `make demo` ships: a small Llama target and its EAGLE3 draft.

Reproduces ``sdk/pipespec/demo/`` from nothing but the Python standard library's own source (every
machine with Python has it), seeded::

    python bench/train_demo.py --out /tmp/demo --quick            # ~1-2 min on 2 CPU cores: smoke size
    python bench/train_demo.py --out /tmp/demo --device cuda      # the shipped size (a few min on one GPU)
    python bench/train_demo.py --out /tmp/pair --device cuda --preset medium --max-train-s 200
                                                                  # a ~51M target for GPU speedup runs (~5 min on one H200)
    python bench/train_demo.py --retrain-draft sdk/pipespec/demo --out /tmp/d2 --device cuda --gen-sequences 131072 \
        --gen-batch 4096 --gen-prompt-len 12 --gen-new-tokens 148 --heldout-sequences 256 --draft-steps 5000 \
        --batch-size 256 --max-train-s 220
                                                                  # keep the demo target, train a new draft on
                                                                  # the target's own greedy generations

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
fresh generations (CPU, prompts of Python 3.11's train / held-out split, another seed) the same draft agrees 0.74 (train-file prompts) and 0.60 (held-out-file prompts) with
in-vocabulary labels, 0.69/0.55 counting every label, and ``verify_walk`` over those hits gives 2.33 and
1.92, equal to ``reference_speculative_generate`` on the same prompts step for step. So ``--retrain-draft``
now draws distinct prompts, generates ``--heldout-sequences`` continuations of held-out-file prompts that
are never trained on, logs their replayed acceptance (the figure inference measures) beside the training
batches' agreement, and keeps the draft of the logged step where it was best.

Steps, each timed in ``metrics.json``:

1. corpus: ``Lib/**/*.py`` of the running interpreter's stdlib (site-packages excluded), split into
   train and held-out files by a hash of the relative path, so the split does not depend on file order;
2. tokenizer: byte-level BPE trained with ``tokenizers``, saved as a ``PreTrainedTokenizerFast``
   (``AutoTokenizer.from_pretrained(target_dir)`` loads it);
3. target: ``LlamaForCausalLM`` (tied embedding; ≤ 4M parameters in the quick and full presets, 51M in
   medium), next-token cross-entropy;
4. draft: EAGLE3 (``pipespec.engine.draft``) on the frozen target's aux states at the default ids
   ``(2, N//2, N-3)``, trained to match the target's next-next-token distribution over a pruned draft
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

Presets (``--preset``; ``--quick`` is ``--preset quick``): ``quick`` is a CPU smoke test, ``full`` the
shipped demo (3.3M-parameter target), ``medium`` a target big enough that a GPU decode step is more than
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
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from pipespec.cli.args import positive_int
from pipespec.contract.layout import eagle3_default_aux_ids
from pipespec.engine.draft import Eagle3Draft, Eagle3DraftConfig
from pipespec.engine.draft_checkpoint import TargetInfo, load_draft_checkpoint, save_draft_checkpoint
from pipespec.engine.testing import reference_speculative_generate, target_aux_states

EOS = "<|endoftext|>"


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
    "medium": Preset(
        max_corpus_chars=40_000_000, vocab_size=8192, hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=5,
        intermediate_size=1728, seq_len=512, batch_size=64, target_steps=2200, target_lr=1.2e-3,
        draft_vocab_size=4096, draft_intermediate_size=1728, draft_steps=1200, draft_lr=1e-3, ttt_steps=3,
        eval_prompts=10, eval_prompt_len=64, eval_new_tokens=96,
    ),
}


# ----------------------------------------------------------------------------------------- corpus
def load_corpus(max_chars: int, holdout_every: int = 40) -> tuple[list[str], list[str], dict[str, Any]]:
    """Stdlib ``.py`` sources: (train texts, held-out texts, a description). Deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts)
    train: list[str] = []
    held: list[str] = []
    total = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % holdout_every
        if bucket == 0:
            held.append(text)
        elif total < max_chars:
            train.append(text)
            total += len(text)
    info = {"root": str(root), "files": len(files), "train_files": len(train), "heldout_files": len(held),
            "train_chars": total}
    return train, held, info


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE over the training texts, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, model_max_length=1 << 30)


def encode_stream(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one token stream, documents separated by EOS."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def eval_prompts(tokenizer: Any, texts: Sequence[str], count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from held-out files, each starting at a random line start;
    files are visited round-robin (in a seeded order) so a small held-out split still yields ``count``."""
    gen = torch.Generator().manual_seed(seed + 7)
    usable = [t.splitlines(keepends=True) for t in texts]
    usable = [lines for lines in usable if len(lines) >= 40]
    order = torch.randperm(len(usable), generator=gen).tolist()
    prompts: list[list[int]] = []
    for attempt in range(20 * count if usable else 0):
        lines = usable[order[attempt % len(usable)]]
        start = int(torch.randint(0, len(lines) - 30, (1,), generator=gen))
        ids = tokenizer("".join(lines[start : start + 200]), add_special_tokens=False)["input_ids"][:length]
        if len(ids) == length and ids not in prompts:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


# ------------------------------------------------------------------------------------- training
def batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, device: str) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    return rows.long().to(device)


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _autocast(device: str) -> Any:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)


def make_target(p: Preset, vocab: int, eos_id: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads, intermediate_size=p.intermediate_size, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02, rope_theta=10000.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def _optimizer(params: Any, lr: float, weight_decay: float, device: str) -> torch.optim.AdamW:
    # The fused kernel on CUDA: one launch per step instead of several per parameter tensor.
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=device == "cuda")


def time_capped(t0: float, max_s: float | None) -> bool:
    """Whether a training loop started at ``t0`` has used up its wall-time cap (never without a cap)."""
    return max_s is not None and time.perf_counter() - t0 > max_s


def _steps_record(planned: int, run: int, capped: bool, max_s: float | None) -> dict[str, Any]:
    return {"planned_steps": planned, "steps_run": run, "time_capped": capped, "max_train_s": max_s}


def train_target(model: Any, stream: torch.Tensor, p: Preset, device: str, seed: int, log: Any,
                 max_s: float | None = None) -> dict[str, Any]:
    """Next-token training for ``p.target_steps`` steps, or until ``max_s`` seconds have passed."""
    gen = torch.Generator().manual_seed(seed + 1)
    model.to(device).train()
    opt = _optimizer(model.parameters(), p.target_lr, 0.1, device)
    t0 = time.perf_counter()
    losses: list[float] = []
    capped = False
    for step in range(p.target_steps):
        if step and time_capped(t0, max_s):
            capped = True
            log(f"target: stopping after {step} of {p.target_steps} steps: --max-train-s {max_s:g} reached")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, p.target_steps, p.target_lr)
        rows = batches(stream, p.batch_size, p.seq_len, gen, device)
        with _autocast(device):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % max(1, p.target_steps // 10) == 0 or step == p.target_steps - 1:
            log(f"target step {step:5d}/{p.target_steps}  loss {sum(losses[-50:]) / len(losses[-50:]):.3f}  "
                f"{time.perf_counter() - t0:6.1f}s")
    model.eval()
    return {"final_loss": sum(losses[-50:]) / len(losses[-50:]), "seconds": time.perf_counter() - t0,
            **_steps_record(p.target_steps, len(losses), capped, max_s)}


def draft_vocabulary(stream: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids in the training stream, sorted (EAGLE3's vocabulary pruning)."""
    counts = torch.bincount(stream.long(), minlength=vocab)
    return counts.topk(size).indices.sort().values


def make_draft(p: Preset, target_config: Any, draft_ids: torch.Tensor, aux_ids: Sequence[int]) -> Eagle3Draft:
    config = Eagle3DraftConfig.make(
        hidden_size=p.hidden_size, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
        intermediate_size=p.draft_intermediate_size, vocab_size=int(target_config.vocab_size),
        draft_vocab_size=int(draft_ids.numel()), target_hidden_size=int(target_config.hidden_size),
        num_aux=len(aux_ids), rms_norm_eps=1e-5, max_position_embeddings=1024, rope_theta=10000.0,
    )
    draft = Eagle3Draft(config, with_embedding=False)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        draft.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        draft.t2d.zero_()
        draft.t2d[draft_ids] = True
    return draft


def ttt_logits(draft: Eagle3Draft, feats: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits for ``steps`` unrolled steps over every root position at once.

    Root ``t`` (0 ≤ t ≤ T-2) at step i sits at position ``t + i``, reads token ``x_{t+1+i}`` and
    predicts ``x_{t+2+i}``; its hidden input is ``fc(aux_t)`` at step 0 and its own step i-1 output
    after. It attends to step-0 keys of roots ``≤ t`` (the verified positions at inference) and to its
    own chain's keys of steps 1..i (the draft's speculative cache entries) — the diagonal of each step.
    Tokens past the end are padding; the caller masks their labels.
    """
    layer = draft.midlayer
    bsz, length = ids.shape
    roots = length - 1
    groups = layer.num_heads // layer.num_kv_heads
    scale = layer.head_dim**-0.5
    causal = torch.ones(roots, roots, dtype=torch.bool, device=ids.device).tril()
    hidden = draft.combine_aux(feats[:, :roots])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    for i in range(steps):
        tokens = F.pad(ids[:, 1 + i :], (0, i))
        positions = (torch.arange(roots, device=ids.device) + i).expand(bsz, roots)
        cos, sin = draft.rotary(hidden, positions)
        residual, q, k, v = layer.qkv(draft.embed(tokens), hidden, cos, sin)
        keys.append(k.repeat_interleave(groups, dim=1))
        values.append(v.repeat_interleave(groups, dim=1))
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * keys[j]).sum(-1, keepdim=True) * scale for j in range(1, i + 1)]
        weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        attn = weights[..., :roots] @ values[0]
        for j in range(1, i + 1):
            attn = attn + weights[..., roots + j - 1 : roots + j] * values[j]
        hidden = layer.finish(residual, attn)
        out.append(draft.logits(hidden))
    return out


def train_draft(
    draft: Eagle3Draft, target: Any, aux_ids: Sequence[int], stream: torch.Tensor, p: Preset, device: str, seed: int,
    log: Any, max_s: float | None = None,
) -> dict[str, Any]:
    """EAGLE3 training on the frozen target for ``p.draft_steps`` steps, or until ``max_s`` seconds have passed."""
    gen = torch.Generator().manual_seed(seed + 2)
    draft.to(device).train()
    draft.embed_tokens = target.get_input_embeddings()  # shared and frozen, as at inference
    params = [q for name, q in draft.named_parameters() if not name.startswith("embed_tokens.")]
    for param in target.parameters():
        param.requires_grad_(False)
    opt = _optimizer(params, p.draft_lr, 0.0, device)
    draft_ids = torch.arange(draft.d2t.numel(), device=draft.d2t.device) + draft.d2t
    t0 = time.perf_counter()
    history: list[tuple[float, list[float]]] = []
    capped = False
    for step in range(p.draft_steps):
        if step and time_capped(t0, max_s):
            capped = True
            log(f"draft: stopping after {step} of {p.draft_steps} steps: --max-train-s {max_s:g} reached")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, p.draft_steps, p.draft_lr)
        rows = batches(stream, p.batch_size, p.seq_len, gen, device)[:, :-1]
        with torch.no_grad(), _autocast(device):
            logits_t, aux = target_aux_states(target, rows, aux_ids)
        feats = torch.cat([a.float() for a in aux], dim=-1)
        logits_t = logits_t.float()
        with _autocast(device):
            step_logits = ttt_logits(draft, feats, rows, p.ttt_steps)
        loss = feats.new_zeros(())
        accs: list[float] = []
        roots = rows.shape[1] - 1
        for i, logits_d in enumerate(step_logits):
            valid = roots - i  # roots whose label position t+1+i is inside the window
            label_logits = logits_t[:, 1 + i : 1 + i + valid]
            in_draft_vocab = draft.t2d[label_logits.argmax(-1)]
            probs = torch.softmax(label_logits[..., draft_ids], dim=-1)
            logp = torch.log_softmax(logits_d[:, :valid].float(), dim=-1)
            per_pos = -(probs * logp).sum(-1)
            mask = in_draft_vocab.float()
            loss = loss + (0.8**i) * (per_pos * mask).sum() / mask.sum().clamp(min=1)
            hit = (draft.to_target_ids(logits_d[:, :valid].argmax(-1)) == label_logits.argmax(-1)).float()
            accs.append(float((hit * mask).sum() / mask.sum().clamp(min=1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append((loss.item(), accs))
        if step % max(1, p.draft_steps // 10) == 0 or step == p.draft_steps - 1:
            recent = history[-50:]
            acc = [sum(h[1][i] for h in recent) / len(recent) for i in range(p.ttt_steps)]
            log(f"draft  step {step:5d}/{p.draft_steps}  loss {sum(h[0] for h in recent) / len(recent):.3f}  "
                f"top-1 agreement per TTT step {[round(a, 3) for a in acc]}  {time.perf_counter() - t0:6.1f}s")
    draft.eval()
    recent = history[-50:]
    return {
        "final_loss": sum(h[0] for h in recent) / len(recent),
        "top1_agreement_per_step": [sum(h[1][i] for h in recent) / len(recent) for i in range(p.ttt_steps)],
        "seconds": time.perf_counter() - t0,
        **_steps_record(p.draft_steps, len(history), capped, max_s),
    }


# ------------------------------------------------------------- draft on the target's own generations
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
    draft_vocab_size: int = 512
    draft_intermediate_size: int = 416  # 512 would put the shipped weights (fp16) just over 8 MB
    heldout_sequences: int = 64  # generations after held-out-file prompts, never trained on (HeldOut)


def generation_prompts(tokenizer: Any, texts: Sequence[str], count: int, length: int, seed: int) -> torch.Tensor:
    """``[count, length]`` distinct prompts from training files, each starting at a seeded random line start
    (every third attempt at a file's first line, like the demo's prompts); files visited in a seeded order.

    Distinct because greedy generation is deterministic: a repeated prompt is a repeated training sequence
    (drawing a file's first line again and again made ~30 % of 16384 prompts copies of a few hundred, which
    the draft memorized: in-sample agreement that held-out prompts never see)."""
    gen = torch.Generator().manual_seed(seed + 11)
    files = [t.splitlines(keepends=True) for t in texts]
    files = [lines for lines in files if len(lines) >= 20]
    rows: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    attempt = 0
    while len(rows) < count and attempt < 20 * count:
        texts_now = []
        for _ in range(min(4096, 20 * count - attempt)):  # tokenized a batch at a time (the fast tokenizer's batch path)
            lines = files[int(torch.randint(0, len(files), (1,), generator=gen))]
            start = 0 if attempt % 3 == 0 else int(torch.randint(0, len(lines) - 10, (1,), generator=gen))
            attempt += 1
            end, chars = start, 0
            while end < len(lines) and chars < 8 * length:  # whole lines, ~2-3x the characters needed
                chars += len(lines[end])
                end += 1
            texts_now.append("".join(lines[start:end]))
        for ids in tokenizer(texts_now, add_special_tokens=False)["input_ids"]:
            ids = ids[:length]
            if len(rows) < count and len(ids) == length and tuple(ids) not in seen:
                seen.add(tuple(ids))
                rows.append(ids)
    if len(rows) < count:
        raise RuntimeError(f"only {len(rows)} of {count} distinct generation prompts of {length} tokens found in the "
                           "corpus: ask for fewer (--gen-sequences) or shorter (--gen-prompt-len) ones")
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def greedy_generations(target: Any, prompts: torch.Tensor, new_tokens: int, batch: int, log: Any) -> torch.Tensor:
    """The target's greedy continuations (KV-cached, no stop at EOS): ``[N, prompt + new_tokens]`` ids."""
    out: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for lo in range(0, prompts.shape[0], batch):
        seq = prompts[lo : lo + batch]
        step = target(input_ids=seq, use_cache=True)
        past, pieces = step.past_key_values, [seq]
        nxt = step.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            pieces.append(nxt)
            step = target(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = step.past_key_values, step.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(nxt)
        out.append(torch.cat(pieces, dim=1))
        if lo == 0 or (lo // batch) % 8 == 7:
            log(f"generations: {lo + seq.shape[0]}/{prompts.shape[0]} sequences  {time.perf_counter() - t0:6.1f}s")
    return torch.cat(out)


@torch.no_grad()
def aux_features(target: Any, seqs: torch.Tensor, aux_ids: Sequence[int], batch: int) -> torch.Tensor:
    """``cat(aux states)`` of the target over every sequence, fp16 ``[N, L, len(aux_ids) * H]`` (computed once:
    the target is frozen, so every draft step reads the same states). Written into one preallocated tensor:
    no second copy at the end (at 131072 sequences of 160 tokens it is 24 GB)."""
    width = len(aux_ids) * int(target.config.hidden_size)
    out = torch.empty(seqs.shape[0], seqs.shape[1], width, dtype=torch.float16, device=seqs.device)
    for lo in range(0, seqs.shape[0], batch):
        _, aux = target_aux_states(target, seqs[lo : lo + batch], aux_ids)
        out[lo : lo + batch].copy_(torch.cat(aux, dim=-1))
    return out


def verify_walk(hits: Sequence[torch.Tensor], prompt_len: int, new_tokens: int) -> list[int]:
    """Tokens gained per verify step (accepted drafts + 1) of greedy speculative decoding at ``k = len(hits)``,
    replayed from training-time-test outcomes: ``hits[i][b, t]`` says whether root ``t``'s step-``i``
    prediction equals the target's token ``x[t + 2 + i]`` of sequence ``b``.

    A step-``i`` prediction reads the true tokens of steps ``< i``; those are the draft's own proposals exactly
    when steps ``< i`` were accepted, so the chain of hits from root ``t`` is what the engine accepts there.
    The walk starts where ``reference_speculative_generate`` does (root ``prompt_len - 1``, the prefill's token
    already out), moves to root ``t + accepted + 1`` after each step and stops once ``new_tokens`` are out:
    its steps are the reference's, token for token, when every sequence holds at least
    ``prompt_len + new_tokens + k - 1`` tokens (a hit past a sequence's end counts as a miss).
    """
    k = len(hits)
    rows = [h.cpu().tolist() for h in hits]
    steps: list[int] = []
    for b in range(len(rows[0]) if rows else 0):
        root, out = prompt_len - 1, 1
        while out < new_tokens:
            accepted = 0
            while accepted < k and root < len(rows[accepted][b]) and rows[accepted][b][root]:
                accepted += 1
            steps.append(accepted + 1)
            out += accepted + 1
            root += accepted + 1
    return steps


def ttt_hits(draft: Eagle3Draft, feats: torch.Tensor, seqs: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``[B, T-1]`` booleans per TTT step: root ``t``'s step-``i`` prediction (mapped to target ids) equals
    ``seqs[:, t + 2 + i]``; positions past the end are False."""
    roots = seqs.shape[1] - 1
    out = []
    for i, logits_d in enumerate(ttt_logits(draft, feats, seqs, steps)):
        valid = max(roots - 1 - i, 0)
        hit = torch.zeros(seqs.shape[0], roots, dtype=torch.bool, device=seqs.device)
        hit[:, :valid] = draft.to_target_ids(logits_d[:, :valid].argmax(-1)) == seqs[:, 2 + i : 2 + i + valid]
        out.append(hit)
    return out


@dataclass(frozen=True)
class HeldOut:
    """Greedy generations never trained on, measured the way inference will run on them.

    ``seqs [N, prompt_len + new_tokens + ttt_steps - 1]`` (the target's greedy continuations, as
    ``greedy_generations`` makes them) and their aux states ``feats``; ``new_tokens`` is what a speculative
    decode of each prompt produces. The draft's training-batch agreement is in-sample and leaves out labels
    outside the draft vocabulary (which inference can never accept), so it overstates acceptance; these
    figures do not.
    """

    seqs: torch.Tensor
    feats: torch.Tensor
    prompt_len: int
    new_tokens: int


@torch.no_grad()
def heldout_metrics(draft: Eagle3Draft, held: HeldOut, ttt_steps: int, chunk: int) -> dict[str, Any]:
    """On ``held``: top-1 agreement per TTT step over the generated labels (labels outside the draft vocabulary
    count as misses), the same restricted to in-vocabulary labels (what the training batches report), and the
    mean acceptance length at ``k = ttt_steps`` that ``verify_walk`` replays: the engine's figure on these
    sequences."""
    was_training = draft.training
    draft.eval()
    seqs = held.seqs
    roots = seqs.shape[1] - 1
    lo_label, hi_label = held.prompt_len, held.prompt_len + held.new_tokens
    hit_n = [0.0] * ttt_steps
    hit_in_vocab = [0.0] * ttt_steps
    labels_n = [0.0] * ttt_steps
    in_vocab_n = [0.0] * ttt_steps
    walk: list[int] = []
    for lo in range(0, seqs.shape[0], chunk):
        ids = seqs[lo : lo + chunk]
        hits = ttt_hits(draft, held.feats[lo : lo + chunk].float(), ids, ttt_steps)
        for i, hit in enumerate(hits):
            label_pos = torch.arange(roots, device=ids.device) + 2 + i
            counted = ((label_pos >= lo_label) & (label_pos < hi_label)).expand_as(hit)
            labels = ids.gather(1, label_pos.clamp(max=roots).expand_as(hit))
            in_vocab = counted & draft.t2d[labels]
            hit_n[i] += float((hit & counted).sum())
            hit_in_vocab[i] += float((hit & in_vocab).sum())
            labels_n[i] += float(counted.sum())
            in_vocab_n[i] += float(in_vocab.sum())
        walk.extend(verify_walk(hits, held.prompt_len, held.new_tokens))
    draft.train(was_training)
    return {
        "sequences": int(seqs.shape[0]), "prompt_len": held.prompt_len, "new_tokens": held.new_tokens,
        "top1_agreement_per_step": [h / max(n, 1.0) for h, n in zip(hit_n, labels_n, strict=True)],
        "top1_agreement_in_vocab_per_step": [h / max(n, 1.0) for h, n in zip(hit_in_vocab, in_vocab_n, strict=True)],
        "draft_vocab_coverage": in_vocab_n[0] / max(labels_n[0], 1.0),
        "mean_acceptance_length": sum(walk) / max(len(walk), 1), "verify_steps": len(walk), "k": ttt_steps,
    }


def train_draft_on_generations(
    draft: Eagle3Draft, target: Any, feats: torch.Tensor, seqs: torch.Tensor, recipe: GenerationRecipe,
    ttt_steps: int, seed: int, log: Any, max_s: float | None = None, held: HeldOut | None = None,
) -> dict[str, Any]:
    """Training-time test on the target's greedy generations: every root in the generated part is unrolled
    ``ttt_steps`` steps on the draft's own outputs, each step's label the target's greedy next token (the
    token the sequence holds, since the target wrote it); roots whose label is outside the draft vocabulary
    or inside the prompt are masked.

    With ``held``, every log line also reports ``heldout_metrics`` (its acceptance length is what inference
    measures on those sequences), and the draft returned is the one of the logged step with the best held-out
    acceptance (the last step's weights may have overfit the generations)."""
    gen = torch.Generator().manual_seed(seed + 3)
    draft.train()
    draft.embed_tokens = target.get_input_embeddings()  # shared and frozen, as at inference
    params = [q for name, q in draft.named_parameters() if not name.startswith("embed_tokens.")]
    for param in target.parameters():
        param.requires_grad_(False)
    device = str(seqs.device.type)
    opt = _optimizer(params, recipe.lr, 0.0, device)
    t2d = draft.t2d
    to_draft = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft id (valid where t2d)
    length = seqs.shape[1]
    roots = length - 1
    t0 = time.perf_counter()
    history: list[tuple[float, list[float]]] = []
    capped = False
    best: dict[str, Any] = {}
    eval_s = 0.0

    def measure(step: int) -> None:
        nonlocal eval_s
        if held is None:
            return
        t = time.perf_counter()
        m = heldout_metrics(draft, held, ttt_steps, max(recipe.batch_size, 64))
        eval_s += time.perf_counter() - t
        log(f"draft  step {step:5d}  held-out generations: acceptance (k={ttt_steps}) {m['mean_acceptance_length']:.3f}"
            f"  agreement per TTT step {[round(a, 3) for a in m['top1_agreement_per_step']]}")
        if not best or m["mean_acceptance_length"] > best["metrics"]["mean_acceptance_length"]:
            state = {k: v.detach().clone() for k, v in draft.state_dict().items() if not k.startswith("embed_tokens.")}
            best.update(step=step, metrics=m, state=state)

    for step in range(recipe.steps):
        if step and time_capped(t0, max_s):  # held-out measuring counts too
            capped = True
            log(f"draft: stopping after {step} of {recipe.steps} steps: --max-train-s {max_s:g} reached")
            measure(step - 1)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe.steps, recipe.lr)
        idx = torch.randint(0, seqs.shape[0], (recipe.batch_size,), generator=gen)
        ids, f = seqs[idx], feats[idx].float()
        step_logits = ttt_logits(draft, f, ids, ttt_steps)
        loss = f.new_zeros(())
        accs: list[float] = []
        for i, logits_d in enumerate(step_logits):
            valid = roots - 1 - i  # roots t whose label x[t + 2 + i] is inside the sequence
            labels = ids[:, 2 + i : 2 + i + valid]
            generated = torch.arange(valid, device=ids.device) + 1 + i >= recipe.prompt_len - 1  # written by the target
            mask = (t2d[labels] & generated).float()
            logp = torch.log_softmax(logits_d[:, :valid].float(), dim=-1)
            nll = -logp.gather(-1, to_draft[labels].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            loss = loss + (0.8**i) * (nll * mask).sum() / mask.sum().clamp(min=1)
            hit = (draft.to_target_ids(logits_d[:, :valid].argmax(-1)) == labels).float()
            accs.append(float((hit * mask).sum() / mask.sum().clamp(min=1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append((loss.item(), accs))
        if step % max(1, recipe.steps // 20) == 0 or step == recipe.steps - 1:
            recent = history[-50:]
            acc = [sum(h[1][i] for h in recent) / len(recent) for i in range(ttt_steps)]
            log(f"draft  step {step:5d}/{recipe.steps}  loss {sum(h[0] for h in recent) / len(recent):.3f}  "
                f"training-batch agreement per TTT step (in-vocabulary labels) {[round(a, 3) for a in acc]}  "
                f"{time.perf_counter() - t0:6.1f}s")
            measure(step)
    draft.eval()
    recent = history[-50:]
    record: dict[str, Any] = {
        "final_loss": sum(h[0] for h in recent) / len(recent),
        "top1_agreement_per_step": [sum(h[1][i] for h in recent) / len(recent) for i in range(ttt_steps)],
        "top1_agreement_counts": "training batches (in-sample), labels outside the draft vocabulary left out",
        "seconds": time.perf_counter() - t0,
        "heldout_eval_s": eval_s,
        **_steps_record(recipe.steps, len(history), capped, max_s),
    }
    if best:
        missing, unexpected = draft.load_state_dict(best["state"], strict=False)
        if unexpected or [m for m in missing if not m.startswith("embed_tokens.")]:
            raise RuntimeError(f"best draft state does not fit the draft (missing {missing}, unexpected {unexpected})")
        record["heldout"] = {"kept_step": best["step"], **best["metrics"]}
        log(f"draft: keeping step {best['step']} (held-out acceptance {best['metrics']['mean_acceptance_length']:.3f})")
    return record


# ------------------------------------------------------------------------------------ evaluation
def evaluate(target: Any, draft: Eagle3Draft, aux_ids: Sequence[int], prompts: Sequence[Sequence[int]],
             new_tokens: int, ks: Sequence[int], log: Any) -> dict[str, Any]:
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


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------ main
def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number of seconds")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (target/, draft/, metrics.json)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--preset", choices=tuple(PRESETS),
                      help="sizes and steps: quick (CPU smoke test), full (the shipped demo; default), medium "
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
    parser.add_argument("--max-train-s", type=_positive_seconds, metavar="SECONDS",
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
    parser.add_argument("--draft-lr", type=_positive_seconds, metavar="LR",
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
    parser.add_argument("--json", action="store_true", help="print metrics.json to stdout at the end")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    preset_name = args.preset or ("quick" if args.quick else "full")
    p = PRESETS[preset_name]
    overrides = {k: v for k, v in (("target_steps", args.target_steps), ("draft_steps", args.draft_steps),
                                   ("ttt_steps", args.ttt_steps), ("eval_prompts", args.eval_prompts),
                                   ("max_corpus_chars", args.max_corpus_chars), ("batch_size", args.batch_size))
                 if v is not None}
    p = replace(p, **overrides)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("train_demo: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    if args.eval_only is not None:
        return eval_only(args, argv, preset_name, p, log)
    if args.retrain_draft is not None:
        return retrain_draft(args, argv, preset_name, p, log)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    train_texts, held_texts, corpus = load_corpus(p.max_corpus_chars)
    tokenizer = train_tokenizer(train_texts, p.vocab_size)
    stream = encode_stream(tokenizer, train_texts)
    prompts = eval_prompts(tokenizer, held_texts, p.eval_prompts, p.eval_prompt_len, args.seed)
    phases["corpus_and_tokenizer_s"] = time.perf_counter() - t
    corpus.update(train_tokens=int(stream.numel()), vocab_size=len(tokenizer))
    log(f"corpus: {corpus['train_files']} files, {corpus['train_chars']:,} chars -> {stream.numel():,} tokens "
        f"(vocab {len(tokenizer)}); {len(prompts)} held-out prompts")

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    target = make_target(p, len(tokenizer), eos_id)
    target_params = sum(q.numel() for q in target.parameters())
    log(f"target: Llama, {target_params:,} parameters, N={p.num_layers}, H={p.hidden_size}")
    target_stats = train_target(target, stream, p, device, args.seed, log, args.max_train_s)
    phases["target_training_s"] = target_stats["seconds"]

    target_dir = out / "target"
    target.to("cpu").to(torch.float16).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    from transformers import AutoModelForCausalLM

    # Everything from here on uses the shipped (fp16-rounded) weights, reloaded from disk.
    if device == "cuda":
        from pipespec.engine.worker import configure_cuda_attention

        configure_cuda_attention()  # decoding grows the key length every step: no cuDNN plan per shape
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    aux_ids = eagle3_default_aux_ids(p.num_layers)
    draft_ids = draft_vocabulary(stream, len(tokenizer), p.draft_vocab_size)
    draft = make_draft(p, target.config, draft_ids, aux_ids)
    draft_params = sum(q.numel() for name, q in draft.named_parameters() if not name.startswith("embed_tokens."))
    log(f"draft: EAGLE3, {draft_params:,} parameters (+ the target's embedding, shared), aux ids {list(aux_ids)}, "
        f"draft vocab {draft_ids.numel()}, {p.ttt_steps} TTT steps")
    draft_stats = train_draft(draft, target, aux_ids, stream, p, device, args.seed, log, args.max_train_s)
    phases["draft_training_s"] = draft_stats["seconds"]

    draft_dir = out / "draft"
    draft.embed_tokens = None  # it was the target's module (shared): moving the draft must not move it
    draft.to("cpu")
    save_draft_checkpoint(draft, draft_dir, format="B", aux_layers=aux_ids, include_embedding=False,
                          dtype=torch.float16, verifier="pipespec-demo-target", num_speculative_tokens=3)

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


def pruned_draft(path: Path, target: Any, sizes: Preset, aux_ids: Sequence[int]) -> tuple[Eagle3Draft, dict[str, Any]]:
    """A trained draft (``path``) as the starting point, its MLP cut to ``sizes.draft_intermediate_size``
    units: the units whose output (``down_proj`` column norm x ``up_proj`` row norm) is smallest go."""
    loaded = load_draft_checkpoint(path, TargetInfo.from_config(target.config), dtype=torch.float32,
                                   target_embed=target.get_input_embeddings())
    old = loaded.model
    if list(loaded.info.aux_layers) != list(aux_ids):
        raise RuntimeError(f"--init-draft {path}: aux layers {list(loaded.info.aux_layers)}, expected {list(aux_ids)}")
    draft_ids = old.to_target_ids(torch.arange(old.d2t.numel()))
    draft = make_draft(sizes, target.config, draft_ids, aux_ids)
    state = {k: v for k, v in old.state_dict().items() if not k.startswith("embed_tokens.")}
    mlp = old.midlayer.mlp
    units = mlp.up_proj.weight.shape[0]
    keep_n = sizes.draft_intermediate_size
    if keep_n > units:
        raise RuntimeError(f"--init-draft {path}: {units} MLP units, cannot grow to {keep_n}")
    score = mlp.down_proj.weight.norm(dim=0) * mlp.up_proj.weight.norm(dim=1)
    keep = score.topk(keep_n).indices.sort().values
    for name in ("gate_proj", "up_proj"):
        state[f"midlayer.mlp.{name}.weight"] = state[f"midlayer.mlp.{name}.weight"][keep]
    state["midlayer.mlp.down_proj.weight"] = state["midlayer.mlp.down_proj.weight"][:, keep]
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("embed_tokens.")]:
        raise RuntimeError(f"--init-draft {path}: state does not fit the draft (missing {missing}, unexpected {unexpected})")
    return draft, {"from": str(path), "intermediate_from": units, "intermediate_to": keep_n}


def retrain_draft(args: argparse.Namespace, argv: Sequence[str] | None, preset_name: str, p: Preset, log: Any) -> int:
    """``--retrain-draft DIR``: keep DIR/target, train a new draft on its greedy generations (from scratch, or
    from ``--init-draft``), on ``--device``."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = GenerationRecipe(**{k: v for k, v in (("sequences", args.gen_sequences), ("steps", args.draft_steps),
                                                    ("batch_size", args.batch_size), ("lr", args.draft_lr),
                                                    ("gen_batch", args.gen_batch),
                                                    ("heldout_sequences", args.heldout_sequences),
                                                    ("prompt_len", args.gen_prompt_len),
                                                    ("new_tokens", args.gen_new_tokens))
                                  if v is not None})
    source: Path = args.retrain_draft / "target"
    out: Path = args.out
    target_dir, draft_dir = out / "target", out / "draft"
    if target_dir.resolve() != source.resolve():
        shutil.copytree(source, target_dir, dirs_exist_ok=True)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    train_texts, held_texts, corpus = load_corpus(p.max_corpus_chars)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    device = args.device
    if device == "cuda":
        from pipespec.engine.worker import configure_cuda_attention

        configure_cuda_attention()  # generation grows the key length every step: no cuDNN plan per shape
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    prompts = generation_prompts(tokenizer, train_texts, recipe.sequences, recipe.prompt_len, args.seed).to(device)
    held = eval_prompts(tokenizer, held_texts, p.eval_prompts, p.eval_prompt_len, args.seed)
    seqs = greedy_generations(target, prompts, recipe.new_tokens, recipe.gen_batch, log)
    phases["generations_s"] = time.perf_counter() - t
    t = time.perf_counter()
    aux_ids = eagle3_default_aux_ids(int(target.config.num_hidden_layers))
    feats = aux_features(target, seqs, aux_ids, recipe.gen_batch)
    phases["aux_states_s"] = time.perf_counter() - t
    log(f"data: {seqs.shape[0]} greedy generations of {recipe.new_tokens} tokens after {recipe.prompt_len}-token "
        f"prompts; aux states {tuple(feats.shape)} fp16 ({feats.numel() * 2 / 1e6:.0f} MB)")
    t = time.perf_counter()
    held_prompts = generation_prompts(tokenizer, held_texts, recipe.heldout_sequences, p.eval_prompt_len,
                                      args.seed + 1).to(device)
    held_seqs = greedy_generations(target, held_prompts, p.eval_new_tokens + p.ttt_steps - 1, recipe.gen_batch,
                                   lambda _msg: None)
    heldout = HeldOut(held_seqs, aux_features(target, held_seqs, aux_ids, recipe.gen_batch), p.eval_prompt_len,
                      p.eval_new_tokens)
    phases["heldout_data_s"] = time.perf_counter() - t
    log(f"held-out: {recipe.heldout_sequences} greedy generations after {p.eval_prompt_len}-token prompts from "
        f"held-out files (never trained on; acceptance replayed at k={p.ttt_steps} over {p.eval_new_tokens} tokens)")
    generated = seqs[:, recipe.prompt_len :].reshape(-1)
    sizes = replace(p, hidden_size=int(target.config.hidden_size), num_heads=int(target.config.num_attention_heads),
                    num_kv_heads=int(target.config.num_key_value_heads),
                    draft_intermediate_size=recipe.draft_intermediate_size)
    init: dict[str, Any] = {"from": "scratch"}
    if args.init_draft is not None:
        draft, init = pruned_draft(args.init_draft, target, sizes, aux_ids)
        draft_ids = draft.to_target_ids(torch.arange(draft.d2t.numel()))
        log(f"draft: starting from {args.init_draft} ({init['intermediate_from']} -> {init['intermediate_to']} MLP units, "
            "the least used pruned; its vocabulary kept)")
    else:
        draft_ids = draft_vocabulary(generated.cpu(), int(target.config.vocab_size), recipe.draft_vocab_size)
        draft = make_draft(sizes, target.config, draft_ids, aux_ids)
    draft.to(device)
    coverage = float(torch.isin(generated.cpu(), draft_ids.cpu()).float().mean())
    draft_params = sum(q.numel() for name, q in draft.named_parameters() if not name.startswith("embed_tokens."))
    log(f"draft: EAGLE3, {draft_params:,} parameters (+ the target's embedding, shared), aux ids {list(aux_ids)}, "
        f"draft vocab {draft_ids.numel()} (covers {coverage:.1%} of generated tokens), {p.ttt_steps} TTT steps")
    draft_stats = train_draft_on_generations(draft, target, feats, seqs, recipe, p.ttt_steps, args.seed, log,
                                             args.max_train_s, heldout)
    phases["draft_training_s"] = draft_stats["seconds"]
    draft.embed_tokens = None  # the target's (shared): moving the draft must not move it
    draft.to("cpu")
    save_draft_checkpoint(draft, draft_dir, format="B", aux_layers=aux_ids, include_embedding=False,
                          dtype=torch.float16, verifier="pipespec-demo-target", num_speculative_tokens=3)
    from pipespec.cli.demo import SHIPPED_PROMPTS

    demo_prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in SHIPPED_PROMPTS]
    demo_eval, _ = evaluate_checkpoints(target_dir, draft_dir, demo_prompts, 64, device, log, ks=(3,))
    evaluation, sample = evaluate_checkpoints(target_dir, draft_dir, held, p.eval_new_tokens, device, log, ks=(3,))
    phases["evaluation_s"] = demo_eval["seconds"] + evaluation["seconds"]
    metrics = {
        **run_record(argv, device, preset_name, p, args.seed),
        "recipe": {"kind": "EAGLE3 training-time test on the target's own greedy generations", **asdict(recipe),
                   "ttt_steps": p.ttt_steps, "target": str(source)},
        "corpus": corpus,
        "target": {"parameters": sum(q.numel() for q in target.parameters()), "kept_from": str(source)},
        "draft": {"parameters": draft_params, "aux_layers": list(aux_ids), "format": "B", "init": init,
                  "draft_vocab_coverage_of_generations": coverage, **draft_stats},
        "demo_prompts_evaluation": demo_eval,
        "evaluation": evaluation,
        "sample": sample,
        "sizes": checkpoint_sizes(target_dir, draft_dir),
        "phases_s": phases,
        "total_s": sum(phases.values()),
    }
    return finish(metrics, out / "metrics.json", args.json, log)


def evaluate_checkpoints(
    target_dir: Path, draft_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int, device: str, log: Any,
    ks: Sequence[int] = (3, 5),
) -> tuple[dict[str, Any], dict[str, str]]:
    """Load the written checkpoints (float32) and measure them; also a decoded sample continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    loaded = load_draft_checkpoint(draft_dir, TargetInfo.from_config(target.config), dtype=torch.float32,
                                   device=device, target_embed=target.get_input_embeddings())
    log(f"evaluating {draft_dir} ({loaded.info.format_name}, aux ids {list(loaded.info.aux_layers)}, convention "
        f"{loaded.info.aux_convention}) against {target_dir} on {len(prompts)} prompts")
    evaluation = evaluate(target, loaded.model, loaded.info.aux_layers, prompts, new_tokens, ks, log)
    tok = AutoTokenizer.from_pretrained(target_dir)
    sample = {"prompt": tok.decode(prompts[0]) if prompts else "",
              "greedy_continuation": tok.decode(evaluation.pop("sample_output_ids"))}
    return evaluation, sample


def checkpoint_sizes(target_dir: Path, draft_dir: Path) -> dict[str, int]:
    sizes = {"target_bytes": dir_bytes(target_dir), "draft_bytes": dir_bytes(draft_dir)}
    sizes["total_bytes"] = sizes["target_bytes"] + sizes["draft_bytes"]
    return sizes


def run_record(argv: Sequence[str] | None, device: str, preset_name: str, p: Preset, seed: int) -> dict[str, Any]:
    """Where and how a figure was made: command, date, machine, versions, settings."""
    return {
        "command": " ".join(["python", "bench/train_demo.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu x{torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "preset": preset_name,
        "settings": asdict(p),
        "seed": seed,
    }


def finish(metrics: dict[str, Any], path: Path, print_json: bool, log: Any) -> int:
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"checkpoints: {metrics['sizes']['total_bytes'] / 1e6:.2f} MB; metrics in {path}")
    for k, row in metrics["evaluation"]["k"].items():
        print(f"  k={k}: mean acceptance length {row['mean_acceptance_length']:.3f}  lossless={row['lossless']}")
    if print_json:
        print(json.dumps(metrics))
    return 0 if all(row["lossless"] for row in metrics["evaluation"]["k"].values()) else 1


def eval_only(args: argparse.Namespace, argv: Sequence[str] | None, preset_name: str, p: Preset, log: Any) -> int:
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

if __name__ == "__main__":
    sys.exit(main())
