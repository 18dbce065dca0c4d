"""What a stage keeps: ``SeqState`` (one sequence, identical on every stage) and ``StageState`` (the
attributes of a ``StageRunner``, declared once for the phases that read them).

Declarations only; must not import the CLI or vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipespec.engine.cuda_graphs import GraphedForwards, GraphMode
from pipespec.engine.draft_graph import DraftGraphRunner
from pipespec.engine.job import GenerateJob, Request
from pipespec.engine.microbatch import Scheduler
from pipespec.engine.phases import PhaseClock
from pipespec.engine.row_batch import RowBatch
from pipespec.engine.slot_cache import SlotStore
from pipespec.engine.spec_policy import SpecPolicy
from pipespec.engine.target import TargetStage
from pipespec.pp.launch import StageContext
from pipespec.pp.overlap import OverlapTransport
from pipespec.pp.transport import HopReceiver, HopSender, StepChannel


@dataclass
class SeqState:
    """One sequence as every stage sees it (kept identical on all stages by the round messages)."""

    request: Request
    committed: int = 0  # tokens in this sequence's KV cache; 0 until its prefill's message is applied
    pending: int = -1
    drafts: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_new_tokens) or "cancelled"
    output: list[int] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)
    trace: list[list[int]] = field(default_factory=list)  # the drafts each verify step checked ([]: a plain step)
    plain_steps: int = 0  # verify steps without drafts (the speculation policy chose plain decoding)



class StageState:
    """The state of one stage's decoding loop; ``StageRunner.__init__`` sets every attribute."""

    ctx: StageContext
    job: GenerateJob
    target: TargetStage
    draft: Any  # the Eagle3Draft on the last stage when k > 0, else None
    k: int
    eos: frozenset[int]
    seqs: list[SeqState]
    micro_batch_reason: str
    scheduler: Scheduler
    slots: int
    mask_dtype: torch.dtype | None
    batched: bool
    sender: HopSender | None
    receiver: HopReceiver | None
    overlap: OverlapTransport | None
    channel: StepChannel
    batches: list[list[RowBatch]]
    graph_mode: GraphMode | None
    stores: list[SlotStore]
    graphed: dict[int, GraphedForwards]
    policy: SpecPolicy | None
    backlog: dict[int, list[tuple[torch.Tensor, int, list[int]]]]  # request -> (a round's aux copy, its row there, the ids)
    backlog_positions: dict[int, int]
    backlog_cap: int
    draft_ingests: int
    draft_runners: list[DraftGraphRunner]
    draft_runner_of: dict[int, DraftGraphRunner]
    step: int
    forwards: int
    round_draft_s: float
    clock: PhaseClock
    elapsed: float
