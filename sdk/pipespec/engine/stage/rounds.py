"""The decode rounds: one forward through this stage, a micro-batch's round (verify + prefill), applying
the last stage's message, and the round-robin schedule of turns.

Must not import the CLI or vllm.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from pipespec.engine import step as stepmsg
from pipespec.engine.cuda_graphs import GraphedForwards
from pipespec.engine.microbatch import Launch, MicroBatch
from pipespec.engine.row_batch import RowBatch
from pipespec.engine.stage.drafting import StageDrafting
from pipespec.engine.stage.state import SeqState


class StageRounds(StageDrafting):
    """A ``StageRunner``'s rounds (see ``pipespec.engine.worker``)."""

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
                now = time.perf_counter()
                with self.clock("policy"):  # the policy's own cost, within ``publish``
                    verified = [(r, u) for r, u in by_request.items() if r not in new]
                    # Each row's tokens left, for the batch-finish view (only ``adaptive`` reads them).
                    seqs = self.seqs
                    per_row = [(r, u.accepted + 1, 0 if u.done else seqs[r].request.max_new_tokens - len(seqs[r].output) - u.kept)
                               for r, u in verified] if self.policy.policy == "adaptive" else None
                    self.policy.record(speculated, sum(u.accepted + 1 for _, u in verified), now,
                                       prefill=bool(new), rows=len(verified), draft_seconds=self.round_draft_s,
                                       load=self.scheduler.running, per_row=per_row, queued=len(self.scheduler.waiting))
        else:
            self.channel.expect(mb.index)

    def run_step(self) -> None:
        """Turns until one launches a round (or everything is done): empty micro-batches are skipped."""
        while not self.scheduler.done():
            if self._turn():
                return

    def run(self) -> float:
        """Decode every sequence to completion; the wall time in seconds.

        Everything alive before the loop (torch, transformers, the model: millions of objects) is moved out
        of the garbage collector's reach for the loop (``gc.freeze``, as vLLM does after start-up): a full
        collection then walks only what the rounds made. Without it one full collection, set off by the
        backlog of rounds without drafts, stalled a plain round at c = 32 on one H200 for 380-450 ms,
        a third of the run, in the ``publish`` phase where the host happened to allocate."""
        gc.collect()
        gc.freeze()
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                while not self.scheduler.done():
                    self.run_step()
                if self.sender is not None:
                    self.sender.flush()
                self.channel.close()
        finally:
            gc.unfreeze()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.elapsed = time.perf_counter() - started
        return self.elapsed

