"""Micro-batch scheduling: up to M groups of sequences in flight through the pipeline at once.

With one batch in flight, every stage waits at the end of each step for the last stage's message, so
a P-stage pipeline drains and refills every step. With M micro-batches the stages take them in turn
(round-robin): while the last stage verifies micro-batch m, stage 0 already runs micro-batch m + 1,
and the last stage's message for m is consumed by every stage only when m comes round again — the
scheme of vLLM's ``PPHandler.receive`` / ``get_prev_sampled_outputs``.

``Scheduler`` is the bookkeeping, pure Python with no torch in it, replicated on every stage: every
stage runs the same events in the same order, so every stage decides the same thing without any
message (the only messages are the last stage's per-round results). The events of one *turn* of
micro-batch m are:

1. **consume** the message of m's previous round (if one is outstanding): apply each slot's update,
   unless the slot's generation moved on since launch (the request was cancelled while the round was
   in flight: the entry is *stale* and ignored); a finished sequence releases its slot;
2. **admit** waiting requests into free slots (``--max-num-seqs`` caps how many run at once);
3. **launch** a round: one forward for every occupied slot (a prefill for a newly admitted request, a
   verify step otherwise); an empty micro-batch launches nothing and expects no message, so a
   micro-batch with no sequence never blocks anyone;
4. apply **cancellations** that fall due (``cancel_after``): the request leaves its slot at once,
   while its round is still in flight.

Slots. Each micro-batch has ``S = ceil(max_num_seqs / M)`` slots; a slot holds one request at a time
and has a *generation* counter, bumped whenever its occupant leaves (finished or cancelled). A slot
whose round is in flight is not free even when its occupant has left: it is reused only after the
message of that round has been consumed (drained), so a message can never be applied to a newer
occupant, and the generation check makes that visible rather than assumed.

Cancellation (``cancel_after = n`` on a request, ``"cancel_after"`` in a prompts file): the request is
cancelled right after its n-th target forward is launched (the prefill is the first), i.e. while
that forward's round is in flight; the tokens it would have produced are discarded, its output holds
what the first n - 1 forwards produced, and its ``finish_reason`` is ``"cancelled"``. Being a count of
forwards, it cancels at the same point of a request's decoding whatever the micro-batching, which is
what lets a test compare outputs across settings. A serving front end would call ``cancel(request)``
at the same point of the schedule on every stage.

>>> s = Scheduler(3, 2)
>>> mb = s.next_micro_batch(); s.admit(mb); [(l.slot, l.request) for l in s.launch(mb)]
[0, 1]
[(0, 0), (1, 1)]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pipespec.engine.step import SeqUpdate
from pipespec.errors import UsageError

Status = Literal["waiting", "running", "finished", "cancelled"]


# The default micro-batch rule: P micro-batches only when each one's verify forward carries at least
# this many tokens (rows x tokens per row), else one. Measured (docs/benchmarks.md, "Defaults that never
# lose"): on 2x H200 a decode forward at <= 64 tokens per micro-batch reads the weights whatever the rows,
# so two micro-batches cost 14-23 % at c = 8 and 32 (k = 3: 16 and 64 tokens per micro-batch), and paid
# 1.44-2.02x at 256 (c = 128). On the shared 2-core CPU machine three sessions disagree run to run
# (two micro-batches ÷ one at k = 3: c = 8 0.96 / 1.95 / 0.69, c = 32 1.27 / 1.74 / 0.60, c = 128
# 1.14 / 1.07); the threshold follows their medians: one at 16 tokens (c = 8), two from 64 (c = 32).
# 2026-12-02: under load (average 5-8) 0.97 / 0.93 / 0.87 at c = 8 / 32 / 128 (and 0.70 at c = 32 on
# the demo pair), on the machine quiet (average < 2, runs within 10 %) 1.12 / 1.14 / 1.70 and 0.86 for
# plain decoding at c = 8: the quiet run agrees with P from 64 at c = 32 and 128; c = 8 stays a near tie.
# A second quiet run (load < 1, `pipespec bench pipeline`): 1.156 at c = 8 (16 tokens), 1.41 / 1.51 at c =
# 32 / 128, 0.95 for plain decoding at c = 8 (4 tokens). Both quiet runs put the break-even between 4 and
# 16 tokens, and under load c = 8 is a tie either way (median 0.965), so the CPU threshold is 16.
MIN_TOKENS_PER_FORWARD = {"cuda": 256, "cpu": 16}


def micro_batch_rule(pp: int, num_requests: int, max_num_seqs: int | None = None, *, tokens_per_row: int = 1,
                     device_type: str = "cpu") -> tuple[int, str]:
    """``--micro-batches`` when not given, and why: P (or fewer when fewer sequences can run at once)
    when each micro-batch's verify forward would carry ``MIN_TOKENS_PER_FORWARD[device_type]`` tokens
    or more — ``ceil(running / P)`` rows of ``tokens_per_row`` (k + 1 when drafting, 1 for plain
    decoding) — else 1. Device types without a measured threshold use CUDA's."""
    running = min(num_requests, max_num_seqs or num_requests)
    most = max(1, min(pp, running))
    if most == 1:
        return 1, "one micro-batch: one stage or one sequence at a time"
    need = MIN_TOKENS_PER_FORWARD.get(device_type, MIN_TOKENS_PER_FORWARD["cuda"])
    tokens = math.ceil(running / most) * tokens_per_row
    if tokens >= need:
        return most, f"{most} micro-batches: {tokens} tokens per micro-batch forward >= {need} on {device_type}"
    return 1, (f"one micro-batch: {most} would carry {tokens} tokens per forward each, < {need} on {device_type} "
               "(where more micro-batches were measured slower)")


def default_micro_batches(pp: int, num_requests: int, max_num_seqs: int | None = None, *, tokens_per_row: int = 1,
                          device_type: str = "cpu") -> int:
    """The count ``micro_batch_rule`` picks."""
    return micro_batch_rule(pp, num_requests, max_num_seqs, tokens_per_row=tokens_per_row, device_type=device_type)[0]


@dataclass
class Slot:
    index: int
    request: int | None = None
    generation: int = 0
    in_flight: tuple[int, int] | None = None  # (request, generation) of a launched round not yet consumed

    @property
    def free(self) -> bool:
        """Empty, and no message of an earlier occupant is still to be drained."""
        return self.request is None and self.in_flight is None


@dataclass
class MicroBatch:
    index: int
    slots: list[Slot]
    rounds: int = 0  # rounds launched so far; the round number of the next message is rounds - 1
    awaiting: bool = False  # a launched round's message has not been consumed yet

    @property
    def occupied(self) -> list[Slot]:
        return [s for s in self.slots if s.request is not None]


@dataclass(frozen=True)
class Launch:
    """One forward of a round: which slot, which request, at which slot generation."""

    slot: int
    request: int
    generation: int


@dataclass
class Scheduler:
    """The replicated schedule of one ``pipespec generate`` run (see the module docstring)."""

    num_requests: int
    num_micro_batches: int
    max_num_seqs: int | None = None
    cancel_after: Sequence[int | None] | None = None
    micro_batches: list[MicroBatch] = field(init=False)
    waiting: deque[int] = field(init=False)
    status: list[Status] = field(init=False)
    forwards: list[int] = field(init=False)
    turn: int = field(init=False, default=0)
    stale: int = field(init=False, default=0)  # entries ignored because their slot moved on

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise UsageError("nothing to schedule: no requests")
        if self.num_micro_batches < 1:
            raise UsageError(f"--micro-batches must be >= 1, got {self.num_micro_batches}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise UsageError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        cancel = list(self.cancel_after) if self.cancel_after is not None else [None] * self.num_requests
        if len(cancel) != self.num_requests:
            raise ValueError(f"cancel_after has {len(cancel)} entries for {self.num_requests} requests")
        for i, n in enumerate(cancel):
            if n is not None and n < 1:
                raise UsageError(f"request {i}: cancel_after must be >= 1 (target forwards, the prefill is the first), got {n}")
        self.cancel_after = cancel
        self.capacity = min(self.max_num_seqs or self.num_requests, self.num_requests)
        self.slots_per_micro_batch = math.ceil(self.capacity / self.num_micro_batches)
        self.micro_batches = [
            MicroBatch(m, [Slot(i) for i in range(self.slots_per_micro_batch)]) for m in range(self.num_micro_batches)
        ]
        self.waiting = deque(range(self.num_requests))
        self.status = ["waiting"] * self.num_requests
        self.forwards = [0] * self.num_requests

    # ---------------------------------------------------------------------------------- queries
    @property
    def running(self) -> int:
        return sum(len(mb.occupied) for mb in self.micro_batches)

    def done(self) -> bool:
        """Every request finished or cancelled, and every launched round's message consumed."""
        return not self.waiting and not any(mb.awaiting or mb.occupied for mb in self.micro_batches)

    def next_micro_batch(self) -> MicroBatch:
        """The micro-batch whose turn it is (round-robin)."""
        mb = self.micro_batches[self.turn % self.num_micro_batches]
        self.turn += 1
        return mb

    # ---------------------------------------------------------------------------------- events
    def consume(self, mb: MicroBatch, updates: Sequence[SeqUpdate]) -> list[tuple[int, SeqUpdate]]:
        """Apply the message of ``mb``'s last round; returns ``(request, update)`` for the live entries.

        Checks every entry against what this stage launched (same request and generation in the same
        slot): a mismatch means the stages disagree about the schedule, which must fail loudly.
        """
        if not mb.awaiting:
            raise RuntimeError(f"micro-batch {mb.index} has no round in flight, yet a message was consumed for it")
        if len(updates) != len(mb.slots):
            raise RuntimeError(f"micro-batch {mb.index}: a message with {len(updates)} slots, the schedule has {len(mb.slots)}")
        mb.awaiting = False
        live = []
        for slot, u in zip(mb.slots, updates):
            if slot.in_flight is None:
                if u.ran:
                    raise RuntimeError(
                        f"micro-batch {mb.index} slot {slot.index}: the message reports a forward of request {u.request} "
                        "that this stage never launched: the stages are out of step"
                    )
                continue
            request, generation = slot.in_flight
            if not u.ran or (u.request, u.generation) != (request, generation):
                reported = f"request {u.request} at generation {u.generation}" if u.ran else "no forward"
                raise RuntimeError(
                    f"micro-batch {mb.index} slot {slot.index}: launched request {request} at generation {generation}, "
                    f"the message reports {reported}: the stages are out of step"
                )
            slot.in_flight = None
            if slot.generation != generation:
                self.stale += 1  # cancelled while in flight: the slot's occupant has left since launch
                continue
            live.append((request, u))
            if u.done:
                self._release(slot, "finished")
        return live

    def admit(self, mb: MicroBatch) -> list[int]:
        """Move waiting requests into ``mb``'s free slots (within ``max_num_seqs``); returns them."""
        admitted = []
        for slot in mb.slots:
            if not self.waiting or self.running >= self.capacity:
                break
            if slot.free:
                request = self.waiting.popleft()
                slot.request = request
                self.status[request] = "running"
                admitted.append(request)
        return admitted

    def launch(self, mb: MicroBatch) -> list[Launch]:
        """Start a round of ``mb``: one forward per occupied slot (none: no round, no message)."""
        launches = [Launch(s.index, s.request, s.generation) for s in mb.slots if s.request is not None]
        for launch in launches:
            mb.slots[launch.slot].in_flight = (launch.request, launch.generation)
            self.forwards[launch.request] += 1
        if launches:
            mb.rounds += 1
            mb.awaiting = True
        return launches

    def cancel_due(self, mb: MicroBatch, launches: Sequence[Launch]) -> list[int]:
        """Cancel the just-launched requests whose ``cancel_after`` forwards are reached; returns them."""
        assert self.cancel_after is not None
        cancelled = []
        for launch in launches:
            limit = self.cancel_after[launch.request]
            if limit is not None and self.forwards[launch.request] >= limit and self.status[launch.request] == "running":
                self._release(mb.slots[launch.slot], "cancelled")
                cancelled.append(launch.request)
        return cancelled

    def cancel(self, request: int) -> bool:
        """Cancel ``request`` now (waiting or running); False if it already ended. Every stage must call
        this at the same point of the schedule."""
        if self.status[request] == "waiting":
            self.waiting.remove(request)
            self.status[request] = "cancelled"
            return True
        if self.status[request] != "running":
            return False
        for mb in self.micro_batches:
            for slot in mb.slots:
                if slot.request == request:
                    self._release(slot, "cancelled")
                    return True
        raise RuntimeError(f"request {request} is running but holds no slot")

    def _release(self, slot: Slot, status: Status) -> None:
        assert slot.request is not None
        self.status[slot.request] = status
        slot.request = None
        slot.generation += 1
