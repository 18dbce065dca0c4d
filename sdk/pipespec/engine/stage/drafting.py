"""The last stage's drafting: the verified positions into the draft, k drafts out, and the backlog that
rounds without speculation leave for the draft to ingest in one pass.

Must not import the CLI or vllm.
"""

from __future__ import annotations

from typing import Any

import torch

from pipespec.engine.row_batch import RowBatch, pad_rows, to_device
from pipespec.engine.stage.state import StageState


class StageDrafting(StageState):
    """The draft calls of a ``StageRunner`` (last stage, k > 0)."""

    def _draft(self, batch: RowBatch, aux: list[torch.Tensor], next_ids: list[list[int]], speculate: bool) -> list[list[int]]:
        """Give the draft the verified positions of every row (``next_ids[b]``: the tokens that follow
        them, ``aux`` their aux states, padded) and, when speculating, return k drafts per row.

        Not speculating, the positions wait in a backlog (a copy: the aux states may live in a receive
        buffer) that the draft ingests in one pass before it next drafts, or when it grows past
        ``draft_backlog()`` positions: a plain round then costs no draft forward at all. A row's entry is
        the round's copy and its row there, sliced only when ingested (on one H200 at c = 32 slicing 32
        rows every plain round cost 0.1-0.2 ms of a ~3 ms round, and a batch that ends without drafting
        again never needs the slices).
        """
        if not speculate:
            features = torch.cat(aux, dim=-1)  # a copy, [B, T, k * H]
            longest = 0
            for b, (request, row) in enumerate(zip(batch.rows, next_ids)):
                self.backlog.setdefault(request, []).append((features, b, row))
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
        rows = [[t for _, _, ids in entry for t in ids] for entry in entries]
        counts = [len(r) for r in rows]
        sample = next(f for entry in entries for f, _, _ in entry)
        features = sample.new_zeros(batch.size, max(counts), sample.shape[-1])
        for b, entry in enumerate(entries):
            if entry:
                features[b, : counts[b]] = torch.cat([f[row, : len(ids)] for f, row, ids in entry])
        ids = to_device(pad_rows([r or [0] for r in rows]), self.ctx.device)  # a row with nothing new: counts 0
        self._drafter(batch).extend(features, ids, batch.draft_cache, num_valid=_ragged_counts(rows))


def _ragged_counts(rows: list[list[int]]) -> list[int] | None:
    """Per-row token counts when the rows differ in length (host ints: the draft cache then keeps exact
    lengths), None when they are all as long as the padding."""
    counts = [len(r) for r in rows]
    return counts if any(c != max(counts) for c in counts) else None

