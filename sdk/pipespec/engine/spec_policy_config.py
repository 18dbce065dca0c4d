"""The speculation policy's settings: fixed for a run, checked once, apart from the policy's running state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["always", "adaptive"]
POLICIES: tuple[str, ...] = ("always", "adaptive")


@dataclass(frozen=True)
class SpecPolicyConfig:
    """How ``SpecPolicy`` measures and decides (the defaults are the engine's; the worker passes ``settle``,
    ``in_flight`` and ``warmup`` for its micro-batches).

    ``window``: measured rounds per block of a mode in a measuring cycle.
    ``settle``: rounds skipped after a switch (the pipeline still holds rounds of the old mode).
    ``exploit``, ``max_exploit``, ``probe_loss``: the winner runs for ``gap / probe_loss`` times the seconds
    the loser cost in the cycle (``gap`` = 1 − loser ÷ winner), at least ``exploit`` and at most
    ``max_exploit`` times, and at least twice as long as in the previous cycle while the same mode keeps
    winning: measuring the loser costs about ``probe_loss`` of the throughput.
    ``margin``: how much faster the other mode must be to be switched to (hysteresis; before the first
    decision drafting stands).
    ``clear``: two blocks (one of each mode) that differ by this much decide without a bracketing block,
    except a first decision for plain decoding by less than ``clear``² (a stall in the run's first
    drafting block: on the 2-core CPU at c = 8 one sent 159 of a run's 174 rounds to plain decoding where
    drafting was 1.4x faster).
    ``bound_slack``: how far drafting must beat plain decoding's estimated best (one token per row in the
    round time less the draft's) for plain decoding not to be measured at all; ``few_rows_slack`` when a
    round verifies ``few_rows`` sequences or fewer on average (there a verify forward costs about what a
    plain one does: plain decoding reached 1.1x the estimate at c = 1 on 2x H200 with CUDA graphs, 1.9x
    at c = 8).
    ``bound_windows``: windows of drafting pooled into drafting's figure, and the most pooled before the
    estimate is given up on and plain decoding measured (at c = 1 on one H200 a single 4-round window
    swings with acceptance: 2, 1, 1, 4 tokens).
    ``probe_rounds``: the plain rounds a probe launches before drafting resumes, and the fewest measured
    rounds after which a plain block ends early when even its fastest round loses by ``margin``.
    ``in_flight``: rounds in flight at once (the micro-batches): a probe whose plain rounds have not landed
    after that many rounds with drafts (a micro-batch that emptied) becomes a plain block proper.
    ``load_ratio``: the change in running sequences (either way) that restarts the measuring, or, while
    drafting wins and a ratio measured at a load at or above the new one is known, checks drafting's
    acceptance against it.
    ``warmup``: rounds left unmeasured at the start (a fresh stage's first rounds pay one-time costs: 1.6x
    a steady round on the 2-core CPU for its first 5).
    """

    policy: Policy = "adaptive"
    window: int = 4
    settle: int = 1
    exploit: float = 4.0
    max_exploit: float = 64.0
    probe_loss: float = 0.01
    margin: float = 0.03
    clear: float = 1.3
    bound_slack: float = 2.5
    few_rows: int = 2
    few_rows_slack: float = 1.5
    bound_windows: int = 4
    probe_rounds: int = 1
    in_flight: int = 1
    load_ratio: float = 2.0
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown speculation policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.load_ratio <= 1:
            raise ValueError(f"load_ratio must be > 1, got {self.load_ratio}")
        if self.bound_slack < 1 or self.few_rows_slack < 1:
            raise ValueError(f"bound_slack must be >= 1, got {self.bound_slack} "
                             f"(few_rows_slack {self.few_rows_slack})")
        if self.bound_windows < 1:
            raise ValueError(f"bound_windows must be >= 1, got {self.bound_windows}")
        if self.probe_rounds < 1 or self.in_flight < 1:
            raise ValueError(f"probe_rounds and in_flight must be >= 1, got {self.probe_rounds} and "
                             f"{self.in_flight}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not 0 < self.probe_loss < 1:
            raise ValueError(f"probe_loss must be in (0, 1), got {self.probe_loss}")
        if self.clear <= 1:
            raise ValueError(f"clear must be > 1, got {self.clear}")
        if self.window < 1 or self.settle < 0 or self.exploit <= 0 or self.max_exploit < self.exploit:
            raise ValueError(f"window must be >= 1, settle >= 0 and 0 < exploit <= max_exploit, got "
                             f"{self.window}, {self.settle}, {self.exploit} and {self.max_exploit}")

    @property
    def pooled_rounds(self) -> int:
        """Drafting rounds pooled into drafting's figure (``bound_windows`` windows)."""
        return self.bound_windows * self.window
