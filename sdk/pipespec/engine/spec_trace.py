"""What the speculation policy reports under ``--json``: every round's costs and each decision with why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipespec.engine.spec_phase import Mode

TRACE_DECISIONS = 64  # decisions kept in the trace (the count of all of them is kept too)
# Per-round costs kept: [speculated, tokens, ms since the last round, rows, draft ms, load, prefill].
TRACE_ROUNDS = 512


@dataclass
class DecisionTrace:
    """The first ``TRACE_ROUNDS`` rounds' costs, the first ``TRACE_DECISIONS`` decisions (and how many there
    were), and the seconds spent exploiting each mode."""

    start: float | None = None  # when the first round was published
    decisions: list[dict[str, Any]] = field(default_factory=list)
    decision_count: int = 0
    rounds: list[list[float]] = field(default_factory=list)
    exploit_s: dict[Mode, float] = field(default_factory=lambda: {Mode.SPECULATE: 0.0, Mode.PLAIN: 0.0})

    def round(self, speculated: bool, tokens: int, now: float, last: float | None, rows: int,
              draft_seconds: float, load: int | None, prefill: bool) -> None:
        """One round, published at ``now`` (``last``: the previous one's time; None for the first)."""
        if self.start is None:
            self.start = now
        if len(self.rounds) < TRACE_ROUNDS:
            ms = round((now - last) * 1e3, 3) if last is not None else 0.0
            self.rounds.append([int(speculated), tokens, ms, rows, round(draft_seconds * 1e3, 3),
                                -1 if load is None else load, int(prefill)])

    def note(self, rounds: int, now: float, mode: Mode, reason: str, **rates: float) -> None:
        """One decision: after ``rounds`` rounds, ``mode`` runs from now on, for ``reason``, on ``rates``."""
        self.decision_count += 1
        if len(self.decisions) < TRACE_DECISIONS:
            at = now - self.start if self.start is not None else 0.0
            self.decisions.append({"round": rounds, "at_s": round(at, 4), "mode": mode.value,
                                   "reason": reason, **{k: round(v, 2) for k, v in rates.items()}})

    def exploit_seconds(self) -> dict[str, float]:
        return {mode.value: round(self.exploit_s[mode], 4) for mode in Mode}
