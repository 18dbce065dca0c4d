"""When to speculate: the last stage's choice, per round, between drafting k tokens and plain decoding.

Drafting wins when the tokens a verify step gains (the acceptance τ) outweigh what drafting and verifying
``k + 1`` positions cost over one plain step, and that balance moves with the batch: at concurrency 1 a
step is weights- or launch-bound and verifying 4 positions costs about as much as 1; at large batches it
is compute-bound and drafting loses (vLLM's ``speculative_disable_by_batch_size`` is a fixed threshold for
the same effect). ``--spec-policy adaptive`` measures instead, from what each round published on the last
stage (whose publish interval is the pipeline's period) exposes: the tokens it committed, the rows it
verified, the draft's seconds in it, the interval since the previous round, and optionally the running
sequences, the requests waiting and each row's tokens left. Rounds that prefilled are not measured.

``SpecPolicy`` is a state machine over ``spec_phase.Phase`` (its transitions are listed there): it
measures both modes in a cycle (``MEASURING``; a plain block while drafting stands starts as a probe,
whose plain rounds are launched while the rounds in flight keep their drafts), runs the faster for a
period set by what measuring the slower cost (``EXPLOITING``), and when the load moves while drafting
wins, checks drafting's acceptance against the round-cost ratio carried from a measured load
(``CHECKING``, ``spec_ratios``). With no request waiting for a slot, drafting's figure is scaled to what it
does for the batch's finish (``spec_rows``). Settings: ``SpecPolicyConfig``; the whole policy with its
measurements: docs/engine.md.

Outputs never depend on the choice: verification is exact either way (a round without drafts is a plain
step), and the draft ingests the positions verified while not speculating before it drafts again.
``--spec-policy always`` speculates every round (deterministic steps and traces: tests use it).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipespec.engine.spec_phase import Mode, Phase
from pipespec.engine.spec_policy_config import Policy, SpecPolicyConfig
from pipespec.engine.spec_ratios import LoadRatios
from pipespec.engine.spec_rows import BatchRows
from pipespec.engine.spec_trace import DecisionTrace

DraftingRound = tuple[int, int, float, float]  # tokens, rows, draft seconds, interval


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
    def of(cls, rounds: deque[DraftingRound]) -> _Window:
        """A window of ``rounds`` (tokens, rows, draft seconds, interval)."""
        return cls(sum(r[0] for r in rounds), sum(r[1] for r in rounds), sum(r[2] for r in rounds),
                   [r[3] for r in rounds])

    @property
    def plain_bound(self) -> float:
        """Of a speculative window: plain decoding's estimated best tokens/s on the same rounds — one token
        per row, in the round time less the draft's."""
        rest = self.seconds - self.draft_seconds
        return self.rows / rest if rest > 0 else float("inf")

    def add(self, tokens: int, rows: int, draft_seconds: float, interval: float) -> None:
        self.tokens, self.rows = self.tokens + tokens, self.rows + rows
        self.draft_seconds += draft_seconds
        self.intervals.append(interval)
        self.peak = max(self.peak, tokens / interval) if interval > 0 else self.peak


@dataclass
class _Cycle:
    """One measuring cycle: the blocks still to measure (in order), each mode's measured window, the seconds
    each mode cost in the cycle (every round, measured or not), the rounds measured in the current block,
    and the plain rounds of the window that a probe measured."""

    blocks: list[Mode]
    measured: dict[Mode, _Window] = field(default_factory=lambda: {mode: _Window() for mode in Mode})
    spent: dict[Mode, float] = field(default_factory=lambda: {mode: 0.0 for mode in Mode})
    block: int = 0
    probe_measured: int = 0

    @classmethod
    def bracketing(cls, mode: Mode) -> _Cycle:
        """A cycle measuring ``mode``, the other mode, then ``mode`` again: the other mode's block bracketed,
        so a machine that slows down or speeds up during the cycle moves both modes' figures alike."""
        return cls([mode, mode.other, mode])


@dataclass(frozen=True)
class _Round:
    """One published round as the policy reads it: ``elapsed`` since the previous one, ``interval`` the
    seconds it is measured by (a plain round's net of the draft work it carried)."""

    mode: Mode
    tokens: int
    now: float
    elapsed: float
    interval: float
    prefill: bool
    rows: int
    draft_seconds: float

    @property
    def counts(self) -> bool:
        """Whether it can be measured at all: committed tokens, and no prefill in it."""
        return not self.prefill and self.tokens > 0


class SpecPolicy:
    """The per-round speculate-or-not decision of the last stage (see the module docstring): ``speculate()``
    for each round launched, ``record(...)`` for each round published. Settings: ``SpecPolicyConfig``."""

    def __init__(self, policy: Policy = "adaptive", **settings: Any) -> None:
        self.config = SpecPolicyConfig(policy, **settings)
        self.spec_rounds = 0
        self.plain_rounds = 0
        self.switches = 0
        self.load_changes = 0
        self.load_checks = 0  # load changes settled by drafting's acceptance, without a plain round
        self._phase = Phase.ALWAYS if policy == "always" else Phase.STARTING
        self._mode = Mode.SPECULATE  # the mode being run now
        self._best: Mode | None = None  # the last cycle's winner (None before the first decision)
        self._skip = self.config.warmup  # measured rounds still to skip: the warm-up, then after each switch
        self._cycle = _Cycle.bracketing(Mode.SPECULATE)
        self._probe_turns = 0  # PROBE_LAUNCHING: plain rounds still to launch
        self._probe_drafted = 0  # PROBE_LANDING: rounds with drafts landed since its plain rounds launched
        self._check: tuple[float, int] | None = None  # CHECKING: (ratio ρ, the load it was measured at)
        self._resume_until = 0.0  # CHECKING: the exploit period that resumes when the check passes
        self._exploit_until = 0.0
        self._factor = 0.0
        self._probe_cost = 0.0  # the loser's seconds in the last decided cycle (what the next probe costs)
        self._plain_recent: list[float] = []  # exploiting plain decoding: its last rounds' intervals
        self._decided: tuple[float, float] = (0.0, 0.0)  # (speculate, plain) tokens/s of the last decision
        self._plain_bounded = False  # the plain figure is the estimate, not a measurement
        self._last: float | None = None  # when the last round was published
        self._load: int | None = None  # running sequences when the current cycle started (None: not given)
        self._queued: int | None = None  # requests waiting for a slot (None: not given)
        self._loads = LoadRatios()  # per measured load: the round-cost ratio, a plain round's seconds
        self._recent: deque[DraftingRound] = deque(maxlen=self.config.pooled_rounds)  # drafting at this load
        self._rows = BatchRows()
        self._trace = DecisionTrace()

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def window(self) -> int:
        return self.config.window

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def mode(self) -> Mode:
        """The mode being run now (in a probe: plain, though drafting resumes before its rounds land)."""
        return self._mode

    def speculate(self) -> bool:
        """Whether the round being planned now should carry drafts (call it once per launched round: a probe
        counts the plain rounds it launches)."""
        if self._phase is Phase.ALWAYS or self._phase is Phase.PROBE_LANDING:
            return True
        if self._phase is Phase.PROBE_LAUNCHING:
            self._probe_turns -= 1
            if self._probe_turns == 0:  # launched: drafting resumes before they land
                self._phase, self._probe_drafted = Phase.PROBE_LANDING, 0
            return False
        return self._mode.drafts

    def record(self, speculated: bool, tokens: int, now: float, prefill: bool = False, rows: int = 0,
               draft_seconds: float = 0.0, load: int | None = None,
               per_row: Sequence[tuple[int, int, int]] | None = None, queued: int | None = None) -> None:
        """One published round: did it carry drafts, how many tokens it committed, when it was published
        (``time.perf_counter()``), whether it prefilled any sequence (then it is not measured), how many
        sequences it verified and the seconds the draft took in it (both optional: without them plain
        decoding is always measured, never estimated), and the running sequences now (``load``, optional:
        a change restarts the measuring). ``per_row`` (optional): (request, tokens committed, new tokens it
        may still get) of every verified row, and ``queued`` the requests waiting for a slot: with no
        request waiting, the modes are compared by when the batch would finish (``finish_scale``)."""
        if per_row is not None and self._phase is not Phase.ALWAYS:  # ``always`` decides nothing from them
            self._track_rows(speculated and not prefill, per_row)
        if queued is not None:
            self._queued = queued
        last, self._last = self._last, now
        self._trace.round(speculated, tokens, now, last, rows, draft_seconds, load, prefill)
        if speculated:
            self.spec_rounds += 1
        else:
            self.plain_rounds += 1
        if last is None or self._phase is Phase.ALWAYS:  # the first round only starts the clock
            self._load = load
            if self._phase is Phase.STARTING:
                self._phase = Phase.MEASURING
            return
        if load is not None and self._load_moved(load):
            self._on_load_change(now, load)
            return
        # A plain round is measured net of the draft work it carried (in a probe, the resumed draft's
        # catch-up): what a round without drafts costs.
        elapsed = now - last
        interval = elapsed if speculated else max(elapsed - draft_seconds, 1e-9)
        r = _Round(Mode.of(speculated), tokens, now, elapsed, interval, prefill, rows, draft_seconds)
        if self._phase is Phase.EXPLOITING:
            self._on_exploiting(r)
        elif self._phase is Phase.CHECKING:
            self._on_checking(r)
        elif self._phase is Phase.PROBE_LANDING:
            self._on_probe_landing(r)
        else:  # MEASURING, PROBE_LAUNCHING
            self._on_measuring(r)

    def _on_load_change(self, now: float, load: int) -> None:
        """Any phase: the running sequences moved by ``load_ratio`` (or were given for the first time)."""
        self._recent.clear()  # rounds at another load say little about this one
        if self._load is not None:
            self.load_changes += 1
            carried = self.carried_ratio(load)
            if carried is not None and self._mode is Mode.SPECULATE and self._best is Mode.SPECULATE:
                self._start_check(now, self._load, load, carried)
            else:
                self._start_measuring()
                self._note(now, f"load {self._load} -> {load} running sequences: measuring again")
        self._load = load

    def _on_exploiting(self, r: _Round) -> None:
        """The winner runs: drafting's rounds are pooled, plain decoding's watched; at the end of the exploit
        period both modes are measured again (unless the batch ends before that could pay)."""
        self._trace.exploit_s[r.mode] += r.elapsed
        if r.mode is Mode.SPECULATE and self._mode is Mode.SPECULATE and r.counts:  # measured for free
            self._remember(r)
        if r.mode is Mode.PLAIN and self._mode is Mode.PLAIN and r.counts and self._plain_slower(r):
            return
        if r.now >= self._exploit_until:
            # The batch's time left against the period a probe now would buy if the winner stands again
            # (no probe cost yet, as while drafting beats plain decoding's estimate: nothing to weigh).
            left = self._batch_seconds_left() if self._probe_cost > 0 else None
            if left is not None and left < self._doubled_factor() * self._probe_cost:
                self._exploit_until = r.now + left  # looked at again then (or at the next load change)
                self._note(r.now, "the batch ends before another probe could pay: not measuring again",
                           seconds_left=round(left, 4), probe_s=round(self._probe_cost, 4))
            else:
                self._start_measuring()

    def _on_measuring(self, r: _Round) -> None:
        """A block of the cycle (or a probe's plain rounds still being launched)."""
        if self._measure(r) and self._block_over(r.mode):
            self._next_block(r)

    def _on_probe_landing(self, r: _Round) -> None:
        """The probe's plain rounds land among rounds with drafts launched after them. The probe becomes a
        plain block proper when its rounds do not settle it, or when more rounds with drafts than are in
        flight landed first (its micro-batch emptied)."""
        if not self._measure(r):
            if r.counts and r.mode is not self._mode:  # a round with drafts launched after the probe's
                self._probe_drafted += 1
                if self._probe_drafted > self.config.in_flight:
                    self._end_probe()
            return
        if self._block_over(r.mode):
            self._next_block(r)
        elif self._cycle.block >= self.config.probe_rounds:
            self._end_probe()  # not clear from the probe: the block runs its window

    def _on_checking(self, r: _Round) -> None:
        """Drafting measured alone at a new load, window by window, against the carried ratio."""
        if not (self._measure(r) and self._block_over(r.mode)):
            return
        self._cycle.block = 0
        self._cycle.blocks.pop(0)
        if not self._checked(r.now, self._cycle.measured[Mode.SPECULATE]):
            # Plain decoding is measured now, not after more drafting windows pooled for the estimate: the
            # check already judged drafting against a plain round actually measured (on the 2-core CPU at
            # c = 8 the pooling kept drafting through a tail of 4 rows that plain decoding won).
            self._run_block(self._cycle.blocks[0])

    def _measure(self, r: _Round) -> bool:
        """Counts a round of a measuring phase: its seconds towards its mode's cost in the cycle, and, when
        it is a settled round of the mode being measured, into that mode's window (True)."""
        cycle = self._cycle
        cycle.spent[r.mode] += r.elapsed  # every round of the cycle, measured or not
        if not r.counts or r.mode is not self._mode:  # a prefill, or a round of the other mode in flight
            return False
        if self._skip:  # settling after a switch, or the warm-up
            self._skip -= 1
            return False
        cycle.measured[r.mode].add(r.tokens, r.rows, r.draft_seconds, r.interval)
        if r.mode is Mode.SPECULATE:
            self._remember(r)
        if self._phase.probing:
            cycle.probe_measured += 1
        cycle.block += 1
        return True

    def _block_over(self, mode: Mode) -> bool:
        """Whether the current block has its window, or is a plain block that already lost."""
        return self._cycle.block >= self.config.window or self._probe_lost(mode)

    def _next_block(self, r: _Round) -> None:
        """A block of the cycle is complete: decide, skip plain decoding where the estimate rules it out,
        pool another drafting window, or run the next block."""
        cfg, cycle = self.config, self._cycle
        cycle.block = 0
        cycle.blocks.pop(0)
        spec, plain = cycle.measured[Mode.SPECULATE], cycle.measured[Mode.PLAIN]
        drafting = r.mode is Mode.SPECULATE
        few = spec.rows <= cfg.few_rows * spec.rounds
        slack = cfg.few_rows_slack if few else cfg.bound_slack
        bounded, scale, spec_rate = self._drafting_figure(spec)
        if drafting and cycle.blocks and spec.rows and spec_rate > bounded.plain_bound * slack:
            # Drafting beats plain decoding's estimated best by far: no need to run plain to know.
            if not self._plain_bounded or self._best is not Mode.SPECULATE:  # a new reason: into the trace
                self._note(r.now, f"drafting beats plain decoding's estimated best by {slack:g}x or more: "
                                  "plain not run",
                           speculate_tps=spec_rate, plain_estimate_tps=bounded.plain_bound,
                           finish_scale=scale)
            self._decided, self._plain_bounded = (spec_rate, bounded.plain_bound), True
            self._best, cycle.blocks, self._exploit_until = Mode.SPECULATE, [], r.now  # measure drafting on
            self._phase = Phase.EXPLOITING
            return
        if (drafting and cycle.blocks and spec.rows and few and not plain.rounds
                and spec.rounds < cfg.pooled_rounds and spec.rate * scale > spec.plain_bound):
            # Ahead of the estimate but not yet by the slack: at few rows a 4-round window swings with
            # acceptance (2, 1, 1, 4 tokens) — measure drafting longer before paying plain rounds to know.
            # Not with more rows (a window then averages dozens of rows' acceptance; on the CPU at 8 rows
            # plain decoding ran 1.7x its estimate), nor once plain decoding was measured in this cycle.
            cycle.blocks.insert(0, Mode.SPECULATE)
            return
        if (cycle.blocks and spec.rounds and plain.rounds and self._clear(spec_rate, plain.rate)
                and not self._bracket_first_switch(spec_rate, plain.rate)):
            cycle.blocks = []  # one block of each already tells them apart: no bracketing block
        if cycle.blocks:
            self._run_block(cycle.blocks[0])
            return
        self._decide(r.now, spec_rate if spec.rounds else spec.rate, plain.rate, scale)

    def _decide(self, now: float, spec: float, plain: float, scale: float = 1.0) -> None:
        """Both modes measured this cycle: run the faster for a time set by how much the slower costs, and
        keep the round-cost ratio for the load it was measured at."""
        cfg, cycle = self.config, self._cycle
        measured_spec, measured_plain = cycle.measured[Mode.SPECULATE], cycle.measured[Mode.PLAIN]
        current = self._standing()  # hysteresis: the standing winner keeps ties
        other, mine = (plain, spec) if current is Mode.SPECULATE else (spec, plain)
        best = current.other if other > mine * (1 + cfg.margin) else current
        if best is Mode.PLAIN and current is Mode.SPECULATE and cycle.probe_measured >= measured_plain.rounds:
            # Plain decoding wins on a probe's rounds alone: a probe's round is the last stage's share of a
            # plain round less the draft's catch-up, not a pipeline settled into plain decoding (on the 2-core
            # CPU at c = 32 one measured 7 ms, the plain rounds after it 11-15). A plain block proper is
            # measured, then drafting again: a switch is decided on drafting measured on both sides of it.
            cycle.measured[Mode.PLAIN], cycle.spent[Mode.PLAIN], cycle.probe_measured = _Window(), 0.0, 0
            cycle.blocks = [Mode.PLAIN, Mode.SPECULATE]
            self._switch(Mode.PLAIN)
            self._phase, self._skip, cycle.block = Phase.MEASURING, cfg.settle, 0
            self._note(now, "plain decoding faster on a probe's round: measuring a plain block to confirm",
                       speculate_tps=spec, plain_tps=plain)
            return
        self._decided, self._plain_bounded = (spec, plain), False
        if (self._load is not None and measured_spec.rows and measured_plain.rows
                and measured_plain.seconds > 0):
            self._loads.keep(self._load, measured_spec.seconds, measured_spec.rows, measured_plain.seconds,
                             measured_plain.rows, measured_plain.rounds)
        winner, loser = (spec, plain) if best is Mode.SPECULATE else (plain, spec)
        gap = 1.0 - loser / winner if winner > 0 else 0.0
        factor = max(cfg.exploit, gap / cfg.probe_loss)
        if self._best is best and self._factor:
            factor = max(factor, self._doubled_factor())  # the same winner again: probe half as often
        self._factor = min(factor, cfg.max_exploit)
        reason = "drafting measured faster" if best is Mode.SPECULATE else "plain decoding measured faster"
        reason += "" if self._best is None or best is self._best else " (switched)"
        self._best = best
        if best is Mode.PLAIN:
            self._recent.clear()  # drafting rounds from before plain decoding: stale when drafting resumes
        # The loser's whole cost this cycle (settling rounds included) sets how long the winner runs.
        self._probe_cost = cycle.spent[best.other]
        self._exploit_until = now + self._factor * self._probe_cost
        self._switch(best)
        self._phase = Phase.EXPLOITING
        self._note(now, reason, speculate_tps=spec, plain_tps=plain, exploit_factor=self._factor,
                   **({"finish_scale": scale} if scale != 1.0 else {}))

    def _start_measuring(self) -> None:
        """A new measuring cycle (``_Cycle.bracketing``); a probe cut short returns to drafting, which
        stands."""
        if self._phase.probing:
            self._mode = Mode.SPECULATE
        self._phase = Phase.MEASURING
        self._cycle = _Cycle.bracketing(self._mode)
        self._check = None
        self._plain_recent = []

    def _start_check(self, now: float, old: int, load: int, carried: tuple[float, int]) -> None:
        """The load moved while drafting wins: measure drafting alone at the new load, and keep it (and the
        exploit period that was running) while its acceptance beats the carried ratio."""
        self._resume_until = self._exploit_until
        self._start_measuring()
        self._cycle.blocks = [Mode.SPECULATE]
        self._phase, self._check = Phase.CHECKING, carried
        self._note(now, f"load {old} -> {load} running sequences: checking drafting's acceptance against the "
                        f"round-cost ratio {carried[0]:.2f} measured at load {carried[1]}")

    def _checked(self, now: float, spec: _Window) -> bool:
        """A drafting window of a load check is complete: True when that settled it (drafting kept, or
        another window pooled), False when plain decoding has to be measured at the new load after all.
        Drafting is kept when its acceptance τ beats ``LoadRatios.bound`` by ``margin``."""
        assert self._check is not None
        at = self._check[1]
        ratio = self._loads.bound(self._check[0], at, spec.seconds / spec.rounds if spec.rounds else None)
        tau = spec.tokens / spec.rows * self.finish_scale(spec) if spec.rows else 0.0
        if tau >= ratio * (1 + self.config.margin):
            self._check = None
            self.load_checks += 1
            self._cycle.blocks, self._exploit_until = [], max(self._resume_until, now)
            self._phase = Phase.EXPLOITING
            self._note(now, f"drafting's acceptance beats the round-cost ratio measured at load {at}: "
                            "plain not run",
                       tokens_per_row=tau, ratio=ratio, speculate_tps=spec.rate)
            return True
        if tau > ratio and spec.rounds < self.config.pooled_rounds:
            self._cycle.blocks.insert(0, Mode.SPECULATE)  # ahead, not by the margin yet: pool another window
            return True
        self._check = None
        self._cycle.blocks = [Mode.PLAIN, Mode.SPECULATE]  # plain decoding at this load, then drafting
        self._note(now, f"drafting's acceptance {tau:.2f} does not beat the round-cost ratio {ratio:.2f} "
                        f"(measured at load {at}, or its round now against a plain round there): "
                        "measuring plain",
                   tokens_per_row=tau, ratio=ratio, speculate_tps=spec.rate)
        return False

    def _switch(self, mode: Mode) -> None:
        """Run ``mode`` from the next round on; a change of mode is a switch, after which ``settle`` rounds
        (the old mode's rounds still landing, and one whose interval spans the change) are skipped."""
        if mode is not self._mode:
            self.switches += 1
            self._skip = self.config.settle
            self._cycle.block = 0
        self._mode = mode

    def _run_block(self, mode: Mode) -> None:
        """The cycle's next block runs ``mode``. A plain block while drafting stands (or before the first
        decision) starts as a probe; its rounds are measured net of the draft's catch-up they carry, so
        none is skipped."""
        self._switch(mode)
        if mode is Mode.PLAIN and self._best is not Mode.PLAIN:
            self._phase, self._probe_turns, self._skip = Phase.PROBE_LAUNCHING, self.config.probe_rounds, 0
        else:
            self._phase = Phase.MEASURING

    def _end_probe(self) -> None:
        """The probe did not settle it: plain decoding runs for real for the rest of the block (the rounds
        with drafts still in flight are the old mode's, and one more settles)."""
        self._phase, self._skip = Phase.MEASURING, self.config.settle

    def _load_moved(self, load: int) -> bool:
        """Whether ``load`` running sequences differ from the cycle's by ``load_ratio`` either way (or the
        load is given for the first time)."""
        ratio = self.config.load_ratio
        return self._load is None or load * ratio <= self._load or load >= self._load * ratio

    def _plain_slower(self, r: _Round) -> bool:
        """Exploiting plain decoding, its rounds are measured for free: once two windows' worth of them run
        slower than the drafting figure it was chosen over, both are measured again at once (True) instead
        of at the end of the exploit period. What plain decoding was chosen on may have been a short block
        on a machine that slowed down since, or a probe's round, which sees the last stage's share of a
        plain round only: on the 2-core CPU at c = 32 a probe measured 7 ms where plain rounds then ran
        11-15 ms."""
        recent = self._plain_recent
        recent.append(r.interval)
        if len(recent) < 2 * self.config.window:  # two windows: single rounds swing 2-4x on a shared CPU
            return False
        rate = r.tokens / statistics.median(recent)  # a plain round commits one token per row
        del recent[:]
        spec = self._decided[0]
        if spec <= 0 or rate * (1 + self.config.margin) >= spec:
            return False
        self._start_measuring()
        self._note(r.now, "plain decoding's rounds run slower than the drafting it was chosen over: "
                          "measuring again",
                   plain_tps=rate, speculate_tps=spec)
        return True

    def _drafting_figure(self, spec: _Window) -> tuple[_Window, float, float]:
        """Drafting's figure for a decision: (the pooled window, its ``finish_scale``, its scaled rate)."""
        bounded = _Window.of(self._recent) if len(self._recent) > spec.rounds else spec
        scale = self.finish_scale(bounded)
        return bounded, scale, bounded.rate * scale

    def _probe_lost(self, mode: Mode) -> bool:
        """Whether a block of plain decoding measured while drafting is the standing winner (or before the
        first decision) already loses: ``probe_rounds`` of it measured, and drafting's figure of this cycle
        (a whole window, pooled and finish-scaled as for a decision) beats even plain decoding's fastest
        round by ``margin``. A plain round commits one token per row, so only its time is noisy, and its
        fastest round keeps a stalled one from deciding; a drafting block is never cut short (its tokens
        swing with acceptance round to round)."""
        if mode is Mode.SPECULATE or self._best is Mode.PLAIN or self._cycle.block < self.config.probe_rounds:
            return False
        drafting = self._cycle.measured[Mode.SPECULATE]
        if drafting.rounds < self.config.window:
            return False
        plain_peak = self._cycle.measured[Mode.PLAIN].peak
        return self._drafting_figure(drafting)[2] >= plain_peak * (1 + self.config.margin)

    def _clear(self, spec: float, plain: float) -> bool:
        """Whether one block of each mode differs by ``clear`` or more (either way)."""
        low, high = sorted((spec, plain))
        return low <= 0 or high >= low * self.config.clear

    def _bracket_first_switch(self, spec: float, plain: float) -> bool:
        """Whether the first decision, a switch to plain decoding by less than ``clear``², waits for the
        bracketing block of drafting although one block of each looks clear: it sets the longest exploit
        period of a run with nothing to check it, on the run's earliest drafting block, where a stall hits
        hardest. A wider gap is not a stall's doing: it is decided at once."""
        return self._best is None and plain > spec and plain < spec * self.config.clear ** 2

    def _standing(self) -> Mode:
        """The mode a switch is measured against: the last cycle's winner, speculating before the first."""
        return Mode.SPECULATE if self._best is None else self._best

    def _doubled_factor(self) -> float:
        """The exploit factor after another win of the same mode: twice the last one, within the bounds."""
        return min(max(self.config.exploit, 2 * self._factor), self.config.max_exploit)

    def _remember(self, r: _Round) -> None:
        """Keep the last ``bound_windows`` windows' worth of drafting rounds at this load (measured or not),
        so that a window of low acceptance is judged against plain decoding's estimate together with them."""
        self._recent.append((r.tokens, r.rows, r.draft_seconds, r.interval))

    def carried_ratio(self, load: int) -> tuple[float, int] | None:
        """The round-cost ratio measured at the smallest load at or above ``load``, and that load."""
        return self._loads.carried(load)

    def _track_rows(self, drafted: bool, per_row: Sequence[tuple[int, int, int]]) -> None:
        self._rows.track(drafted, per_row)

    def row_acceptance(self, tau: float) -> dict[int, float]:
        """Each running row's tokens per drafting round, shrunk towards ``tau`` (``BatchRows.acceptance``)."""
        return self._rows.acceptance(tau)

    def finish_scale(self, spec: _Window) -> float:
        """What drafting's tokens/s is worth for the batch's finish, as a factor on it: 1 while requests
        wait for a slot (then throughput is what counts: a finished row takes the next request), and else
        ``BatchRows.finish_scale`` of the window's tokens per row and round."""
        if self._queued != 0 or not spec.rows:
            return 1.0
        return self._rows.finish_scale(spec.tokens / spec.rows)

    def _batch_seconds_left(self) -> float | None:
        """How long the batch still runs in the standing mode, with no request waiting for a slot: the row
        with the most rounds still to run (its tokens left, ÷ its acceptance while drafting) times that
        mode's measured round; None while requests wait (or the rows are not given). A re-measure costs
        about what the loser cost in the last cycle and buys ``factor`` times that: when the batch ends
        sooner, it would spend more than that share on a switch that could pay only for the rounds left."""
        w = self._cycle.measured[self._mode]
        if self._queued != 0 or not self._rows.left or not w.rounds or not w.rows:
            return None
        return self._rows.rounds_left(self._mode.drafts, w.tokens / w.rows) * w.seconds / w.rounds

    def _note(self, now: float, reason: str, **rates: float) -> None:
        """One entry of the decision trace: what runs from now on and why."""
        self._trace.note(self.spec_rounds + self.plain_rounds, now, self._mode, reason, **rates)

    def rates(self) -> dict[str, float]:
        """The tokens/s of each mode behind the last decision (0.0 before the first one); ``plain_bound``
        says the plain figure is the estimate from a speculative window, not a measurement."""
        return {"speculate": round(self._decided[0], 2), "plain": round(self._decided[1], 2),
                "plain_bound": self._plain_bounded}

    def trace(self) -> dict[str, Any]:
        """The decision trace for ``--json``: rounds per mode, switches, load changes (and how many of them
        a check of drafting's acceptance settled), the round-cost ratio per measured load, and each decision
        (round, seconds since the first round, the mode chosen, why, and the rates behind it)."""
        return {"spec_rounds": self.spec_rounds, "plain_rounds": self.plain_rounds, "switches": self.switches,
                "load_changes": self.load_changes, "load_checks": self.load_checks,
                "ratios": {str(load): round(r, 3) for load, r in sorted(self._loads.ratio.items())},
                "decisions": self._trace.decision_count, "exploit_s": self._trace.exploit_seconds(),
                "trace": list(self._trace.decisions), "rounds": list(self._trace.rounds)}
