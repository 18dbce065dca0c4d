"""EAGLE3 draft training with unrolled test-time-training (TTT) steps: one loop, two data sources.

- ``CorpusWindows`` (the main flow): windows of the corpus stream; the frozen target runs on each batch and
  the draft learns its next-next-token distribution over the draft vocabulary (soft labels);
- ``GeneratedSequences`` (``--retrain-draft``, EAGLE3's recipe proper): the target's own greedy generations
  with their aux states computed once; each step's label is the token the target wrote (hard labels).

Either way step i feeds the draft its own step i-1 output and attends to the verified positions plus its
own earlier steps of the same chain (``draft_model.ttt_logits``): what its KV cache holds at inference.
With held-out generations (``heldout.HeldOut``) the loop also replays acceptance at every log step and
returns the draft of the best one.

Imports pipespec's engine (draft model, aux states); nothing of vllm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from bench.demo_training.draft_model import EMBED, load_trainable_state, trainable_state, ttt_logits
from bench.demo_training.heldout import HeldOut, heldout_metrics
from bench.demo_training.loop import (
    History,
    Schedule,
    autocast,
    batches,
    optimizer,
    recent_means,
    run_steps,
    steps_record,
)
from bench.demo_training.presets import GenerationRecipe, Preset
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.reference import target_aux_states

STEP_DECAY = 0.8  # TTT step i's loss weighs 0.8**i


@dataclass(frozen=True)
class DraftVocab:
    """The draft's vocabulary maps: ``t2d`` (target id -> in the draft vocabulary), ``target_ids`` (draft id ->
    target id) and ``to_draft`` (target id -> draft id, valid where ``t2d``)."""

    t2d: torch.Tensor
    target_ids: torch.Tensor
    to_draft: torch.Tensor

    @classmethod
    def of(cls, draft: Eagle3Draft) -> DraftVocab:
        target_ids = torch.arange(draft.d2t.numel(), device=draft.d2t.device) + draft.d2t
        return cls(draft.t2d, target_ids, torch.cumsum(draft.t2d.long(), 0) - 1)


@dataclass(frozen=True)
class StepLabels:
    """What TTT step i is trained against over its first ``labels.shape[1]`` roots: the target ids it should
    predict (agreement counts against them), where they count (``mask``, float), and either the target's
    distribution over the draft vocabulary (``probs``, soft labels) or none (the label itself, hard)."""

    labels: torch.Tensor
    mask: torch.Tensor
    probs: torch.Tensor | None = None

    def loss_and_agreement(self, draft: Eagle3Draft, logits_d: torch.Tensor, vocab: DraftVocab,
                           weight: float) -> tuple[torch.Tensor, float]:
        """``weight`` x the masked mean cross-entropy of the step's draft logits, and its masked top-1 agreement."""
        valid = self.labels.shape[1]
        logp = torch.log_softmax(logits_d[:, :valid].float(), dim=-1)
        if self.probs is not None:
            per_pos = -(self.probs * logp).sum(-1)
        else:
            per_pos = -logp.gather(-1, vocab.to_draft[self.labels].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        count = self.mask.sum().clamp(min=1)
        hit = (draft.to_target_ids(logits_d[:, :valid].argmax(-1)) == self.labels).float()
        return weight * (per_pos * self.mask).sum() / count, float((hit * self.mask).sum() / count)


class DraftBatch(Protocol):
    ids: torch.Tensor  # [B, T] tokens
    feats: torch.Tensor  # [B, T, num_aux * H] float32 aux states

    def step(self, i: int, vocab: DraftVocab) -> StepLabels: ...


class DraftSource(Protocol):
    """Where the loop's batches come from, and how its log and record describe their agreement."""

    agreement_label: ClassVar[str]
    agreement_counts: ClassVar[str | None]
    draft_autocast: ClassVar[bool]

    @property
    def device(self) -> str: ...

    def draw(self, gen: torch.Generator) -> DraftBatch: ...


@dataclass(frozen=True)
class _WindowBatch:
    ids: torch.Tensor
    feats: torch.Tensor
    target_logits: torch.Tensor  # float32 [B, T, vocab]

    def step(self, i: int, vocab: DraftVocab) -> StepLabels:
        valid = self.ids.shape[1] - 1 - i  # roots whose label position t+1+i is inside the window
        label_logits = self.target_logits[:, 1 + i : 1 + i + valid]
        labels = label_logits.argmax(-1)
        return StepLabels(labels, vocab.t2d[labels].float(), torch.softmax(label_logits[..., vocab.target_ids], dim=-1))


@dataclass(frozen=True)
class CorpusWindows:
    """Random windows of the token stream; the frozen target's logits and aux states computed per batch."""

    target: Any
    aux_ids: Sequence[int]
    stream: torch.Tensor
    batch_size: int
    seq_len: int
    device: str
    agreement_label: ClassVar[str] = "top-1 agreement per TTT step"
    agreement_counts: ClassVar[str | None] = None
    draft_autocast: ClassVar[bool] = True

    def draw(self, gen: torch.Generator) -> _WindowBatch:
        rows = batches(self.stream, self.batch_size, self.seq_len, gen, self.device)[:, :-1]
        with torch.no_grad(), autocast(self.device):
            logits_t, aux = target_aux_states(self.target, rows, self.aux_ids)
        return _WindowBatch(rows, torch.cat([a.float() for a in aux], dim=-1), logits_t.float())


@dataclass(frozen=True)
class _GeneratedBatch:
    ids: torch.Tensor
    feats: torch.Tensor
    prompt_len: int

    def step(self, i: int, vocab: DraftVocab) -> StepLabels:
        valid = self.ids.shape[1] - 2 - i  # roots t whose label x[t + 2 + i] is inside the sequence
        labels = self.ids[:, 2 + i : 2 + i + valid]
        generated = torch.arange(valid, device=self.ids.device) + 1 + i >= self.prompt_len - 1  # the target wrote it
        return StepLabels(labels, (vocab.t2d[labels] & generated).float())


@dataclass(frozen=True)
class GeneratedSequences:
    """The target's greedy generations ``seqs`` and their fp16 aux states ``feats``, drawn with replacement;
    labels inside the prompt are masked."""

    seqs: torch.Tensor
    feats: torch.Tensor
    prompt_len: int
    batch_size: int
    agreement_label: ClassVar[str] = "training-batch agreement per TTT step (in-vocabulary labels)"
    agreement_counts: ClassVar[str | None] = "training batches (in-sample), labels outside the draft vocabulary left out"
    draft_autocast: ClassVar[bool] = False  # the draft runs in float32 here, on CUDA too

    @property
    def device(self) -> str:
        return str(self.seqs.device.type)

    def draw(self, gen: torch.Generator) -> _GeneratedBatch:
        idx = torch.randint(0, self.seqs.shape[0], (self.batch_size,), generator=gen)
        return _GeneratedBatch(self.seqs[idx], self.feats[idx].float(), self.prompt_len)


class BestHeldOut:
    """Replays acceptance on held-out generations when asked (``measure``), keeping the best draft state;
    does nothing without ``held``."""

    def __init__(self, draft: Eagle3Draft, held: HeldOut | None, ttt_steps: int, chunk: int,
                 log: Callable[[str], None]) -> None:
        self.draft, self.held, self.ttt_steps, self.chunk, self.log = draft, held, ttt_steps, chunk, log
        self.seconds = 0.0
        self.best: dict[str, Any] = {}

    def measure(self, step: int) -> None:
        if self.held is None:
            return
        t = time.perf_counter()
        m = heldout_metrics(self.draft, self.held, self.ttt_steps, self.chunk)
        self.seconds += time.perf_counter() - t
        self.log(f"draft  step {step:5d}  held-out generations: acceptance (k={self.ttt_steps}) "
                 f"{m['mean_acceptance_length']:.3f}  agreement per TTT step "
                 f"{[round(a, 3) for a in m['top1_agreement_per_step']]}")
        if not self.best or m["mean_acceptance_length"] > self.best["metrics"]["mean_acceptance_length"]:
            self.best.update(step=step, metrics=m, state=trainable_state(self.draft, clone=True))

    def restore(self) -> dict[str, Any] | None:
        """Load the best measured state into the draft; its step and metrics (None if nothing was measured)."""
        if not self.best:
            return None
        load_trainable_state(self.draft, self.best["state"], "best draft state")
        self.log(f"draft: keeping step {self.best['step']} "
                 f"(held-out acceptance {self.best['metrics']['mean_acceptance_length']:.3f})")
        return {"kept_step": self.best["step"], **self.best["metrics"]}


def train_draft_steps(
    draft: Eagle3Draft, target: Any, source: DraftSource, schedule: Schedule, ttt_steps: int, seed: int,
    log: Callable[[str], None], held: HeldOut | None = None, held_chunk: int = 64,
) -> dict[str, Any]:
    """The draft training loop: the target frozen, its embedding shared (as at inference), ``ttt_steps``
    unrolled steps per batch from ``source``; with ``held`` the best logged draft is kept (``BestHeldOut``)."""
    gen = torch.Generator().manual_seed(seed)
    draft.train()
    draft.embed_tokens = target.get_input_embeddings()  # shared and frozen, as at inference
    params = [q for name, q in draft.named_parameters() if not name.startswith(EMBED)]
    for param in target.parameters():
        param.requires_grad_(False)
    opt = optimizer(params, schedule.peak_lr, 0.0, source.device)
    vocab = DraftVocab.of(draft)
    keeper = BestHeldOut(draft, held, ttt_steps, held_chunk, log)

    def step_loss(_step: int) -> tuple[torch.Tensor, list[float]]:
        batch = source.draw(gen)
        with autocast(source.device, source.draft_autocast):
            step_logits = ttt_logits(draft, batch.feats, batch.ids, ttt_steps)
        loss = batch.feats.new_zeros(())
        agreement: list[float] = []
        for i, logits_d in enumerate(step_logits):
            step_loss_i, agree = batch.step(i, vocab).loss_and_agreement(draft, logits_d, vocab, STEP_DECAY**i)
            loss = loss + step_loss_i
            agreement.append(agree)
        return loss, agreement

    def report(step: int, history: History, elapsed: float) -> None:
        loss, agreement = recent_means(history)
        log(f"draft  step {step:5d}/{schedule.steps}  loss {loss:.3f}  {source.agreement_label} "
            f"{[round(a, 3) for a in agreement]}  {elapsed:6.1f}s")
        keeper.measure(step)

    run = run_steps(schedule, opt, params, step_loss, report, log, on_cap=keeper.measure)
    draft.eval()
    return _record(run.history, run.seconds, run.capped, schedule, source, keeper if held is not None else None)


def _record(history: History, seconds: float, capped: bool, schedule: Schedule, source: DraftSource,
            keeper: BestHeldOut | None) -> dict[str, Any]:
    loss, agreement = recent_means(history)
    record: dict[str, Any] = {"final_loss": loss, "top1_agreement_per_step": agreement}
    if source.agreement_counts is not None:
        record["top1_agreement_counts"] = source.agreement_counts
    record["seconds"] = seconds
    if keeper is not None:
        record["heldout_eval_s"] = keeper.seconds
    record.update(steps_record(schedule.steps, len(history), capped, schedule.max_s))
    kept = keeper.restore() if keeper is not None else None
    if kept is not None:
        record["heldout"] = kept
    return record


def train_draft(
    draft: Eagle3Draft, target: Any, aux_ids: Sequence[int], stream: torch.Tensor, p: Preset, device: str, seed: int,
    log: Callable[[str], None], max_s: float | None = None,
) -> dict[str, Any]:
    """EAGLE3 training on the frozen target for ``p.draft_steps`` steps, or until ``max_s`` seconds have passed."""
    draft.to(device)
    source = CorpusWindows(target, tuple(aux_ids), stream, p.batch_size, p.seq_len, device)
    schedule = Schedule("draft", p.draft_steps, p.draft_lr, max(1, p.draft_steps // 10), max_s)
    return train_draft_steps(draft, target, source, schedule, p.ttt_steps, seed + 2, log)


def train_draft_on_generations(
    draft: Eagle3Draft, target: Any, feats: torch.Tensor, seqs: torch.Tensor, recipe: GenerationRecipe,
    ttt_steps: int, seed: int, log: Callable[[str], None], max_s: float | None = None, held: HeldOut | None = None,
) -> dict[str, Any]:
    """Training-time test on the target's greedy generations: every root in the generated part is unrolled
    ``ttt_steps`` steps on the draft's own outputs, each step's label the target's greedy next token (the
    token the sequence holds, since the target wrote it); roots whose label is outside the draft vocabulary
    or inside the prompt are masked.

    With ``held``, every log line also reports ``heldout_metrics`` (its acceptance length is what inference
    measures on those sequences), and the draft returned is the one of the logged step with the best held-out
    acceptance (the last step's weights may have overfit the generations)."""
    source = GeneratedSequences(seqs, feats, recipe.prompt_len, recipe.batch_size)
    schedule = Schedule("draft", recipe.steps, recipe.lr, max(1, recipe.steps // 20), max_s)
    return train_draft_steps(draft, target, source, schedule, ttt_steps, seed + 3, log, held,
                             max(recipe.batch_size, 64))
