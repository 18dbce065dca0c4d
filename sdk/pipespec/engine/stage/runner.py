"""``StageRunner``: one stage's decoding loop, built from its phases (rounds, drafting, warm-up); this
module sets up its transport, schedule, fixed buffers and policy.

Must not import the CLI or vllm.
"""

from __future__ import annotations

from typing import Any

import torch

from pipespec.engine import step as stepmsg
from pipespec.engine.cuda_graphs import GraphedForwards
from pipespec.engine.draft_graph import DraftGraphRunner
from pipespec.engine.job import GenerateJob
from pipespec.engine.microbatch import Scheduler, micro_batch_rule
from pipespec.engine.phases import PhaseClock
from pipespec.engine.row_batch import RowBatch, batchable
from pipespec.engine.slot_cache import SlotStore, slot_bytes
from pipespec.engine.spec_policy import SpecPolicy
from pipespec.engine.stage.captures import StageWarmup, graph_mode, graphs_fit
from pipespec.engine.stage.settings import draft_backlog
from pipespec.engine.stage.state import SeqState
from pipespec.engine.target import TargetStage
from pipespec.pp.launch import StageContext
from pipespec.pp.overlap import OverlapTransport
from pipespec.pp.transport import HopReceiver, HopSender, StepChannel

POLICY_WARMUP_ROUNDS = 3  # per micro-batch: the speculation policy does not measure a fresh stage's first rounds


class StageRunner(StageWarmup):
    """The decoding loop of one stage (see ``pipespec.engine.worker``)."""

    def __init__(self, ctx: StageContext, job: GenerateJob, target: TargetStage, draft: Any, eos: frozenset[int]) -> None:
        self.ctx, self.job, self.target, self.draft = ctx, job, target, draft
        self.k = job.num_spec_tokens
        self.eos = eos
        self.seqs = [SeqState(r) for r in job.requests]
        if job.micro_batches:
            micro_batches, self.micro_batch_reason = job.micro_batches, f"--micro-batches {job.micro_batches}"
        else:
            micro_batches, self.micro_batch_reason = micro_batch_rule(
                ctx.world_size, len(self.seqs), job.max_num_seqs, tokens_per_row=self.k + 1,
                device_type=torch.device(ctx.device).type)
        self.scheduler = Scheduler(
            len(self.seqs), micro_batches, max_num_seqs=job.max_num_seqs, cancel_after=[r.cancel_after for r in job.requests]
        )
        self.slots = self.scheduler.slots_per_micro_batch
        # Several sequences per forward (rows with holes) where the stage's cache allows it; else one
        # forward per sequence (sliding-window / hybrid layers: pipespec.engine.row_batch).
        attention = getattr(target.decoder.config, "_attn_implementation", None) or "sdpa"
        # The engine builds the 4D masks of batches with holes itself: boolean for sdpa, additive for eager;
        # other kernels (flash, flex) take no such mask, so their sequences run one per forward.
        self.mask_dtype = target.dtype if attention == "eager" else None
        self.batched = batchable(target.resolved.config) and attention in ("sdpa", "eager")
        rows = self.slots if self.batched else 1
        longest = max(len(r.prompt_ids) for r in job.requests)
        max_tokens = max(longest, self.k + 1)
        hidden, dtype = target.hidden_size, target.dtype
        # Two send buffers: a stage computes its next forward while the previous one's output travels.
        self.sender = (
            HopSender(ctx, target.send_keys(), hidden, dtype, ctx.rank + 1, (rows, max_tokens), depth=2)
            if not ctx.is_last else None
        )
        self.receiver = (
            HopReceiver(ctx, target.receive_keys(), hidden, dtype, ctx.rank - 1, (rows, max_tokens)) if not ctx.is_first else None
        )
        # Optional overlap transport for large (prefill-sized) forwards; both ends pick it by the token
        # count of the forward, which every stage knows, so no mode flag travels.
        self.overlap = (
            OverlapTransport(ctx, target.plan, hidden, dtype, has_residual=target.has_residual,
                             max_leading_shape=(rows, max_tokens))
            if job.aux_transport == "overlap" and ctx.world_size > 1 and target.plan.aux_layers else None
        )
        self.channel = StepChannel(ctx, stepmsg.message_size(self.slots, self.k), micro_batches)
        # The batched KV state of each micro-batch's running sequences (one RowBatch when batched).
        self.batches: list[list[RowBatch]] = [[] for _ in range(micro_batches)]
        longest_seq = max(len(r.prompt_ids) + r.max_new_tokens for r in job.requests)
        self._make_slot_stores(micro_batches, longest_seq)
        # Rounds still in flight from the old mode after a switch are told apart by what they carried; one
        # more round is skipped: its interval spans the pipeline's change of mode. A micro-batch's round is
        # in flight while the others run theirs.
        self.policy = SpecPolicy(job.spec_policy, settle=1, in_flight=micro_batches,  # type: ignore[arg-type]
                                 warmup=POLICY_WARMUP_ROUNDS * micro_batches) if ctx.is_last and self.k else None
        # Positions verified while not speculating, per request, waiting for the draft (last stage).
        self.backlog: dict[int, list[tuple[torch.Tensor, int, list[int]]]] = {}  # request -> (round's aux copy, its row, ids)
        self.backlog_positions: dict[int, int] = {}  # positions held per request (the sum of its backlog)
        self.backlog_cap = draft_backlog()
        self.draft_ingests = 0  # one-pass ingestions of a backlog (while or after decoding plainly)
        self._make_draft_runners(micro_batches, longest_seq)
        self.draft_runner_of: dict[int, DraftGraphRunner] = {id(r.storage): r for r in self.draft_runners}
        self.step = 0  # rounds launched, all micro-batches together
        self.forwards = 0  # target forwards run by this stage
        self.round_draft_s = 0.0  # seconds the draft took in the current round's verify steps (last stage)
        self.clock = PhaseClock(ctx.device)  # host seconds per phase of the rounds (stats: phase_s)
        self.elapsed = 0.0

    def _make_slot_stores(self, micro_batches: int, longest_seq: int) -> None:
        """Verify forwards replayed from CUDA graphs: each micro-batch's running rows live in fixed buffers
        (a SlotStore) sized for the longest sequence, its forwards graphed per shape."""
        ctx, job, target = self.ctx, self.job, self.target
        self.graph_mode = graph_mode(job.cuda_graphs, ctx.device, self.batched)
        self.stores: list[SlotStore] = []
        self.graphed: dict[int, GraphedForwards] = {}  # by id(store.cache)
        longest_row = longest_seq + self.k + 1  # committed slots of a row, at most
        capacity = longest_row + max(8, longest_row // 4) + self.k + 1  # RowBatch compacts past longest * 1.25
        if self.graph_mode == "cuda":
            layers = target.stage.end_layer - target.stage.start_layer
            need = micro_batches * slot_bytes(target.resolved.config, layers, self.slots, capacity, target.dtype)
            free, _total = torch.cuda.mem_get_info(ctx.device)
            self.graph_mode = graphs_fit(job.cuda_graphs, need, free)
            if self.graph_mode is None:
                ctx.log(f"warning: --cuda-graphs auto: the fixed KV buffers would take {need / 2**30:.2f} GiB of the "
                        f"{free / 2**30:.2f} GiB free on {ctx.device}; decoding eagerly", always=True)
        if self.graph_mode is not None:
            pool = torch.cuda.graph_pool_handle() if self.graph_mode == "cuda" else None
            for _ in range(micro_batches):
                store = SlotStore(target.new_cache, self.slots, capacity, ctx.device)
                self.stores.append(store)
                self.graphed[id(store.cache)] = GraphedForwards(target, store, self.graph_mode, pool)

    def _make_draft_runners(self, micro_batches: int, longest_seq: int) -> None:
        """The draft's proposals from CUDA graphs too (last stage): fixed draft storage per micro-batch."""
        job, draft = self.job, self.draft
        self.draft_runners: list[DraftGraphRunner] = []
        if self.graph_mode is not None and draft is not None and self.k:
            longest_new = max(r.max_new_tokens for r in job.requests)
            # The longest row, plus the widest update (a held-back backlog, or k + 1 verified positions)
            # and the k - 1 draft steps past it.
            draft_capacity = longest_seq + max(min(self.backlog_cap, longest_new), self.k + 1) + 2 * self.k + 2
            self.draft_runners = [
                DraftGraphRunner(draft, max_rows=self.slots, capacity=draft_capacity, num_tokens=self.k, mode=self.graph_mode)
                for _ in range(micro_batches)
            ]
