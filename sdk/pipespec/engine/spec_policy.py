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
* it runs in *windows* of ``W`` measured rounds: one window of the mode it runs now, one of the other
  (after a switch it skips the rounds still in flight from the old mode), then the faster mode (tokens
  per second) runs for ``exploit`` times the seconds the slower one cost in that cycle, then both are
  measured again. While the same mode keeps winning, that factor doubles (up to ``max_exploit``), so
  probing the losing mode costs at most 1/7 of the time at first, then a few percent;
* a third window of the first mode brackets the other's unless the two already differ by ``clear``;
  at a run's first decision a switch to plain decoding by less than ``clear``² waits for it anyway
  (``_bracket_first_switch``: a stall in the run's first drafting window once sent a whole run to plain
  decoding);
* a change of load by ``load_ratio`` (2x) or more since the cycle began — the number of running
  sequences, when the engine passes it: sequences finishing, new ones arriving — is looked at again at
  once: rates measured with 8 sequences say little about 2 (on 2x H200 the sequences left at the end of
  a fixed batch were the ones drafting accepted least, and the winner at full load was the loser for
  them). But what was measured is not thrown away: every cycle that measured both modes leaves, keyed
  by its load, the *round-cost ratio* ρ — a drafting round's seconds per row over a plain round's. Drafting
  beats plain decoding exactly when its acceptance τ (tokens per row and round) exceeds ρ, and ρ does
  not grow as the rows shrink (fewer rows make the k + 1 verified positions cheaper relative to one,
  never dearer: a forward moves from compute- towards weights- and launch-bound). So while drafting is
  the standing winner and the load moves to one at or below a load measured before, the policy only
  measures drafting's τ there (drafting runs anyway) and keeps drafting, without a plain round, while
  τ beats the ρ carried from the nearest measured load at or above it by ``margin``; only a τ that
  falls short (within ``bound_windows`` pooled windows) sends it to measure plain decoding at the new
  load. τ must also beat drafting's round time now over a plain round's at the carried load (a plain
  round does not get dearer as rows leave, whatever a drafting round does): on one H200 at c = 32 a
  drafting round cost 4.5 ms at 32 rows and 6.3-7.1 ms in the tail, against ~3 ms plain at any load, and
  the ratio carried from full load (1.3) kept drafting through a tail that plain decoding won. Before
  this, a fixed batch's tail (8 -> 4 -> 2 -> 1 running sequences) measured plain decoding at every
  halving — 19 plain rounds and 6 switches in a 153-round run at c = 8 on one H200, where drafting won
  by 1.2x, and adaptive lost 11 % to ``always``. The periodic re-measuring stays, so a
  wrong ρ bound costs at most one exploit period;
* with no request waiting for a slot (a fixed batch, or the end of a queue), what counts is when the
  batch finishes, not the tokens of a round: plain decoding gives every row a token a round, drafting
  gives each row its own acceptance, and the row with the most rounds still to run sets the finish. So
  drafting's figure is scaled by that row's recent tokens per drafting round over the window's mean
  (``finish_scale``; the engine passes every row's tokens left), each row's figure shrunk towards the
  mean by how much of its spread is noise (``row_acceptance``: the slowest of 32 noisy means is biased low). On one H200 at c = 32 drafting committed
  2.2 tokens per row and round at full load (1.7x plain decoding's tokens/s), yet the batch finished
  later than with plain decoding: the rows it left behind accepted 1.1-1.4 a round;
* the first ``warmup`` rounds after the start are not measured: a fresh stage's first decode rounds
  pay one-time costs (first-touch memory, allocator growth; 1.6x a steady round on the 2-core CPU
  machine for its first 5 rounds), and a first window measured on them made drafting look 2.6x
  slower than it was there;
* it prefers speculating: plain decoding is chosen only when it was measured at least ``margin`` faster;
* a block of plain decoding measured while drafting stands (or before the first decision) starts as a
  *probe*: ``probe_rounds`` (1) rounds are launched without drafts and drafting resumes on the next
  round at once, before the plain round has landed, so the pipeline's rounds in flight carry drafts
  again and the probe costs its own round only. That round is measured net of the draft's catch-up it
  carries (the resumed draft ingests the verified positions it missed): on the 2-core CPU at c = 8 such
  a round's interval less the draft's seconds was 5.3-6.9 ms against 5.1-7.5 ms for the plain rounds
  without it in the same runs. When drafting's window beats even plain decoding's fastest round by
  ``margin`` the block ends there; otherwise plain decoding is switched to for real and the block runs
  its window. Before, a probe that was clear at once still ran the rounds in flight without drafts: on
  the 2-core CPU at c = 8 (2 micro-batches) each probe cost 4 plain rounds (1 settling, 1 measured, 2
  in flight carrying the draft's catch-up), ~3.5 % of a 63-round run, the whole margin of the policy;
* a probe's round shows only the last stage's share of a plain round (the first stage ran its share while
  the last one still drafted), so plain decoding is never switched to on a probe's rounds alone: a plain
  block proper confirms it first. While plain decoding is exploited its rounds are measured for free, and
  two windows of them slower than the drafting figure it was chosen over measure both modes again at once;
* near the end of a fixed batch (no request waiting) the periodic re-measure is skipped when the batch
  would end before the exploit period after it could run (``_batch_seconds_left``): the probe would
  cost more than the share of time the policy allows itself, for a switch that could pay only for the
  rounds left; the load checks still look at the tail;
* it does not run plain decoding to learn what it already knows: a speculative window also records
  how many sequences it verified and how long the draft took, which gives an *estimate* of plain
  decoding's best rate: one token per sequence in the round time less the draft's. It is not a true
  bound: a round without drafts also saves other work (verifying 1 position instead of k + 1, no holes
  to mask, crop or compact, a shorter wait for the other stages); on 2x H200 with CUDA graphs plain
  decoding reached 1.9x the estimate at c = 8 and 1.1x at c = 1. So plain decoding is skipped only
  when drafting beats the estimate by ``bound_slack`` (2.5x) — the usual case at low concurrency (3x
  measured at c = 1) — and drafting is simply measured again, window after window;
* drafting's figure is its window pooled with the drafting rounds just before it at the same load
  (``bound_windows`` windows' worth, measured or not: drafting runs anyway, so they cost nothing): at
  c = 1 a 4-round window swings with acceptance (4, 4, 1, 1 ...), and on one H200 a single window of
  low acceptance sent the policy to measure plain decoding for ~5 % of the run;

Outputs never depend on the choice: verification is exact either way (greedy; a round without drafts
is a plain step). While not speculating, the engine keeps the verified positions' aux states and
tokens and lets the draft ingest them (``Eagle3Draft.extend``, one pass) just before it drafts again,
so a plain round costs what ``--num-spec-tokens 0`` costs and drafting resumes with its full context.

``--spec-policy always`` speculates every round (deterministic steps and traces: tests use it).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["always", "adaptive"]
POLICIES: tuple[str, ...] = ("always", "adaptive")
TRACE_DECISIONS = 64  # decisions kept in the trace (the count of all of them is kept too)
ROW_DECAY = 0.9  # a row's tokens per drafting round: a decayed mean over its last ~10 drafting rounds
TRACE_ROUNDS = 512  # per-round costs kept in the trace: [speculated, tokens, ms since the last round, rows, draft ms, load, prefill]


@dataclass
class _Window:
    """The measured rounds of one mode in the current cycle."""

    tokens: int = 0
    rows: int = 0  # sequences verified (a plain round commits exactly one token per row)
    draft_seconds: float = 0.0
    intervals: list[float] = field(default_factory=list)
    peak: float = 0.0  # the fastest measured round's tokens/s

    @property
    def rounds(self) -> int:
        return len(self.intervals)

    @property
    def seconds(self) -> float:
        """The window's time with every interval at the median: one round stalled by another process on
        a shared machine (or a collective's jitter) moves a sum of four intervals by its whole stall, the
        median not at all."""
        return statistics.median(self.intervals) * self.rounds if self.intervals else 0.0

    @property
    def rate(self) -> float:
        seconds = self.seconds
        return self.tokens / seconds if seconds > 0 else 0.0

    @classmethod
    def of(cls, rounds: deque[tuple[int, int, float, float]]) -> _Window:
        """A window of ``rounds`` (tokens, rows, draft seconds, interval)."""
        return cls(sum(r[0] for r in rounds), sum(r[1] for r in rounds), sum(r[2] for r in rounds),
                   [r[3] for r in rounds])

    @property
    def plain_bound(self) -> float:
        """Of a speculative window: plain decoding's estimated best tokens/s on the same rounds — one token
        per row, in the round time less the draft's."""
        rest = self.seconds - self.draft_seconds
        return self.rows / rest if rest > 0 else float("inf")


@dataclass
class SpecPolicy:
    """The per-round speculate-or-not decision of the last stage (see the module docstring).

    ``window``: measured rounds per mode and cycle; ``settle``: rounds skipped after a switch (the pipeline
    still holds rounds of the old mode: pass the number of micro-batches); ``probe_loss``: the share of
    throughput the measuring of the losing mode may cost — the winner runs for ``gap / probe_loss`` times
    the seconds the loser cost in the cycle (``gap`` = 1 − loser ÷ winner), at least ``exploit`` and at
    most ``max_exploit`` times, and at least twice as long as in the previous cycle while the same mode
    keeps winning; ``margin``: how much faster the other mode must be to be switched to (hysteresis; the
    first decision prefers speculating); ``bound_slack``: how far drafting must beat plain decoding's
    estimated best rate for plain decoding not to be measured at all, ``few_rows_slack`` when a round
    verifies ``few_rows`` sequences or fewer on average (there a verify forward is bound by launches or
    by reading the weights, and the estimate is close: plain decoding reached 1.1x it at c = 1 on 2x H200
    with CUDA graphs, 1.9x at c = 8); ``bound_windows``: how many windows of drafting are pooled before
    the estimate is given up on and plain decoding is measured (while drafting is ahead of the estimate
    at all, at ``few_rows`` rows a round or fewer, and plain decoding is unmeasured in the cycle: on one
    H200 at c = 1 single 4-round windows fell below 1.5x it about once a run, and each time 6 plain rounds
    and a draft catch-up cost ~6 % of the run); ``probe_rounds``: the fewest measured rounds after which a block of
    plain decoding ends early while drafting stands, when even its fastest round loses by ``margin``
    (``_probe_lost``), and the plain rounds a probe launches before drafting resumes; ``in_flight``: the
    rounds in flight at once (the micro-batches): a probe whose plain rounds have not all landed after
    that many rounds with drafts (a micro-batch that emptied) becomes a plain block proper;
    ``load_ratio``: the change in
    running sequences (either way) that restarts the measuring, or, while drafting wins and a ratio
    measured at a load at or above the new one is known, checks drafting's acceptance against it
    (``load_checks`` counts the changes settled so, without a plain round); ``warmup``: rounds left
    unmeasured at the start (the worker passes a few per micro-batch).
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
    switches: int = 0
    plain_rounds: int = 0
    spec_rounds: int = 0
    load_changes: int = 0
    load_checks: int = 0
    _mode: bool = True  # the mode being run now: True = speculate
    _measuring: list[bool] = field(default_factory=lambda: [True, False, True])  # blocks still to measure, in order
    _skip: int = 0  # rounds still to skip after a switch
    _probe_turns: int | None = None  # in a probe: plain rounds still to launch before drafting resumes
    _probe_drafted: int = 0  # in a probe: rounds with drafts landed since its last plain round was launched
    _probe_measured: int = 0  # plain rounds of this cycle's window that a probe measured
    _plain_recent: list[float] = field(default_factory=list)  # exploiting plain decoding: its last rounds' seconds
    _exploit_until: float = 0.0
    _factor: float = 0.0
    _probe_cost: float = 0.0  # the loser's seconds in the last decided cycle (what the next probe costs)
    _measured: dict[bool, _Window] = field(default_factory=lambda: {True: _Window(), False: _Window()})
    _spent: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # seconds per mode, this cycle
    _start: float | None = None
    _last: float | None = None
    _best: bool | None = None  # the last cycle's winner (None before the first decision)
    _decided: tuple[float, float] = (0.0, 0.0)  # (speculate, plain) tokens/s behind the last decision
    _plain_bounded: bool = False  # the plain figure is the bound, not a measurement
    _load: int | None = None  # running sequences when the current cycle started (None: not given)
    _rounds: int = 0
    _block: int = 0  # rounds measured in the current block
    _decisions: list[dict[str, Any]] = field(default_factory=list)
    _decision_count: int = 0
    _round_costs: list[list[float]] = field(default_factory=list)
    _exploit_s: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # seconds outside measuring
    _ratios: dict[int, float] = field(default_factory=dict)  # load -> drafting's ÷ plain's seconds per row and round
    _plain_round: dict[int, float] = field(default_factory=dict)  # load -> a plain round's seconds measured there
    _check: tuple[float, int] | None = None  # (ratio, the load it was measured at) a load change is checked against
    _resume_until: float = 0.0  # the exploit period a load check resumes when it passes
    _recent: deque[tuple[int, int, float, float]] = field(default_factory=deque)  # the last drafting rounds at this load
    _row_left: dict[int, int] = field(default_factory=dict)  # request -> new tokens it may still get
    # request -> decayed [tokens, tokens squared, rounds] of its drafting rounds (updated in place)
    _row_drafted: dict[int, list[float]] = field(default_factory=dict)
    _queued: int | None = None  # requests waiting for a slot (None: not given)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown speculation policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.load_ratio <= 1:
            raise ValueError(f"load_ratio must be > 1, got {self.load_ratio}")
        if self.bound_slack < 1 or self.few_rows_slack < 1:
            raise ValueError(f"bound_slack must be >= 1, got {self.bound_slack} (few_rows_slack {self.few_rows_slack})")
        if self.bound_windows < 1:
            raise ValueError(f"bound_windows must be >= 1, got {self.bound_windows}")
        if self.probe_rounds < 1 or self.in_flight < 1:
            raise ValueError(f"probe_rounds and in_flight must be >= 1, got {self.probe_rounds} and {self.in_flight}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not 0 < self.probe_loss < 1:
            raise ValueError(f"probe_loss must be in (0, 1), got {self.probe_loss}")
        self._skip = self.warmup
        if self.clear <= 1:
            raise ValueError(f"clear must be > 1, got {self.clear}")
        if self.window < 1 or self.settle < 0 or self.exploit <= 0 or self.max_exploit < self.exploit:
            raise ValueError(f"window must be >= 1, settle >= 0 and 0 < exploit <= max_exploit, got {self.window}, "
                             f"{self.settle}, {self.exploit} and {self.max_exploit}")

    def speculate(self) -> bool:
        """Whether the round being planned now should carry drafts (call it once per launched round: in a
        probe it counts the plain rounds launched)."""
        if self.policy == "always":
            return True
        if self._probe_turns is None:
            return self._mode
        if self._probe_turns > 0:
            self._probe_turns -= 1
            self._probe_drafted = 0
            return False
        return True  # the probe's plain rounds are launched: drafting resumes before they land

    def _switch(self, mode: bool, probe: bool = True) -> None:
        if mode != self._mode:
            self.switches += 1
            self._skip = self.settle
            self._block = 0
        self._mode = mode
        self._probe_turns = None
        if probe and not mode and self._best is not False:
            # A block of plain decoding while drafting stands (or before the first decision): a probe.
            # Its rounds are measured net of the draft's catch-up they carry, so none is skipped.
            self._probe_turns, self._probe_drafted, self._skip = self.probe_rounds, 0, 0

    def _end_probe(self) -> None:
        """The probe did not settle it: plain decoding runs for real for the rest of the block (the rounds
        with drafts still in flight are the old mode's, and one more settles)."""
        self._probe_turns, self._skip = None, self.settle

    def _note(self, now: float, reason: str, **rates: float) -> None:
        """One entry of the decision trace: what runs from now on and why."""
        self._decision_count += 1
        if len(self._decisions) < TRACE_DECISIONS:
            at = now - self._start if self._start is not None else 0.0
            self._decisions.append({"round": self._rounds, "at_s": round(at, 4),
                                    "mode": "speculate" if self._mode else "plain", "reason": reason,
                                    **{k: round(v, 2) for k, v in rates.items()}})

    def record(self, speculated: bool, tokens: int, now: float, prefill: bool = False, rows: int = 0,
               draft_seconds: float = 0.0, load: int | None = None,
               per_row: Sequence[tuple[int, int, int]] | None = None, queued: int | None = None) -> None:
        """One published round: did it carry drafts, how many tokens it committed, when it was published
        (``time.perf_counter()``), whether it prefilled any sequence (then it is not measured), how many
        sequences it verified and the seconds the draft took in it (both optional: without them plain
        decoding is always measured, never bounded), and the running sequences now (``load``, optional:
        a change restarts the measuring). ``per_row`` (optional): (request, tokens committed, new tokens it
        may still get) of every verified row, and ``queued`` the requests waiting for a slot: with no
        request waiting, the modes are compared by when the batch would finish (``finish_scale``)."""
        if per_row is not None and self.policy != "always":  # ``always`` decides nothing from them
            self._track_rows(speculated and not prefill, per_row)
        if queued is not None:
            self._queued = queued
        last, self._last = self._last, now
        self._rounds += 1
        if len(self._round_costs) < TRACE_ROUNDS:
            self._round_costs.append([int(speculated), tokens, round((now - last) * 1e3, 3) if last is not None else 0.0,
                                      rows, round(draft_seconds * 1e3, 3), -1 if load is None else load, int(prefill)])
        if self._start is None:
            self._start = now
        if speculated:
            self.spec_rounds += 1
        else:
            self.plain_rounds += 1
        if self.policy == "always" or last is None:
            self._load = load
            return
        if load is not None and (self._load is None or load * self.load_ratio <= self._load
                                 or load >= self._load * self.load_ratio):
            self._recent.clear()  # rounds at another load say little about this one
            if self._load is not None:
                self.load_changes += 1
                carried = self.carried_ratio(load)
                if carried is not None and self._mode and self._best is True:
                    self._start_check(now, self._load, load, carried)
                else:
                    self._start_measuring()
                    self._note(now, f"load {self._load} -> {load} running sequences: measuring again")
            self._load = load
            return
        # A plain round is measured net of the draft work it carried (in a probe, the resumed draft's
        # catch-up): what a round without drafts costs.
        interval = now - last if speculated else max(now - last - draft_seconds, 1e-9)
        if not self._measuring:  # exploiting the winner
            self._exploit_s[speculated] += now - last
            if speculated and self._mode and not prefill and tokens > 0:  # measured for free: drafting runs anyway
                self._remember(tokens, rows, draft_seconds, interval)
            if (not speculated and not self._mode and not prefill and tokens > 0
                    and self._plain_slower(now, tokens, interval)):
                return
            if now >= self._exploit_until:
                # The batch's time left against the period a probe now would buy if the winner stands again
                # (no probe cost yet, as while drafting beats plain decoding's estimate: nothing to weigh).
                left = self._batch_seconds_left() if self._probe_cost > 0 else None
                if left is not None and left < self._doubled_factor() * self._probe_cost:
                    self._exploit_until = now + left  # looked at again then (or at the next load change)
                    self._note(now, "the batch ends before another probe could pay: not measuring again",
                               seconds_left=round(left, 4), probe_s=round(self._probe_cost, 4))
                else:
                    self._start_measuring()
            return
        self._spent[speculated] += now - last  # every round of the cycle, measured or not
        if prefill or tokens <= 0:
            return
        if speculated != self._mode:
            # A round launched before the last switch (it belongs to the other mode), or in a probe one
            # launched after its plain rounds.
            if self._probe_turns == 0:
                self._probe_drafted += 1
                if self._probe_drafted > self.in_flight:
                    self._end_probe()  # its plain rounds did not land (an emptied micro-batch)
            return
        if self._skip:  # settling after a switch, or the warm-up
            self._skip -= 1
            return
        w = self._measured[speculated]
        w.tokens, w.rows, w.draft_seconds = w.tokens + tokens, w.rows + rows, w.draft_seconds + draft_seconds
        if speculated:
            self._remember(tokens, rows, draft_seconds, interval)
        w.intervals.append(interval)
        w.peak = max(w.peak, tokens / interval) if interval > 0 else w.peak
        if self._probe_turns is not None and not speculated:
            self._probe_measured += 1
        self._block += 1
        if self._block < self.window and not self._probe_lost(speculated):
            if self._probe_turns == 0 and self._block >= self.probe_rounds:
                self._end_probe()  # not clear from the probe: the block runs its window
            return
        self._block = 0
        self._measuring.pop(0)
        spec, plain = self._measured[True], self._measured[False]
        if self._check is not None and speculated:
            if not self._checked(now, spec):
                # The check failed: plain decoding is measured now. Not the estimate's "ahead of plain
                # decoding's best, pool another window" below: the check already judged drafting against a
                # plain round actually measured (on the 2-core CPU at c = 8 that branch kept drafting through
                # a tail of 4 rows that plain decoding won, 17 rounds until the batch ended).
                self._switch(self._measuring[0])
            return
        few = spec.rows <= self.few_rows * spec.rounds
        slack = self.few_rows_slack if few else self.bound_slack
        # Drafting's figure: this cycle's window pooled with the drafting rounds just before it at this load
        # (``bound_windows`` windows' worth): at few rows one 4-round window swings with acceptance. With no
        # request waiting it is scaled to what it does for the batch's finish (``finish_scale``).
        bounded, scale, spec_rate = self._drafting_figure(spec)
        if speculated and self._measuring and w.rows and spec_rate > bounded.plain_bound * slack:
            # Drafting beats plain decoding's estimated best by far: no need to run plain to know.
            if not self._plain_bounded or self._best is not True:  # a new reason: into the trace
                self._note(now, f"drafting beats plain decoding's estimated best by {slack:g}x or more: plain not run",
                           speculate_tps=spec_rate, plain_estimate_tps=bounded.plain_bound, finish_scale=scale)
            self._decided, self._plain_bounded = (spec_rate, bounded.plain_bound), True
            self._best, self._measuring, self._exploit_until = True, [], now  # keep measuring drafting
            return
        if (speculated and self._measuring and w.rows and few and not plain.rounds
                and spec.rounds < self.bound_windows * self.window and spec.rate * scale > spec.plain_bound):
            # Ahead of the estimate but not yet by the slack: at few rows a 4-round window swings with
            # acceptance (2, 1, 1, 4 tokens) — measure drafting longer before paying plain rounds to know.
            # Not with more rows (a window then averages dozens of rows' acceptance, and on the CPU at 8 rows
            # plain decoding ran 1.7x its estimate, so pooling only delayed measuring it by 12 drafting
            # rounds), nor once plain decoding was measured in this cycle: the estimate stands in for that.
            self._measuring.insert(0, True)
            return
        if (self._measuring and spec.rounds and plain.rounds and self._clear(spec_rate, plain.rate)
                and not self._bracket_first_switch(spec_rate, plain.rate)):
            self._measuring = []  # one block of each already tells them apart: no bracketing block
        if self._measuring:
            self._switch(self._measuring[0])
            return
        self._decide(now, spec_rate if spec.rounds else spec.rate, plain.rate, scale)

    def _plain_slower(self, now: float, tokens: int, interval: float) -> bool:
        """Exploiting plain decoding, its rounds are measured for free: once two windows' worth of them run
        slower than the drafting figure it was chosen over, both are measured again at once (True) instead
        of at the end of the exploit period. What plain decoding was chosen on may have been a short block
        on a machine that slowed down since, or a probe's round, which sees the last stage's share of a
        plain round only: on the 2-core CPU at c = 32 a probe measured 7 ms where plain rounds then ran
        11-15 ms, and 141 of 168 rounds were decoded plainly where drafting was faster."""
        recent = self._plain_recent
        recent.append(interval)
        if len(recent) < 2 * self.window:  # two windows' median: single plain rounds swing 2-4x on a shared CPU
            return False
        rate = tokens / statistics.median(recent)  # a plain round commits one token per row, so ``tokens`` is the rows
        del recent[:]
        spec = self._decided[0]
        if spec <= 0 or rate * (1 + self.margin) >= spec:
            return False
        self._start_measuring()
        self._note(now, "plain decoding's rounds run slower than the drafting it was chosen over: measuring again",
                   plain_tps=rate, speculate_tps=spec)
        return True

    def _drafting_figure(self, spec: _Window) -> tuple[_Window, float, float]:
        """Drafting's figure for a decision: (the pooled window, its ``finish_scale``, its scaled tokens/s)."""
        bounded = _Window.of(self._recent) if len(self._recent) > spec.rounds else spec
        scale = self.finish_scale(bounded)
        return bounded, scale, bounded.rate * scale

    def _probe_lost(self, speculated: bool) -> bool:
        """Whether a block of plain decoding measured while drafting is the standing winner (or before the
        first decision) already loses: ``probe_rounds`` of it measured, and drafting's figure of this cycle
        (a whole window, pooled and finish-scaled as for a decision) beats even plain decoding's fastest
        round by ``margin``. The rest of the block would only confirm it, at plain decoding's price: on the
        2-core CPU at c = 8 (the demo pair, 2 micro-batches, 96 new tokens) the block cost 7 plain rounds
        of a 64-round run — 1 settling, 4 measured, 2 in flight — ~3.5 % against ``always``, where every
        single plain round lost to drafting's window by 1.2x or more. A plain round commits one token per
        row, so only its time is noisy, and judging by the fastest round keeps a stalled one from deciding;
        a drafting block is never cut short (its tokens swing with acceptance round to round). A shorter
        block also shortens the exploit period that follows (it scales with what the loser cost), so a
        wrong early stop is found again as soon."""
        if speculated or self._best is False or self._block < self.probe_rounds:
            return False
        drafting = self._measured[True]
        if drafting.rounds < self.window:
            return False
        return self._drafting_figure(drafting)[2] >= self._measured[False].peak * (1 + self.margin)

    def _track_rows(self, drafted: bool, per_row: Sequence[tuple[int, int, int]]) -> None:
        """Each row's new tokens still to come, and (drafting rounds) its recent tokens per round. Runs every
        round for every row (the policy's largest per-round cost at 32 rows), so the stats are updated in
        place, with no new objects."""
        row_left, row_drafted = self._row_left, self._row_drafted
        for request, tokens, left in per_row:
            if left <= 0:
                row_left.pop(request, None)
                row_drafted.pop(request, None)
                continue
            row_left[request] = left
            if drafted and tokens > 0:
                stats = row_drafted.get(request)
                if stats is None:
                    row_drafted[request] = [float(tokens), float(tokens * tokens), 1.0]
                else:
                    stats[0] = ROW_DECAY * stats[0] + tokens
                    stats[1] = ROW_DECAY * stats[1] + tokens * tokens
                    stats[2] = ROW_DECAY * stats[2] + 1.0

    def _batch_seconds_left(self) -> float | None:
        """How long the batch still runs in the standing mode, with no request waiting for a slot: the row
        with the most rounds still to run (its tokens left, ÷ its acceptance while drafting) times that
        mode's measured round; None while requests wait (or the rows are not given).

        A periodic re-measure costs about what the loser cost in the last cycle, and the exploit period
        after it is ``factor`` times that (doubled while the same mode wins): the policy's budget for
        probing is that share of the time. When the batch ends sooner than that next period could run,
        the probe would spend more than that share on a switch that could pay only for the rounds left;
        the load checks still look at the tail (on the 2-core CPU at c = 32 a second probe came 24 rounds
        before a 76-round batch ended: 4 plain rounds, ~2 % of the run, where drafting had won by 1.24x)."""
        w = self._measured[self._mode]
        if self._queued != 0 or not self._row_left or not w.rounds or not w.rows:
            return None
        rounds = self._drafting_rounds_left(w.tokens / w.rows) if self._mode else float(max(self._row_left.values()))
        return rounds * w.seconds / w.rounds

    def _drafting_rounds_left(self, tau: float) -> float:
        """Drafting rounds until the last running row finishes: the most, over the rows, of its tokens left ÷
        its acceptance (``row_acceptance``, ``tau`` for a row not measured yet)."""
        estimate = self.row_acceptance(tau)
        return max(left / estimate.get(request, tau) for request, left in self._row_left.items())

    def finish_scale(self, spec: _Window) -> float:
        """What drafting's tokens/s is worth for the batch's finish, as a factor on it: 1 while requests
        wait for a slot (then throughput is what counts: a finished row takes the next request), and else
        τ_b ÷ τ, where τ is the window's tokens per row and round and τ_b the acceptance of the row that sets
        the finish (the most rounds still to run: new tokens left ÷ its acceptance, ``row_acceptance``).

        Plain decoding gives every row one token a round, so its finish is the longest row's tokens left
        times a plain round; drafting's is that row's rounds times a drafting round. On one H200 at c = 32
        drafting committed 2.2 tokens per row and round at full load, for 1.7x plain decoding's tokens/s,
        but the rows it left behind accepted 1.1-1.4 a round, and the batch finished later than with plain
        decoding (193 rounds of 3.7 ms on average against 256 of 2.6 ms)."""
        if self._queued != 0 or len(self._row_left) < 2 or not spec.rows:
            return 1.0
        tau = spec.tokens / spec.rows
        longest = max(self._row_left.values())
        rounds = self._drafting_rounds_left(tau)
        return (longest / rounds) / tau if rounds > 0 else 1.0

    def row_acceptance(self, tau: float) -> dict[int, float]:
        """Each running row's tokens per drafting round, its own decayed mean shrunk towards ``tau`` by how
        much of its spread from ``tau`` is noise (empirical Bayes, as James-Stein): the rows' means spread by
        the between-row variance plus each one's sampling variance (within-row variance ÷ its rounds), so the
        between-row part is what is left of the observed spread after the sampling part, and a row keeps the
        share of its deviation that the between-row variance makes of its total.

        The row that sets the finish is the one with the lowest estimate, and a minimum over noisy means is
        biased low: on the 2-core CPU at c = 32 (the demo pair, ~3.1 tokens per row and round, every row
        alike) each row had ~6 drafting rounds at the first decision, the slowest raw mean (shrunk by one
        round) said 0.55 of τ, and plain decoding was chosen where drafting was 1.27x faster. Rows that
        really differ keep their difference: a row accepting 1 token every round has no within-row spread."""
        stats = {request: self._row_drafted[request] for request in self._row_left if request in self._row_drafted}
        if not stats:
            return {}
        within_sum = sum(squares - got * got / n for got, squares, n in stats.values() if n > 0)
        within_dof = sum(n - 1.0 for _, _, n in stats.values() if n > 1.0)
        within = max(within_sum, 0.0) / within_dof if within_dof > 0 else 0.0
        means = {request: got / n for request, (got, _, n) in stats.items()}
        spread = sum((m - tau) ** 2 for m in means.values()) / len(means)
        noise = sum(within / n for _, _, n in stats.values()) / len(stats)
        between = max(spread - noise, 0.0)
        shrunk = {}
        for request, (_, _, n) in stats.items():
            keep = between / (between + within / n) if between + within / n > 0 else 1.0
            shrunk[request] = max(1.0, tau + keep * (means[request] - tau))  # a drafting round commits >= 1
        return shrunk

    def _remember(self, tokens: int, rows: int, draft_seconds: float, interval: float) -> None:
        """Keep the last ``bound_windows`` windows' worth of drafting rounds at this load (measured or not),
        so that a window of low acceptance is judged against plain decoding's estimate together with them."""
        self._recent.append((tokens, rows, draft_seconds, interval))
        while len(self._recent) > self.bound_windows * self.window:
            self._recent.popleft()

    def carried_ratio(self, load: int) -> tuple[float, int] | None:
        """The round-cost ratio ρ measured at the smallest load at or above ``load`` (an upper bound on ρ
        at ``load``: it does not grow as the rows shrink), and that load; None when none was measured."""
        above = [measured for measured in self._ratios if measured >= load]
        if not above:
            return None
        at = min(above)
        return self._ratios[at], at

    def _start_check(self, now: float, old: int, load: int, carried: tuple[float, int]) -> None:
        """The load moved while drafting wins: measure drafting alone at the new load, and keep it (and the
        exploit period that was running) while its acceptance beats the carried ratio."""
        self._resume_until = self._exploit_until
        self._start_measuring()
        self._measuring = [True]
        self._check = carried
        self._note(now, f"load {old} -> {load} running sequences: checking drafting's acceptance against the "
                        f"round-cost ratio {carried[0]:.2f} measured at load {carried[1]}")

    def _checked(self, now: float, spec: _Window) -> bool:
        """A drafting window of a load check is complete: True when that settled it (drafting kept, or
        another window pooled), False when plain decoding has to be measured at the new load after all.

        Drafting is kept when its acceptance τ beats, by ``margin``, both the carried ratio ρ and the ratio
        of its round time *now* to a plain round's time at the carried load. The second holds without
        assuming anything of drafting's cost: a plain round with fewer rows costs at most what it cost
        with more, so plain decoding at the new load commits at least one token per row in that time.
        It is what catches a drafting round that got dearer as the rows left (on one H200 at c = 32:
        4.5 ms at 32 rows, 6.3-7.1 ms in the tail, against 2.9-3.4 ms plain at any load)."""
        assert self._check is not None
        ratio, at = self._check
        plain_round = self._plain_round.get(at)
        if plain_round and spec.rounds:
            ratio = max(ratio, (spec.seconds / spec.rounds) / plain_round)
        tau = spec.tokens / spec.rows * self.finish_scale(spec) if spec.rows else 0.0
        if tau >= ratio * (1 + self.margin):
            self._check = None
            self.load_checks += 1
            self._measuring, self._exploit_until = [], max(self._resume_until, now)
            self._note(now, f"drafting's acceptance beats the round-cost ratio measured at load {at}: plain not run",
                       tokens_per_row=tau, ratio=ratio, speculate_tps=spec.rate)
            return True
        if tau > ratio and spec.rounds < self.bound_windows * self.window:
            self._measuring.insert(0, True)  # ahead, but not by the margin yet: pool another window
            return True
        self._check = None
        self._measuring = [False, True]  # measure plain decoding at this load after all, then drafting again
        self._note(now, f"drafting's acceptance {tau:.2f} does not beat the round-cost ratio {ratio:.2f} "
                        f"(measured at load {at}, or its round now against a plain round there): measuring plain",
                   tokens_per_row=tau, ratio=ratio, speculate_tps=spec.rate)
        return False

    def _clear(self, spec: float, plain: float) -> bool:
        """Whether one block of each mode differs by ``clear`` or more (either way)."""
        low, high = sorted((spec, plain))
        return low <= 0 or high >= low * self.clear

    def _decide(self, now: float, spec: float, plain: float, scale: float = 1.0) -> None:
        """Both modes measured this cycle: run the faster for a time set by how much the slower costs, and
        keep the round-cost ratio for the load it was measured at."""
        measured_spec, measured_plain = self._measured[True], self._measured[False]
        current = self._standing()  # hysteresis: the standing winner keeps ties
        other = plain if current else spec
        mine = spec if current else plain
        best = (not current) if other > mine * (1 + self.margin) else current
        if not best and current and self._probe_measured >= measured_plain.rounds:
            # Plain decoding wins on a probe's rounds alone: a probe's round is the last stage's share of a
            # plain round less the draft's catch-up, not a pipeline settled into plain decoding (on the 2-core
            # CPU at c = 32 one measured 7 ms, the plain rounds after it 11-15). Measured on a plain block
            # proper before it is switched to (then decided on at once: drafting's figure stands).
            # Then drafting again: a switch is decided on drafting measured on both sides of plain decoding.
            self._measured[False], self._spent[False], self._probe_measured = _Window(), 0.0, 0
            self._measuring = [False, True]
            self._switch(False, probe=False)
            self._skip, self._block = self.settle, 0
            self._note(now, "plain decoding faster on a probe's round: measuring a plain block to confirm",
                       speculate_tps=spec, plain_tps=plain)
            return
        self._decided, self._plain_bounded = (spec, plain), False
        if self._load is not None and measured_spec.rows and measured_plain.rows and measured_plain.seconds > 0:
            self._ratios[self._load] = ((measured_spec.seconds / measured_spec.rows)
                                        / (measured_plain.seconds / measured_plain.rows))
            self._plain_round[self._load] = measured_plain.seconds / measured_plain.rounds
        winner, loser = (spec, plain) if best else (plain, spec)
        gap = 1.0 - loser / winner if winner > 0 else 0.0
        factor = max(self.exploit, gap / self.probe_loss)
        if self._best == best and self._factor:
            factor = max(factor, self._doubled_factor())  # the same winner again: probe half as often
        self._factor = min(factor, self.max_exploit)
        reason = ("drafting measured faster" if best else "plain decoding measured faster") + (
            "" if self._best is None or best == self._best else " (switched)")
        self._best = best
        if not best:
            self._recent.clear()  # drafting rounds from before a stretch of plain decoding: stale when it resumes
        # The loser's whole cost this cycle (settling rounds included) sets how long the winner runs.
        self._probe_cost = self._spent[not best]
        self._exploit_until = now + self._factor * self._probe_cost
        self._switch(best)
        self._note(now, reason, speculate_tps=spec, plain_tps=plain, exploit_factor=self._factor,
                   **({"finish_scale": scale} if scale != 1.0 else {}))

    def _bracket_first_switch(self, spec: float, plain: float) -> bool:
        """Whether the first decision, a switch to plain decoding by less than ``clear``² (1.69x), waits for
        the bracketing block of drafting although one block of each looks clear. The first decision sets the
        longest exploit period of a run with nothing to check it (a plain win is watched only against the
        drafting figure it was chosen over), and its drafting block is the run's earliest, when a stall hits
        hardest: on the 2-core CPU at c = 8 one first window of drafting ran 10-12 ms rounds (7.5 settled),
        plain decoding measured 1.54x faster than that, and 159 of the run's 174 rounds were decoded
        plainly where drafting was 1.4x faster. A wider gap is not a stall's doing, and a bracket there
        costs more (a window of a mode twice as slow): it is decided at once."""
        return self._best is None and plain > spec and plain < spec * self.clear ** 2

    def _standing(self) -> bool:
        """The mode a switch is measured against: the last cycle's winner, speculating before the first."""
        return True if self._best is None else self._best

    def _doubled_factor(self) -> float:
        """The exploit factor after another win of the same mode: twice the last one, within the bounds."""
        return min(max(self.exploit, 2 * self._factor), self.max_exploit)

    def _start_measuring(self) -> None:
        """A new measuring cycle: both modes measured afresh in blocks current, other, current — the other
        mode's block bracketed by two of the current one, so a machine that slows down or speeds up during
        the cycle (other processes on a shared CPU) moves both modes' figures alike."""
        if self._probe_turns is not None:  # a probe cut short: drafting, which stands, runs again
            self._probe_turns, self._mode = None, True
        self._measuring = [self._mode, not self._mode, self._mode]
        self._check = None
        self._probe_measured = 0
        self._plain_recent = []
        self._measured = {True: _Window(), False: _Window()}
        self._spent = {True: 0.0, False: 0.0}
        self._block = 0

    def rates(self) -> dict[str, float]:
        """The tokens/s of each mode behind the last decision (0.0 before the first one); ``plain_bound``
        says the plain figure is the upper bound from a speculative window, not a measurement."""
        return {"speculate": round(self._decided[0], 2), "plain": round(self._decided[1], 2),
                "plain_bound": self._plain_bounded}

    def trace(self) -> dict[str, Any]:
        """The decision trace for ``--json``: rounds per mode, switches, load changes (and how many of them
        a check of drafting's acceptance settled), the round-cost ratio per measured load, and each decision
        (round, seconds since the first round, the mode chosen, why, and the rates behind it)."""
        return {"spec_rounds": self.spec_rounds, "plain_rounds": self.plain_rounds, "switches": self.switches,
                "load_changes": self.load_changes, "load_checks": self.load_checks,
                "ratios": {str(load): round(r, 3) for load, r in sorted(self._ratios.items())},
                "decisions": self._decision_count,
                "exploit_s": {"speculate": round(self._exploit_s[True], 4), "plain": round(self._exploit_s[False], 4)},
                "trace": list(self._decisions), "rounds": list(self._round_costs)}
