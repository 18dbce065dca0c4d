"""One stage process of ``pipespec generate``: load this stage, then run greedy EAGLE3 decoding with up
to M micro-batches in flight.

Every stage runs the same schedule over the same replicated state (``pipespec.engine.microbatch``);
only the last stage decides anything, and its per-round message keeps the copies equal.

Sequences are grouped into M micro-batches that take turns (round-robin). A *round* of a micro-batch
runs one target forward for each of its sequences, one sequence after the other through the
pipeline:

Prefill (a sequence's first forward): stage 0 embeds the prompt ``x_0..x_{n-1}`` and runs its layers,
each stage hands its packed ``IntermediateTensors`` to the next, and the last stage takes the greedy
token ``x_n`` from the final logits; the draft reads the aux states of all ``n`` positions paired with
``x_1..x_n`` and proposes ``d_1..d_k``.

Verify (every later forward): for a sequence with ``c`` tokens committed to its KV cache, the pipeline
runs ``[x_n, d_1..d_k]`` at positions ``c..c+k``; the last stage's greedy predictions ``y_0..y_k``
accept the longest prefix with ``d_j == y_{j-1}`` (``a`` drafts) plus the bonus token ``y_a``; the draft
reads the aux states of those ``a + 1`` positions paired with ``d_1..d_a, y_a`` and proposes the next k.

After the round, the last stage publishes one message for the micro-batch (``pipespec.engine.step``:
per slot ``a``, the tokens, the drafts) without waiting for anyone, and goes on with the next
micro-batch; every other stage has posted the receive for it and reads it only when that
micro-batch's turn comes again (M turns later). Then every stage crops each sequence's KV cache to
``c + a + 1`` (dropping the rejected positions) and updates its copy of the state. With M = 1 every
round waits for the previous round's message: the pipeline drains each step.

``k = 0`` is plain pipeline-parallel decoding: one token per round, no draft. Every sequence has its
own KV caches, so sequences accept different numbers of drafts without padding, finish at different
rounds, and leave their slot to a waiting request (``--max-num-seqs``) or to nobody.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipespec.embed import spec_decode_needs_target_embed
from pipespec.engine import step as stepmsg
from pipespec.engine.job import GenerateJob, Request
from pipespec.engine.microbatch import Scheduler, default_micro_batches
from pipespec.engine.target import TargetStage, build_target_stage, resolve_target
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
    trace: list[list[int]] = field(default_factory=list)  # the drafts each verify step checked
    cache: Any = None
    draft_cache: Any = None


THREADS_ENV = "PIPESPEC_THREADS"


def stage_threads(world_size: int) -> int:
    """Intra-op threads per CPU stage: ``$PIPESPEC_THREADS``, else ``$OMP_NUM_THREADS``, else the cores
    split evenly over the stages.

    On a machine whose cores are busy with other work, fewer threads are much faster (idle-spinning
    intra-op threads compete for the same cores): 1 is the setting for that case (``make`` sets
    ``OMP_NUM_THREADS=1``).
    """
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        try:
            threads = int(value)
        except ValueError:
            raise UsageError(f"{name}={value!r} is not an integer") from None
        if threads < 1:
            raise UsageError(f"{name}={threads} must be >= 1")
        return threads
    return max(1, (os.cpu_count() or 1) // world_size)


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
        micro_batches = job.micro_batches or default_micro_batches(ctx.world_size, len(self.seqs), job.max_num_seqs)
        self.scheduler = Scheduler(
            len(self.seqs), micro_batches, max_num_seqs=job.max_num_seqs, cancel_after=[r.cancel_after for r in job.requests]
        )
        longest = max(len(r.prompt_ids) for r in job.requests)
        max_tokens = max(longest, self.k + 1)
        hidden, dtype = target.hidden_size, target.dtype
        # Two send buffers: a stage computes its next forward while the previous one's output travels.
        self.sender = (
            HopSender(ctx, target.send_keys(), hidden, dtype, ctx.rank + 1, (1, max_tokens), depth=2)
            if not ctx.is_last else None
        )
        self.receiver = (
            HopReceiver(ctx, target.receive_keys(), hidden, dtype, ctx.rank - 1, (1, max_tokens)) if not ctx.is_first else None
        )
        # Optional overlap transport for large (prefill-sized) forwards; both ends pick it by the token
        # count of the forward, which every stage knows, so no mode flag travels.
        self.overlap = (
            OverlapTransport(ctx, target.plan, hidden, dtype, has_residual=target.has_residual,
                             max_leading_shape=(1, max_tokens))
            if job.aux_transport == "overlap" and ctx.world_size > 1 and target.plan.aux_layers else None
        )
        self.slots = self.scheduler.slots_per_micro_batch
        self.channel = StepChannel(ctx, stepmsg.message_size(self.slots, self.k), micro_batches)
        self.step = 0  # rounds launched, all micro-batches together
        self.elapsed = 0.0

    # ------------------------------------------------------------------------------ one forward
    def _forward(self, seq: SeqState, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        device = self.ctx.device
        positions = torch.arange(seq.committed, seq.committed + len(tokens), device=device).unsqueeze(0)
        overlap = self.overlap if self.overlap is not None and len(tokens) >= self.job.overlap_min_tokens else None
        if overlap is not None and not self.ctx.is_last:
            overlap.attach(self.target.decoder)
        try:
            if self.ctx.is_first:
                ids = torch.tensor([tokens], dtype=torch.long, device=device)
                out = self.target.forward(seq.cache, positions, input_ids=ids)
            else:
                assert self.receiver is not None
                received = overlap.recv((1, len(tokens))) if overlap else self.receiver.recv((1, len(tokens)))
                out = self.target.forward(seq.cache, positions, received=received)
            if self.sender is not None:
                assert not isinstance(out, tuple)
                (overlap or self.sender).send(out)
                return None
        finally:
            if overlap is not None and not self.ctx.is_last:
                overlap.detach(self.target.decoder)
        assert isinstance(out, tuple)
        return out

    def _cut(self, seq: SeqState, produced: list[int]) -> tuple[int, bool]:
        """How many produced tokens to keep (EOS, budget) and whether the sequence is finished."""
        room = seq.request.max_new_tokens - len(seq.output)
        kept = min(len(produced), room)
        for i, tok in enumerate(produced[:kept]):
            if tok in self.eos:
                return i + 1, True
        return kept, len(seq.output) + kept >= seq.request.max_new_tokens

    def _propose(self, seq: SeqState, aux: list[torch.Tensor], next_ids: list[int]) -> list[int]:
        ids = torch.tensor([next_ids], dtype=torch.long, device=self.ctx.device)
        drafts = self.draft.propose(aux, ids, seq.draft_cache, num_tokens=self.k)
        return [int(t) for t in drafts[0].tolist()]

    # ------------------------------------------------------------------------------ one sequence
    def _prefill_one(self, seq: SeqState) -> stepmsg.SeqUpdate | None:
        prompt = list(seq.request.prompt_ids)
        out = self._forward(seq, prompt)
        if out is None:
            return None
        logits, aux = out
        first = int(logits[0, -1].argmax())
        kept, done = self._cut(seq, [first])
        drafts = self._propose(seq, aux, prompt[1:] + [first]) if self.k and not done else []
        return stepmsg.SeqUpdate(ran=True, done=done, accepted=0, tokens=[first], kept=kept, drafts=drafts)

    def _verify_one(self, seq: SeqState) -> stepmsg.SeqUpdate | None:
        out = self._forward(seq, [seq.pending, *seq.drafts])
        if out is None:
            return None
        logits, aux = out
        predicted = logits[0].argmax(dim=-1).tolist()
        accepted = 0
        while accepted < self.k and seq.drafts[accepted] == predicted[accepted]:
            accepted += 1
        produced = seq.drafts[:accepted] + [int(predicted[accepted])]
        kept, done = self._cut(seq, produced)
        drafts = []
        if self.k and not done:
            drafts = self._propose(seq, [a[:, : accepted + 1] for a in aux], produced)
        return stepmsg.SeqUpdate(ran=True, done=done, accepted=accepted, tokens=produced, kept=kept, drafts=drafts)

    def _start(self, seq: SeqState) -> None:
        """Fresh KV caches for a sequence about to be prefilled."""
        seq.cache = self.target.new_cache()
        if self.ctx.is_last and self.k:
            capacity = len(seq.request.prompt_ids) + seq.request.max_new_tokens + self.k + 1
            seq.draft_cache = self.draft.new_cache(1, capacity=capacity)

    def _apply(self, seq: SeqState, u: stepmsg.SeqUpdate) -> None:
        prefill = seq.committed == 0
        if prefill:
            seq.committed = len(seq.request.prompt_ids)
        else:
            seq.committed += u.accepted + 1
            seq.acceptance.append(u.accepted + 1)
            if self.job.trace:  # only kept when asked for: it grows with every step
                seq.trace.append(list(seq.drafts))
        seq.output.extend(u.tokens[: u.kept])
        seq.pending = u.tokens[-1]
        seq.drafts = list(u.drafts)
        if u.done:
            self._end(seq, "stop" if seq.output and seq.output[-1] in self.eos else "length")
        elif not prefill:
            seq.cache.crop(seq.committed)

    def _end(self, seq: SeqState, reason: str) -> None:
        seq.done, seq.finish_reason = True, reason
        seq.cache = seq.draft_cache = None  # free the KV memory at once

    # ------------------------------------------------------------------------------ the schedule
    def _turn(self) -> bool:
        """One turn of the round-robin: consume, admit, launch, cancel. True if a round was launched."""
        sched = self.scheduler
        mb = sched.next_micro_batch()
        if mb.awaiting:
            message = self.channel.take(mb.index)
            updates = stepmsg.decode(message, mb.rounds - 1, mb.index, self.slots, self.k)
            for request, update in sched.consume(mb, updates):
                self._apply(self.seqs[request], update)
        sched.admit(mb)
        launches = sched.launch(mb)
        if not launches:
            return False
        updates = [stepmsg.SeqUpdate() for _ in range(self.slots)]
        for launch in launches:
            seq = self.seqs[launch.request]
            if seq.committed == 0:
                self._start(seq)
                update = self._prefill_one(seq)
            else:
                update = self._verify_one(seq)
            if update is not None:
                update.request, update.generation = launch.request, launch.generation
                updates[launch.slot] = update
        if self.ctx.is_last:
            self.channel.publish(mb.index, stepmsg.encode(mb.rounds - 1, mb.index, updates, self.k))
        else:
            self.channel.expect(mb.index)
        for request in sched.cancel_due(mb, launches):
            self._end(self.seqs[request], "cancelled")
        self.step += 1
        return True

    def run_step(self) -> None:
        """Turns until one launches a round (or everything is done): empty micro-batches are skipped."""
        while not self.scheduler.done():
            if self._turn():
                return

    def warmup(self) -> float:
        """One throwaway prefill + verify forward (and draft proposals) through the whole pipeline.

        A fresh process pays lazy CUDA/cuBLAS initialisation and kernel loading on the first forward of
        each shape; without a warm-up that cost lands in ``tokens_per_s``. Every stage runs the same
        two forwards on a throwaway cache (the hop shapes are known), so no message is needed.
        """
        started = time.perf_counter()
        seq = SeqState(Request((0, 0), 1))
        with torch.inference_mode():
            seq.cache = self.target.new_cache()
            if self.ctx.is_last and self.k:
                seq.draft_cache = self.draft.new_cache(1, capacity=2 * self.k + 4)
            out = self._forward(seq, [0, 0])
            if out is not None and self.k:
                self._propose(seq, out[1], [0, 0])
            seq.committed = 2
            out = self._forward(seq, [0] * (self.k + 1))
            if out is not None and self.k:
                self._propose(seq, [a[:, :1] for a in out[1]], [0])
            if self.sender is not None:
                self.sender.flush()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return time.perf_counter() - started

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
            "decode_s": round(self.elapsed, 4),
            "hop_recv_wait_s": round(self.receiver.waited_s, 4) if self.receiver else 0.0,
            "hop_send_wait_s": round(self.sender.waited_s, 4) if self.sender else 0.0,
            "step_message_wait_s": round(self.channel.waited_s, 4),
        }


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
    from pipespec.adapt import adapt
    from pipespec.engine.target import plan_target

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
    elapsed = runner.run()

    stats = {"rank": ctx.rank, "start_layer": stage.start_layer, "end_layer": stage.end_layer, **load.to_json_dict(),
             **runner.stats()}
    result: dict[str, Any] = {"stage": stats}
    if not ctx.is_last:
        return result
    outputs = [
        {"output_ids": s.output, "num_steps": len(s.acceptance), "mean_acceptance_length": _mean(s.acceptance),
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
        "num_steps": max(len(s.acceptance) for s in runner.seqs),
        "micro_batches": runner.scheduler.num_micro_batches,
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
