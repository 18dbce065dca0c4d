"""The per-step broadcast: what the last stage tells every stage after each target forward.

One int64 message of fixed size ``2 + c·(3 + 2k + 1)`` for ``c`` sequences and ``k`` speculative tokens::

    [ step, c | seq 0: flags, accepted, kept, tokens[k+1], drafts[k] | seq 1: ... ]

* ``step`` — 0 for the prefill, then 1, 2, ...; every stage checks it against its own counter, so stages
  that fell out of step fail loudly instead of mixing sequences up;
* ``flags`` — bit 0: the sequence ran in this step; bit 1: it is finished (EOS or its token budget);
* ``accepted`` — ``a``, how many of the k drafts the target confirmed (0 at prefill);
* ``tokens`` — the ``a + 1`` tokens the step produced (the accepted drafts, then the target's bonus
  token; at prefill only the first sampled token), padded with -1;
* ``kept`` — how many of them count as output (fewer when EOS or ``max_new_tokens`` cut them);
* ``drafts`` — the draft's next k proposals (-1 when finished or k = 0).

Every stage updates its own copy of each sequence's state from this message: the committed length of
its KV cache (``+ a + 1`` per verify step, after cropping the rejected positions), the pending token
(the bonus) and the drafts — which is exactly what it needs to shape the next forward without asking
anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

RAN = 1
DONE = 2


def message_size(num_sequences: int, k: int) -> int:
    """Number of int64 values in one step message."""
    return 2 + num_sequences * (3 + 2 * k + 1)


@dataclass
class SeqUpdate:
    """One sequence's part of a step message."""

    ran: bool = False
    done: bool = False
    accepted: int = 0
    tokens: list[int] = field(default_factory=list)
    kept: int = 0
    drafts: list[int] = field(default_factory=list)


def encode(step: int, updates: Sequence[SeqUpdate], k: int) -> torch.Tensor:
    """Pack a step's updates (last stage)."""
    stride = 3 + 2 * k + 1
    out = torch.full((message_size(len(updates), k),), -1, dtype=torch.int64)
    out[0], out[1] = step, len(updates)
    for i, u in enumerate(updates):
        base = 2 + i * stride
        if len(u.tokens) > k + 1 or (u.drafts and len(u.drafts) != k):
            raise ValueError(f"sequence {i}: {len(u.tokens)} tokens / {len(u.drafts)} drafts do not fit k={k}")
        out[base] = (RAN if u.ran else 0) | (DONE if u.done else 0)
        out[base + 1] = u.accepted
        out[base + 2] = u.kept
        if u.tokens:
            out[base + 3 : base + 3 + len(u.tokens)] = torch.tensor(u.tokens, dtype=torch.int64)
        if u.drafts:
            out[base + 4 + k : base + 4 + 2 * k] = torch.tensor(u.drafts, dtype=torch.int64)
    return out


def decode(message: torch.Tensor, expected_step: int, num_sequences: int, k: int) -> list[SeqUpdate]:
    """Unpack a step message (every stage), checking that all stages are at the same step."""
    values = message.tolist()
    if values[0] != expected_step or values[1] != num_sequences:
        raise RuntimeError(
            f"step message says step {values[0]} for {values[1]} sequences, this stage expected step {expected_step} "
            f"for {num_sequences}: the stages are out of step"
        )
    stride = 3 + 2 * k + 1
    updates = []
    for i in range(num_sequences):
        base = 2 + i * stride
        flags, accepted, kept = values[base : base + 3]
        ran = bool(flags & RAN)
        n_tokens = accepted + 1 if ran else 0
        tokens = values[base + 3 : base + 3 + n_tokens]
        drafts = values[base + 4 + k : base + 4 + 2 * k]
        updates.append(SeqUpdate(
            ran=ran, done=bool(flags & DONE), accepted=accepted, tokens=tokens, kept=kept,
            drafts=drafts if ran and not flags & DONE and k > 0 else [],
        ))
    return updates
