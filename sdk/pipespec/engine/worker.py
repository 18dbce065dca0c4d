"""One stage process of ``pipespec generate``: load this stage, then run greedy EAGLE3 decoding with up
to M micro-batches in flight.

Every stage runs the same schedule over the same replicated state (``pipespec.engine.microbatch``);
only the last stage decides anything, and its per-round message keeps the copies equal.

Sequences are grouped into M micro-batches that take turns (round-robin). A *round* of a micro-batch
runs its sequences as the rows of batched forwards (``pipespec.engine.row_batch``): one forward for
the sequences already running (verify), one for the sequences admitted this turn (prefill); each
goes through the whole pipeline, every stage handing its packed ``IntermediateTensors`` to the next.
A stage whose layers cannot hold rows with holes (sliding-window, linear-attention or convolution
layers) runs one forward per sequence instead.

Prefill (a sequence's first forward): stage 0 embeds the prompt ``x_0..x_{n-1}`` and runs its layers;
the last stage takes the greedy token ``x_n`` from the final logits; the draft reads the aux states of
all ``n`` positions paired with ``x_1..x_n`` and proposes ``d_1..d_k``. Prompts of a batch are padded
to the longest; padding is masked.

Verify (every later forward): for a sequence with ``c`` tokens committed to its KV cache, the pipeline
runs ``[x_n, d_1..d_j]`` at positions ``c..c+j`` (``j = k``, or 0 when the last stage chose plain
decoding for the round: ``pipespec.engine.spec_policy``); the last stage's greedy predictions
``y_0..y_j`` accept the longest prefix with ``d_i == y_{i-1}`` (``a`` drafts) plus the bonus token
``y_a``; the draft reads the aux states of those ``a + 1`` positions paired with ``d_1..d_a, y_a`` and
proposes the next k (or, not speculating, only stores them so it can resume with full context).

After the round, the last stage publishes one message for the micro-batch (``pipespec.engine.step``:
per slot ``a``, the tokens, the drafts) without waiting for anyone, and goes on with the next
micro-batch; every other stage has posted the receive for it and reads it only when that
micro-batch's turn comes again (M turns later). Then every stage marks each row's rejected positions
as holes in its batched KV cache (``RowBatch.resolve``: crops what every row rejected, compacts when
holes pile up), drops finished and cancelled rows, merges the new rows in, and updates its copy of
the state. With M = 1 every round waits for the previous round's message: the pipeline drains each
step.

On CUDA (``--cuda-graphs auto``) a micro-batch's running rows live in fixed KV buffers and its verify
forwards and the draft's proposals replay CUDA graphs (``pipespec.engine.cuda_graphs``,
``pipespec.engine.draft_graph``); every stage times the phases of its rounds (``pipespec.engine.phases``).

``k = 0`` is plain pipeline-parallel decoding: one token per round, no draft. Sequences accept
different numbers of drafts (their rows keep different counts), finish at different rounds, and leave
their slot to a waiting request (``--max-num-seqs``) or to nobody.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipespec.contract.embed import spec_decode_needs_target_embed
from pipespec.engine import step as stepmsg
from pipespec.engine.cuda_graphs import GraphedForwards, GraphMode
from pipespec.engine.draft_graph import DraftGraphRunner
from pipespec.engine.job import GenerateJob, Request
from pipespec.engine.microbatch import Launch, MicroBatch, Scheduler, micro_batch_rule
from pipespec.engine.phases import PhaseClock, maybe_profile
from pipespec.engine.row_batch import RowBatch, batchable, pad_rows, to_device
from pipespec.engine.slot_cache import SlotStore, slot_bytes
from pipespec.engine.spec_policy import SpecPolicy
from pipespec.engine.target import TargetStage, build_target_stage, resolve_target
from pipespec.env import env_flag, env_positive_int
from pipespec.errors import UsageError
from pipespec.pp.launch import StageContext
from pipespec.pp.loading import dtype_from_name
from pipespec.pp.overlap import OverlapTransport
from pipespec.pp.transport import HopReceiver, HopSender, StepBroadcaster, StepChannel


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


THREADS_ENV = "PIPESPEC_THREADS"
DRAFT_BACKLOG = 256  # positions a row may hold back from the draft while not speculating
DRAFT_BACKLOG_ENV = "PIPESPEC_DRAFT_BACKLOG"  # overrides it (memory vs. fewer draft passes while plain)


def draft_backlog() -> int:
    """``$PIPESPEC_DRAFT_BACKLOG`` or ``DRAFT_BACKLOG``: how many verified positions a sequence may hold
    back from the draft while the policy decodes plainly (their aux states wait on the last stage)."""
    backlog = env_positive_int(DRAFT_BACKLOG_ENV)
    return DRAFT_BACKLOG if backlog is None else backlog


def stage_threads(world_size: int) -> int:
    """Intra-op threads per CPU stage: ``$PIPESPEC_THREADS``, else ``$OMP_NUM_THREADS``, else the cores
    split evenly over the stages.

    On a machine whose cores are busy with other work, fewer threads are much faster (idle-spinning
    intra-op threads compete for the same cores): 1 is the setting for that case (``make`` sets
    ``OMP_NUM_THREADS=1``).
    """
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        threads = env_positive_int(name)
        if threads is not None:
            return threads
    return max(1, (os.cpu_count() or 1) // world_size)


CUDNN_SDP_ENV = "PIPESPEC_CUDNN_SDP"


def configure_cuda_attention() -> None:
    """Leave cuDNN out of ``scaled_dot_product_attention`` on CUDA (``$PIPESPEC_CUDNN_SDP=1`` keeps it;
    a value that is not a switch is a usage error).

    Decoding changes the key length every step. Recent torch releases prefer the cuDNN attention
    backend on Hopper GPUs, and cuDNN builds an execution plan for every new shape: tens of
    milliseconds per attention call, every step, for target and draft alike. The flash and
    memory-efficient kernels handle any length without a plan.
    """
    if not env_flag(CUDNN_SDP_ENV):
        torch.backends.cuda.enable_cudnn_sdp(False)


def eos_token_ids(target_dir: str, config: Any) -> frozenset[int]:
    """The EOS ids ``generate`` would stop on: generation_config.json, else the model config."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(target_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - no generation_config.json: fall back to the model config
        gen = GenerationConfig.from_model_config(config)
    eos = gen.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else [int(i) for i in eos])


class StageRunner:
    """The decoding loop of one stage (see the module docstring)."""

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
        # Verify forwards replayed from CUDA graphs: each micro-batch's running rows live in fixed
        # buffers (a SlotStore) sized for the longest sequence, its forwards graphed per shape.
        self.graph_mode = graph_mode(job.cuda_graphs, ctx.device, self.batched)
        self.stores: list[SlotStore] = []
        self.graphed: dict[int, GraphedForwards] = {}  # by id(store.cache)
        longest_seq = max(len(r.prompt_ids) + r.max_new_tokens for r in job.requests)
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
        # Rounds still in flight from the old mode after a switch are told apart by what they carried; one
        # more round is skipped: its interval spans the pipeline's change of mode.
        self.policy = SpecPolicy(job.spec_policy, settle=1, warmup=POLICY_WARMUP_ROUNDS * micro_batches) if ctx.is_last and self.k else None  # type: ignore[arg-type]
        # Positions verified while not speculating, per request, waiting for the draft (last stage).
        self.backlog: dict[int, list[tuple[torch.Tensor, list[int]]]] = {}
        self.backlog_positions: dict[int, int] = {}  # positions held per request (the sum of its backlog)
        self.backlog_cap = draft_backlog()
        self.draft_ingests = 0  # one-pass ingestions of a backlog (while or after decoding plainly)
        # The draft's proposals from CUDA graphs too (last stage): fixed draft storage per micro-batch.
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
        self.draft_runner_of: dict[int, DraftGraphRunner] = {id(r.storage): r for r in self.draft_runners}
        self.step = 0  # rounds launched, all micro-batches together
        self.forwards = 0  # target forwards run by this stage
        self.round_draft_s = 0.0  # seconds the draft took in the current round's verify steps (last stage)
        self.clock = PhaseClock(ctx.device)  # host seconds per phase of the rounds (stats: phase_s)
        self.elapsed = 0.0

    # ------------------------------------------------------------------------------ one forward
    def _forward(
        self, batch: RowBatch, tokens: list[list[int]], committed: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """This stage's share of one forward of ``batch``: row ``b`` runs ``tokens[b]`` after its
        ``committed[b]`` cached tokens. The last stage gets ``(logits, aux)``, the others ``None``."""
        clock = self.clock
        graphed = self.graphed.get(id(batch.cache))
        with clock("inputs"):
            ids, positions, mask, steps = batch.inputs(tokens, committed, graphed.store.capacity if graphed else None)
        shape = (batch.size, steps)
        self.forwards += 1
        overlap = self.overlap if self.overlap is not None and batch.size * steps >= self.job.overlap_min_tokens else None
        if overlap is not None and not self.ctx.is_last:
            overlap.attach(self.target.decoder)
        try:
            if self.ctx.is_first:
                with clock("forward"):
                    out = self._run(batch, graphed, overlap is None, positions, mask, input_ids=ids)
            else:
                assert self.receiver is not None
                with clock("recv"):
                    received = overlap.recv(shape) if overlap else self.receiver.recv(shape)
                with clock("forward"):
                    out = self._run(batch, graphed, overlap is None, positions, mask, received=received)
            if self.sender is not None:
                assert not isinstance(out, tuple)
                with clock("send"):
                    (overlap or self.sender).send(out)
                return None
        finally:
            if overlap is not None and not self.ctx.is_last:
                overlap.detach(self.target.decoder)
        assert isinstance(out, tuple)
        return out

    def _run(self, batch: RowBatch, graphed: GraphedForwards | None, may_graph: bool, positions: torch.Tensor,
             mask: torch.Tensor | None, input_ids: torch.Tensor | None = None, received: Any = None) -> Any:
        """The stage's forward of ``batch``: from a CUDA graph when its rows live in a slot store (and no
        hook-based overlap transport runs in it), else eagerly."""
        if graphed is None:
            return self.target.forward(batch.cache, positions, input_ids=input_ids, received=received, attention_mask=mask)
        assert mask is not None
        if may_graph:
            return graphed(positions, mask, input_ids=input_ids, received=received)
        return graphed.eager(positions, mask, input_ids=input_ids, received=received)

    def _cut(self, seq: SeqState, produced: list[int]) -> tuple[int, bool]:
        """How many produced tokens to keep (EOS, budget) and whether the sequence is finished."""
        room = seq.request.max_new_tokens - len(seq.output)
        kept = min(len(produced), room)
        for i, tok in enumerate(produced[:kept]):
            if tok in self.eos:
                return i + 1, True
        return kept, len(seq.output) + kept >= seq.request.max_new_tokens

    def _draft(self, batch: RowBatch, aux: list[torch.Tensor], next_ids: list[list[int]], speculate: bool) -> list[list[int]]:
        """Give the draft the verified positions of every row (``next_ids[b]``: the tokens that follow
        them, ``aux`` their aux states, padded) and, when speculating, return k drafts per row.

        Not speculating, the positions wait in a backlog (a copy: the aux states may live in a receive
        buffer) that the draft ingests in one pass before it next drafts, or when it grows past
        ``draft_backlog()`` positions: a plain round then costs no draft forward at all.
        """
        if not speculate:
            features = torch.cat(aux, dim=-1)  # a copy, [B, T, k * H]
            longest = 0
            for b, (request, row) in enumerate(zip(batch.rows, next_ids)):
                self.backlog.setdefault(request, []).append((features[b, : len(row)], row))
                self.backlog_positions[request] = held = self.backlog_positions.get(request, 0) + len(row)
                longest = max(longest, held)
            if longest >= self.backlog_cap:
                self._ingest(batch)
            return [[] for _ in next_ids]
        self._ingest(batch)
        ids = to_device(pad_rows(next_ids), self.ctx.device)
        width = ids.shape[1]
        return self._drafter(batch).propose([a[:, :width] for a in aux], ids, batch.draft_cache, num_tokens=self.k,
                                            num_valid=_ragged_counts(next_ids)).tolist()

    def _drafter(self, batch: RowBatch) -> Any:
        """The draft, or the graph runner whose storage holds ``batch``'s draft cache."""
        storage = getattr(batch.draft_cache, "storage", None)
        return self.draft_runner_of.get(id(storage), self.draft) if storage is not None else self.draft

    def _ingest(self, batch: RowBatch) -> None:
        """Feed the draft the backlog of ``batch``'s rows (positions verified while not speculating)."""
        entries = [self.backlog.pop(request, []) for request in batch.rows]
        for request in batch.rows:
            self.backlog_positions.pop(request, None)
        if not any(entries):
            return
        self.draft_ingests += 1
        rows = [[t for _, ids in entry for t in ids] for entry in entries]
        counts = [len(r) for r in rows]
        sample = next(f for entry in entries for f, _ in entry)
        features = sample.new_zeros(batch.size, max(counts), sample.shape[-1])
        for b, entry in enumerate(entries):
            if entry:
                features[b, : counts[b]] = torch.cat([f for f, _ in entry])
        ids = to_device(pad_rows([r or [0] for r in rows]), self.ctx.device)  # a row with nothing new: counts 0
        self._drafter(batch).extend(features, ids, batch.draft_cache, num_valid=_ragged_counts(rows))

    # ------------------------------------------------------------------------------ one round
    def _prefill(self, rows: list[int], speculate: bool) -> tuple[RowBatch, list[stepmsg.SeqUpdate] | None]:
        """Prefill newly admitted sequences as one batch (right-padded prompts): the new batch, and
        their updates on the last stage."""
        batch = RowBatch(self.target.new_cache(record_past=self.k > 0), rows, self.ctx.device, self.mask_dtype)
        prompts = [list(self.seqs[r].request.prompt_ids) for r in rows]
        out = self._forward(batch, prompts, [0] * len(rows))
        if out is None:
            return batch, None
        logits, aux = out
        with self.clock("sample"):
            last = torch.tensor([len(p) - 1 for p in prompts], device=logits.device)
            firsts = logits[torch.arange(len(rows), device=logits.device), last].argmax(dim=-1).tolist()
        updates = []
        for r, first in zip(rows, firsts):
            kept, done = self._cut(self.seqs[r], [first])
            updates.append(stepmsg.SeqUpdate(ran=True, done=done, accepted=0, tokens=[first], kept=kept))
        if self.k:
            capacity = max(len(p) + self.seqs[r].request.max_new_tokens for p, r in zip(prompts, rows)) + self.k + 1
            with self.clock("draft"):
                batch.draft_cache = self.draft.new_cache(len(rows), capacity=capacity)
                drafts = self._draft(batch, aux, [p[1:] + [f] for p, f in zip(prompts, firsts)], speculate)
            for u, d in zip(updates, drafts):
                u.drafts = d if not u.done else []
        return batch, updates

    def _verify(self, batch: RowBatch, speculate: bool) -> list[stepmsg.SeqUpdate] | None:
        """One verify forward of the running sequences of ``batch``: ``[pending, *drafts]`` per row."""
        seqs = [self.seqs[r] for r in batch.rows]
        out = self._forward(batch, [[s.pending, *s.drafts] for s in seqs], [s.committed for s in seqs])
        if out is None:
            return None
        logits, aux = out
        with self.clock("sample"):
            predicted = logits.argmax(dim=-1).tolist()
        updates, produced_rows = [], []
        for seq, pred in zip(seqs, predicted):
            accepted = 0
            while accepted < len(seq.drafts) and seq.drafts[accepted] == pred[accepted]:
                accepted += 1
            produced = seq.drafts[:accepted] + [int(pred[accepted])]
            kept, done = self._cut(seq, produced)
            updates.append(stepmsg.SeqUpdate(ran=True, done=done, accepted=accepted, tokens=produced, kept=kept))
            produced_rows.append(produced)
        if self.k:
            started = time.perf_counter()
            with self.clock("draft" if speculate else "draft_backlog"):
                drafts = self._draft(batch, aux, produced_rows, speculate)  # ends in a host read: timed whole
            self.round_draft_s += time.perf_counter() - started
            for u, d in zip(updates, drafts):
                u.drafts = d if not u.done else []
        return updates

    def _apply(self, seq: SeqState, u: stepmsg.SeqUpdate) -> None:
        prefill = seq.committed == 0
        if prefill:
            seq.committed = len(seq.request.prompt_ids)
        else:
            seq.committed += u.accepted + 1
            if seq.drafts or not self.k:
                seq.acceptance.append(u.accepted + 1)
            else:
                seq.plain_steps += 1
            if self.job.trace:  # only kept when asked for: it grows with every step
                seq.trace.append(list(seq.drafts))
        seq.output.extend(u.tokens[: u.kept])
        seq.pending = u.tokens[-1]
        seq.drafts = list(u.drafts)
        if u.done:
            self._end(seq, "stop" if seq.output and seq.output[-1] in self.eos else "length")

    def _end(self, seq: SeqState, reason: str) -> None:
        seq.done, seq.finish_reason = True, reason

    def _settle(self, index: int) -> None:
        """After a micro-batch's message: close each batch's forward with the committed lengths, drop
        finished and cancelled rows (their KV memory goes at once), merge what is left into one batch."""
        batches = []
        for batch in self.batches[index]:
            if batch.open:
                batch.resolve([self.seqs[r].committed for r in batch.rows])
            dead = {r for r in batch.rows if self.seqs[r].done}
            batch.drop(dead)
            for request in dead:
                self.backlog.pop(request, None)
                self.backlog_positions.pop(request, None)
            if batch.size:
                batches.append(batch)
        if self.batched and len(batches) > 1:
            batches = [RowBatch.merge(batches)]
        if self.stores and batches:
            batches[0].cache = self.stores[index].adopt(batches[0].cache)  # in place when it is already there
        if self.draft_runners and batches and batches[0].draft_cache is not None:
            batches[0].draft_cache = self.draft_runners[index].adopt(batches[0].draft_cache)
        self.batches[index] = batches

    # ------------------------------------------------------------------------------ the schedule
    def _turn(self) -> bool:
        """One turn of the round-robin: consume, admit, launch, cancel. True if a round was launched."""
        sched = self.scheduler
        mb = sched.next_micro_batch()
        clock = self.clock
        if mb.awaiting:
            with clock("message"):
                message = self.channel.take(mb.index)
            with clock("apply"):
                updates = stepmsg.decode(message, mb.rounds - 1, mb.index, self.slots, self.k)
                for request, update in sched.consume(mb, updates):
                    self._apply(self.seqs[request], update)
            with clock("settle"):
                self._settle(mb.index)
        sched.admit(mb)
        launches = sched.launch(mb)
        if not launches:
            return False
        batches = self.batches[mb.index]
        running = sorted(r for b in batches for r in b.rows)
        new = [launch.request for launch in launches if self.seqs[launch.request].committed == 0]
        if running != sorted(set(launch.request for launch in launches) - set(new)):
            raise RuntimeError(f"micro-batch {mb.index}: the running rows {running} are not the launched verify steps")
        speculate = self.policy.speculate() if self.policy is not None else False
        by_request: dict[int, stepmsg.SeqUpdate] = {}
        speculated = False
        self.round_draft_s = 0.0
        for batch in batches:
            speculated = speculated or any(self.seqs[r].drafts for r in batch.rows)
            result = self._verify(batch, speculate)
            if result is not None:
                by_request.update(zip(batch.rows, result))
        prefills = [new] if self.batched else [[r] for r in new]
        for rows in prefills if new else []:
            batch, result = self._prefill(rows, speculate)
            if result is not None:
                by_request.update(zip(rows, result))
            batches.append(batch)
        with clock("publish"):
            self._publish(mb, launches, by_request, new, speculated)
        for request in sched.cancel_due(mb, launches):
            self._end(self.seqs[request], "cancelled")
        self.step += 1
        return True

    def _publish(self, mb: MicroBatch, launches: list[Launch], by_request: dict[int, stepmsg.SeqUpdate], new: list[int],
                 speculated: bool) -> None:
        """The last stage publishes the round's message (and tells the policy how it went); the others
        post the receive for it."""
        if self.ctx.is_last:
            updates = [stepmsg.SeqUpdate() for _ in range(self.slots)]
            for launch in launches:
                update = by_request[launch.request]
                update.request, update.generation = launch.request, launch.generation
                updates[launch.slot] = update
            self.channel.publish(mb.index, stepmsg.encode(mb.rounds - 1, mb.index, updates, self.k))
            if self.policy is not None:
                verified = [u for r, u in by_request.items() if r not in new]
                self.policy.record(speculated, sum(u.accepted + 1 for u in verified), time.perf_counter(),
                                   prefill=bool(new), rows=len(verified), draft_seconds=self.round_draft_s,
                                   load=self.scheduler.running)
        else:
            self.channel.expect(mb.index)

    def run_step(self) -> None:
        """Turns until one launches a round (or everything is done): empty micro-batches are skipped."""
        while not self.scheduler.done():
            if self._turn():
                return

    def warmup(self) -> float:
        """One throwaway prefill + verify forward (and draft proposals) through the whole pipeline, at
        the batch size the rounds will have.

        A fresh process pays lazy CUDA/cuBLAS initialisation and kernel loading on the first forward of
        each shape; without a warm-up that cost lands in ``tokens_per_s``. Every stage runs the same
        two forwards on a throwaway cache (the hop shapes are known), so no message is needed. With CUDA
        graphs it then captures every micro-batch's verify and plain forwards and the draft's proposals
        for the row counts of ``precapture_sizes`` (the same forwards on every stage), and the step
        channel sends one throwaway message.
        """
        started = time.perf_counter()
        rows = min(self.slots, self.scheduler.capacity) if self.batched else 1
        batch = RowBatch(self.target.new_cache(record_past=self.k > 0), list(range(-rows, 0)), self.ctx.device, self.mask_dtype)
        with torch.inference_mode():
            out = self._forward(batch, [[0, 0]] * rows, [0] * rows)
            if out is not None and self.k:
                batch.draft_cache = self.draft.new_cache(rows, capacity=2 * self.k + 4)
                self._draft(batch, out[1], [[0, 0]] * rows, True)
            batch.resolve([2] * rows)
            out = self._forward(batch, [[0] * (self.k + 1)] * rows, [2] * rows)
            if out is not None and self.k:
                self._draft(batch, out[1], [[0]] * rows, True)
            batch.resolve([3] * rows)
            if out is not None and self.draft_runners:
                self._warm_draft(batch, out[1], rows)
            # Capture the verify (k + 1 tokens) and plain (1 token) forwards of every row count now rather
            # than in the rounds: a capture costs milliseconds, and a short run meets most row counts as
            # its sequences finish (measured on 2x H200: ~25 captures in a 0.7 s run at c = 8).
            for store in self.stores:
                warm = RowBatch(store.adopt(batch.cache), list(batch.rows), self.ctx.device, self.mask_dtype)
                warm.valid = batch.valid.clone()
                for size in precapture_sizes(rows):
                    if size < warm.size:
                        warm.drop(set(warm.rows[size:]))
                    for steps in sorted({self.k + 1, 1}, reverse=True):
                        self._forward(warm, [[0] * steps] * size, [3] * size)
                        warm.resolve([3] * size)  # nothing kept: the slots are cropped again
            if self.sender is not None:
                self.sender.flush()
            self.channel.warm()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.clock = PhaseClock(self.ctx.device)  # the rounds' phases and forwards only
        self.forwards = 0
        return time.perf_counter() - started

    def _warm_draft(self, batch: RowBatch, aux: list[torch.Tensor], rows: int) -> None:
        """Capture every runner's proposals (1 to k + 1 verified positions per row) for the row counts of
        ``precapture_sizes`` on throwaway draft caches; other row counts are captured when they occur."""
        for runner in self.draft_runners:
            for size in precapture_sizes(rows):
                cache = runner.adopt(self.draft.new_cache(size, capacity=runner.capacity))
                for steps in range(1, self.k + 2):
                    features = [a[:size, :1].expand(size, steps, a.shape[-1]).contiguous() for a in aux]
                    ids = torch.zeros(size, steps, dtype=torch.long, device=self.ctx.device)
                    runner.propose(features, ids, cache, num_tokens=self.k)
                    cache.crop(0)

    def run(self) -> float:
        """Decode every sequence to completion; the wall time in seconds."""
        started = time.perf_counter()
        with torch.inference_mode():
            while not self.scheduler.done():
                self.run_step()
            if self.sender is not None:
                self.sender.flush()
            self.channel.close()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.elapsed = time.perf_counter() - started
        return self.elapsed

    def stats(self) -> dict[str, Any]:
        """What this stage did and how long it waited on the others (seconds): ``decode_s`` minus the
        waits is the time the stage was busy, and the busiest stage bounds the pipeline's speed."""
        return {
            "messages_sent": self.sender.messages if self.sender else 0,
            "aux_transport": self.job.aux_transport,
            "overlap_messages_sent": self.overlap.messages if self.overlap else 0,
            "bytes_sent": self.sender.bytes_sent if self.sender else 0,
            "rounds": self.step,
            "forwards": self.forwards,
            "batched": self.batched,
            "decode_s": round(self.elapsed, 4),
            "hop_recv_wait_s": round(self.receiver.waited_s, 4) if self.receiver else 0.0,
            "hop_send_wait_s": round(self.sender.waited_s, 4) if self.sender else 0.0,
            "step_message_wait_s": round(self.channel.waited_s, 4),
            "phase_s": self.clock.to_json(),
            "cuda_graphs": self.graph_mode or "off",
            **({"graphs_captured": sum(g.captured for g in self.graphed.values()),
                "graph_replays": sum(g.replays for g in self.graphed.values()),
                "graph_eager_forwards": sum(g.eager_forwards for g in self.graphed.values())} if self.graphed else {}),
            **({"draft_graphs": sum(r.graphs for r in self.draft_runners),
                "draft_graph_replays": sum(r.replays for r in self.draft_runners),
                "draft_eager_proposals": sum(r.eager_calls for r in self.draft_runners)} if self.draft_runners else {}),
            **({"draft_backlog": self.backlog_cap, "draft_ingests": self.draft_ingests} if self.policy else {}),
        }


POLICY_WARMUP_ROUNDS = 3  # per micro-batch: the speculation policy does not measure a fresh stage's first rounds
PRECAPTURE_MAX_ROWS = 32  # graphs for every row count up to this are captured at warm-up


def precapture_sizes(rows: int) -> list[int]:
    """The row counts whose graphs the warm-up captures, largest first: every count up to
    ``PRECAPTURE_MAX_ROWS``, else only the full micro-batch (the rest when they occur)."""
    return list(range(rows, 0, -1)) if rows <= PRECAPTURE_MAX_ROWS else [rows]


GRAPH_MEMORY_SHARE = 0.5  # the fixed KV buffers may take at most this share of the free device memory


def graphs_fit(setting: str, need: int, free: int) -> GraphMode | None:
    """``"cuda"`` when ``need`` bytes of fixed KV buffers fit ``GRAPH_MEMORY_SHARE`` of ``free``; else None
    for ``--cuda-graphs auto`` (decode eagerly: the growing caches only take what the sequences use) and
    a usage error for ``on``."""
    if need <= GRAPH_MEMORY_SHARE * free:
        return "cuda"
    if setting == "on":
        raise UsageError(
            f"--cuda-graphs on: the fixed KV buffers need {need / 2**30:.2f} GiB, more than half of the "
            f"{free / 2**30:.2f} GiB free; lower --max-num-seqs or --max-new-tokens, or use --cuda-graphs auto/off"
        )
    return None


def graph_mode(setting: str, device: torch.device, batched: bool) -> GraphMode | None:
    """How verify forwards run for ``--cuda-graphs setting``: ``"cuda"`` (graph replays), ``"emulate"``
    (the same fixed-buffer path without graphs, on CPU) or None (eager, growing caches)."""
    if setting == "off" or (setting == "auto" and (device.type != "cuda" or not batched)):
        return None
    if setting not in ("auto", "on"):
        raise UsageError(f"--cuda-graphs {setting!r}: use auto, on or off")
    if not batched:
        raise UsageError("--cuda-graphs on needs a model whose sequences run as rows of one batch (full attention, "
                         "sdpa or eager kernels); this one runs one forward per sequence: use --cuda-graphs auto or off")
    return "cuda" if device.type == "cuda" else "emulate"


def _ragged_counts(rows: list[list[int]]) -> list[int] | None:
    """Per-row token counts when the rows differ in length (host ints: the draft cache then keeps exact
    lengths), None when they are all as long as the padding."""
    counts = [len(r) for r in rows]
    return counts if any(c != max(counts) for c in counts) else None


def wait_for_all_stages_loaded(ctx: StageContext) -> None:
    """The first collective after loading, with the (long) load timeout.

    Stages load independently and at different speeds (no collective while loading); without this
    barrier the first hop of decoding would wait for a slow loader under the short per-step timeout.
    """
    started = time.perf_counter()
    ready = StepBroadcaster(ctx, 1, ctx.world_size - 1)
    ready.broadcast(torch.ones(1, dtype=torch.int64) if ctx.is_last else None, timeout=ctx.load_timeout)
    ctx.log(f"all stages loaded (waited {time.perf_counter() - started:.2f} s)")


def _mean(values: list[int]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


@dataclass
class Prepared:
    """What every stage (and the launcher's pre-check) knows before reading any weight."""

    resolved: Any
    target_info: Any
    draft_info: Any
    aux_layers: tuple[int, ...]


def prepare(job: GenerateJob) -> Prepared:
    """Config, draft config and request checks: JSON and tensor headers only, no weights."""
    from pipespec.engine.draft_checkpoint import TargetInfo, inspect_draft_checkpoint

    resolved = resolve_target(job.target)
    target_info = TargetInfo.from_config(resolved.config)
    vocab = target_info.vocab_size
    for r in job.requests:
        bad = [i for i in r.prompt_ids if i >= vocab]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is outside the target vocabulary (size {vocab})")
    info = None
    aux_layers: tuple[int, ...] = ()
    if job.num_spec_tokens > 0:
        if not job.draft:
            raise UsageError("--num-spec-tokens > 0 needs --draft DIR (or use --num-spec-tokens 0 for plain decoding)")
        info = inspect_draft_checkpoint(job.draft, target_info, job.aux_convention)  # type: ignore[arg-type]
        aux_layers = info.aux_layers
    return Prepared(resolved, target_info, info, aux_layers)


def check_job(job: GenerateJob) -> Any:
    """The launcher's pre-check: refuse an unsupported model, bad draft or impossible layout before
    starting any stage process (each stage repeats these checks itself). Returns the layout plan."""
    from pipespec.engine.target import plan_target
    from pipespec.integrations.transformers.adapt import adapt

    prepared = prepare(job)
    adapted = adapt(prepared.resolved.decoder_cls, prepared.resolved.spec)
    return plan_target(prepared.resolved, adapted, job.pp, job.partition, prepared.aux_layers, job.method)


def stage_main(ctx: StageContext, job: GenerateJob) -> dict[str, Any]:
    """Everything one stage does; returns its stats, plus the outputs on the last stage."""
    from pipespec.engine.draft_checkpoint import load_draft_checkpoint

    if job.pp != ctx.world_size:
        raise UsageError(f"--pp {job.pp} does not match the {ctx.world_size} processes started")
    if ctx.device.type == "cpu":
        torch.set_num_threads(stage_threads(ctx.world_size))
    else:
        configure_cuda_attention()
    dtype = dtype_from_name(job.dtype) if job.dtype else (torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
    k = job.num_spec_tokens
    prepared = prepare(job)
    resolved, target_info, info, aux_layers = prepared.resolved, prepared.target_info, prepared.draft_info, prepared.aux_layers
    if info is not None and ctx.is_last:
        for warning in info.warnings:
            ctx.log(f"warning: {warning}", always=True)
    embed_on_last = bool(info and not info.has_embedding and spec_decode_needs_target_embed(job.method, ctx.world_size, ctx.is_last))
    target = build_target_stage(
        job.target, ctx.rank, ctx.world_size, partition=job.partition, aux_layers=aux_layers, device=ctx.device,
        dtype=dtype, embed_on_last=embed_on_last, method=job.method, resolved=resolved,
    )
    stage = target.stage
    load = target.load
    share = load.bytes_read / load.checkpoint_bytes if load.checkpoint_bytes else 0.0
    ctx.log(
        f"layers [{stage.start_layer}, {stage.end_layer}): read {load.tensors_read} tensors, "
        f"{load.bytes_read / 1e6:.2f} MB of {load.checkpoint_bytes / 1e6:.2f} MB ({share:.0%}) in {load.seconds:.2f} s",
        always=job.verbose,
    )
    draft = None
    draft_stats: dict[str, Any] = {}
    if ctx.is_last and k > 0:
        assert job.draft is not None
        loaded = load_draft_checkpoint(
            job.draft, target_info, aux_convention=job.aux_convention,  # type: ignore[arg-type]
            dtype=dtype, device=ctx.device, target_embed=target.embed,
        )
        draft = loaded.model
        draft_stats = {"draft_format": loaded.info.format, "draft_embedding": loaded.embedding, "draft_bytes_read": loaded.bytes_read}

    eos = frozenset() if job.ignore_eos else eos_token_ids(job.target, resolved.config)
    wait_for_all_stages_loaded(ctx)
    runner = StageRunner(ctx, job, target, draft, eos)
    warmup = runner.warmup()
    with maybe_profile(ctx.rank, ctx.device):  # $PIPESPEC_PROFILE (pipespec.engine.phases)
        elapsed = runner.run()

    stats = {"rank": ctx.rank, "start_layer": stage.start_layer, "end_layer": stage.end_layer, **load.to_json_dict(),
             **runner.stats()}
    result: dict[str, Any] = {"stage": stats}
    if not ctx.is_last:
        return result
    outputs = [
        {"output_ids": s.output, "num_steps": len(s.acceptance) + s.plain_steps, "plain_steps": s.plain_steps,
         "mean_acceptance_length": _mean(s.acceptance),
         "acceptance_lengths": s.acceptance, "finish_reason": s.finish_reason,
         **({"draft_trace": s.trace} if job.trace else {})}
        for s in runner.seqs
    ]
    all_acceptance = [a for s in runner.seqs for a in s.acceptance]
    new_tokens = sum(len(s.output) for s in runner.seqs)
    result["generation"] = {
        "outputs": outputs,
        # Verify steps of the longest-running sequence: with one micro-batch and every sequence admitted
        # at once, the pipeline's step count after the prefill.
        "num_steps": max(len(s.acceptance) + s.plain_steps for s in runner.seqs),
        "spec_policy": job.spec_policy,
        **({"spec_rounds": runner.policy.spec_rounds, "plain_rounds": runner.policy.plain_rounds,
            "policy_switches": runner.policy.switches, "policy_load_changes": runner.policy.load_changes,
            "policy_rates": runner.policy.rates(), "policy_trace": runner.policy.trace()} if runner.policy else {}),
        "batched_forwards": runner.batched,
        "micro_batches": runner.scheduler.num_micro_batches,
        "micro_batches_why": runner.micro_batch_reason,
        "slots_per_micro_batch": runner.slots,
        "max_num_seqs": runner.scheduler.capacity,
        "rounds": runner.step,
        "stale_entries_ignored": runner.scheduler.stale,
        "mean_acceptance_length": _mean(all_acceptance),
        "num_new_tokens": new_tokens,
        "elapsed_s": round(elapsed, 4),
        "warmup_s": round(warmup, 4),
        "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "aux_layers": list(aux_layers),
        "aux_convention": info.aux_convention if info else None,
        "aux_convention_source": info.aux_convention_source if info else None,
        "config_aux_layers": list(info.config_aux_layers) if info and info.config_aux_layers is not None else None,
        "partition": list(target.plan.partition),
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_ids": sorted(eos),
        **draft_stats,
    }
    return result
