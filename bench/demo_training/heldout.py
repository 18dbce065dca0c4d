"""Acceptance measured the way inference will run, on greedy generations never trained on.

The draft's training-batch agreement is in-sample and leaves out labels outside the draft vocabulary
(which inference can never accept), so it overstates acceptance. Here the training forward's hits on
held-out generations are replayed as greedy speculative decoding (``verify_walk``): the figure
``reference_speculative_generate`` measures on the same prompts, step for step.

Imports pipespec's draft model; nothing of transformers or vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench.demo_training.draft_model import ttt_logits
from bench.demo_training.generations import aux_features, greedy_generations
from pipespec.engine.draft.model import Eagle3Draft


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

    @classmethod
    def generate(cls, target: Any, prompts: torch.Tensor, new_tokens: int, k: int, aux_ids: Sequence[int],
                 batch: int) -> HeldOut:
        """The target's continuations of ``prompts``, long enough (``new_tokens + k - 1``) for a replay at ``k``."""
        seqs = greedy_generations(target, prompts, new_tokens + k - 1, batch, lambda _msg: None)
        return cls(seqs, aux_features(target, seqs, aux_ids, batch), int(prompts.shape[1]), new_tokens)


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
