"""When to speculate: the last stage's choice, per round, between drafting k tokens and plain decoding.

Speculative decoding wins when the tokens a verify step gains (the mean acceptance length τ) outweigh
what drafting and verifying ``k + 1`` positions cost over one plain step. That balance moves with the
batch: at concurrency 1 a decode step is weights- or launch-bound and verifying 4 positions costs
about as much as 1, while at large batches the step becomes compute-bound, the extra positions cost
almost their full price, and drafting loses (vLLM's ``speculative_disable_by_batch_size`` is a fixed
threshold for the same effect). ``--spec-policy adaptive`` measures instead of guessing:

* every published round is recorded with whether it speculated, the tokens it committed and the wall
  time since the previous published round (on the last stage, which sees the pipeline's throughput:
  with M micro-batches in flight the interval between its rounds is the pipeline's period). Rounds that
  prefilled a sequence are left out: their cost is the prompt, not the policy;
* it runs in *windows* of ``W`` measured rounds: one window speculating, one window plain, then the
  better mode (tokens per second) for ``exploit`` windows, then both are measured again, so a change of
  load (sequences finishing, new ones arriving) is noticed within a bounded number of rounds. While the
  same mode keeps winning, the exploit phase doubles (up to ``max_exploit`` windows), so probing the
  losing mode costs a few percent of the rounds, not a fixed quarter;
* it prefers speculating: plain decoding is chosen only when it was measured at least ``margin`` faster.

Outputs never depend on the choice: verification is exact either way (greedy; a round without drafts
is a plain step). While not speculating the draft still ingests the verified positions
(``Eagle3Draft.extend``), so the next speculative round drafts with its full context.

``--spec-policy always`` speculates every round (deterministic steps and traces: tests use it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["always", "adaptive"]
POLICIES: tuple[str, ...] = ("always", "adaptive")


@dataclass
class _Window:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SpecPolicy:
    """The per-round speculate-or-not decision of the last stage (see the module docstring)."""

    policy: Policy = "adaptive"
    window: int = 8
    exploit: int = 6
    max_exploit: int = 32
    margin: float = 0.03
    _mode: bool = True  # the mode being run now: True = speculate
    _phase: Literal["measure_spec", "measure_plain", "exploit"] = "measure_spec"
    _exploited: int = 0
    _exploit_windows: int = 0  # the current exploit length in windows (doubles while decisions repeat)
    _measured: dict[bool, _Window] = field(default_factory=lambda: {True: _Window(), False: _Window()})
    _last: float | None = None
    _last_best: bool = True
    _decided: tuple[float, float] = (0.0, 0.0)  # (speculate, plain) tokens/s behind the last decision
    switches: int = 0
    plain_rounds: int = 0
    spec_rounds: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown speculation policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.window < 1 or self.exploit < 0:
            raise ValueError(f"window must be >= 1 and exploit >= 0, got {self.window} and {self.exploit}")

    def speculate(self) -> bool:
        """Whether the round being planned now should carry drafts."""
        return True if self.policy == "always" else self._mode

    def record(self, speculated: bool, tokens: int, now: float, prefill: bool = False) -> None:
        """One published round: did it carry drafts, how many tokens it committed, when it was published
        (``time.perf_counter()``), and whether it prefilled any sequence (then it is not measured)."""
        last, self._last = self._last, now
        if speculated:
            self.spec_rounds += 1
        else:
            self.plain_rounds += 1
        if self.policy == "always" or last is None or prefill or tokens <= 0:
            return
        if self._phase == "exploit":
            self._exploited += 1
            if self._exploited >= self._exploit_windows * self.window:
                self._start_measuring()
            return
        if speculated != self._mode:
            return  # a round launched before the last switch: it belongs to the other mode
        w = self._measured[speculated]
        w.tokens, w.seconds, w.rounds = w.tokens + tokens, w.seconds + (now - last), w.rounds + 1
        if w.rounds < self.window:
            return
        if self._phase == "measure_spec":
            self._phase, self._mode = "measure_plain", False
            self.switches += 1
            return
        spec, plain = self._measured[True].rate, self._measured[False].rate
        self._decided = (spec, plain)
        best = not plain > spec * (1 + self.margin)
        if best != self._mode:
            self.switches += 1
        repeated = self._exploit_windows and best == self._last_best
        self._exploit_windows = min(2 * self._exploit_windows, self.max_exploit) if repeated else self.exploit
        self._mode, self._phase, self._exploited, self._last_best = best, "exploit", 0, best

    def _start_measuring(self) -> None:
        self._measured = {True: _Window(), False: _Window()}
        if not self._mode:
            self.switches += 1
        self._mode, self._phase = True, "measure_spec"

    def rates(self) -> dict[str, float]:
        """The tokens/s of each mode behind the last decision (0.0 before the first one)."""
        return {"speculate": round(self._decided[0], 2), "plain": round(self._decided[1], 2)}
