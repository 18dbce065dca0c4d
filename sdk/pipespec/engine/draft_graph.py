"""CUDA graphs for the EAGLE3 draft's ``propose``: one graph per shape, replayed on fixed storage.

On a fast GPU the draft is host-bound: a propose launches ~100 small kernels from Python (about 2 ms at
k = 3) for about 0.1 ms of GPU work. ``DraftGraphRunner`` captures the whole propose (the first pass over
the verified positions, then the draft steps) once per shape ``(B, T, num_tokens)`` and replays it::

    from pipespec.engine.draft_graph import DraftGraphRunner

    runner = DraftGraphRunner(draft, max_rows=8, capacity=4096, num_tokens=k, mode="cuda")  # per micro-batch
    cache = runner.adopt(draft.new_cache(rows, capacity=n))      # copied into the runner's storage
    cache = runner.adopt(cache)                                  # already there: the same cache, free
    drafts = runner.propose(aux, next_ids, cache, num_tokens=k, num_valid=counts)   # as Eagle3Draft.propose
    runner.extend(aux, next_ids, cache, num_valid=counts)        # as Eagle3Draft.extend (eager, in place)
    cache = cache.select(keep)                                   # stays adopted, in the same storage
    cache = DraftKVCache.concat([cache, prefilled])              # likewise (the adopted cache first)

A graph reads and writes fixed addresses, so the runner owns the storage: keys/values ``[max_rows,
kv_heads, capacity, head_dim]`` and lengths ``[max_rows]`` (a ``DraftStorage``; an adopted cache holds
views of its first ``B`` rows), and per shape the static inputs (concatenated aux features, ids, counts)
and output. The captured body differs from the eager path only where the eager path's shapes follow
host values: it attends over the whole capacity with the position mask always on (eager narrows to the
longest row), takes the counts from a static device tensor, and advances the lengths in place. The
drafted tokens are the eager path's (the masked-out slots add exact zeros; only the summation order
of the attention may move the last bits of the hidden states). Host lengths are kept after replay as
the eager path keeps them.

``mode="emulate"`` runs the very same captured body again on the static tensors instead of replaying a
graph: the plumbing (static inputs and output, fixed shapes, in-place lengths) is then testable on a
CPU. A cache that is not adopted here, or a shape whose capture fails (warned once, then eager), goes
through ``Eagle3Draft.propose``.

The graphs read the draft's fused weights as they were at capture: in-place updates and reassigned
parameters are noticed (version counters and storages, as ``Eagle3Draft._fused`` checks) and the graphs
recaptured; parameters made inside ``inference_mode`` track no versions, so after updating those in
place call ``reset``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch.nn import functional as F

from pipespec.engine.draft.counts import valid_counts
from pipespec.engine.draft.fused import Fused
from pipespec.engine.draft.kv_cache import DraftKVCache
from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft.storage import DraftStorage

__all__ = ["DraftGraphRunner", "GraphMode"]

GraphMode = Literal["cuda", "emulate"]
_Shape = tuple[int, int, int]  # (rows B, new positions T, drafted tokens)


class _Captured:
    """One captured shape: static inputs and output, the fixed-shape body, its graph, what it reads."""

    def __init__(
        self, feats: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, last_base: torch.Tensor,
        out: torch.Tensor, view: DraftKVCache,
    ) -> None:
        self.feats, self.ids, self.counts, self.last_base, self.out = feats, ids, counts, last_base, out
        self.view = view  # the storage's first B rows (not adopted: the body's private handle on them)
        self.counts_full = True  # counts holds T in every row (nothing to copy for a full round)
        self.body: Callable[[], None] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.keep: tuple[object, ...] = ()  # tensors the graph reads that nothing else may keep alive


class DraftGraphRunner:
    """Graph-captured ``propose`` for the caches adopted into this runner's storage (one per micro-batch).

    ``max_rows``: the most rows an adopted cache may have; ``capacity``: positions per row, fixed (an
    adopted cache never grows: size it for the longest sequence plus the widest update ``T`` plus
    ``num_tokens``); ``num_tokens``: the draft length the engine asks for (others are captured too).
    ``graphs`` counts captures, ``replays`` graph runs, ``eager_calls`` proposes that ran eagerly.
    """

    def __init__(
        self, draft: Eagle3Draft, *, max_rows: int, capacity: int, num_tokens: int, mode: GraphMode,
    ) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"mode must be 'cuda' or 'emulate', got {mode!r}")
        weight = draft.fc.weight
        if mode == "cuda" and weight.device.type != "cuda":
            raise ValueError(f"mode='cuda' needs the draft on a CUDA device; it is on {weight.device} (use 'emulate')")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if capacity < num_tokens + 1:
            raise ValueError(f"capacity {capacity} leaves no room for a verified position plus {num_tokens} drafts")
        layer = draft.midlayer
        self.draft = draft
        self.mode: GraphMode = mode
        self.num_tokens = num_tokens
        self.storage = DraftStorage(
            max_rows, layer.num_kv_heads, layer.head_dim, capacity=capacity, dtype=weight.dtype, device=weight.device,
        )
        self.graphs = 0
        self.replays = 0
        self.eager_calls = 0
        self._captured: dict[_Shape, _Captured] = {}
        self._eager_shapes: set[_Shape] = set()
        self._stamp: tuple[object, ...] | None = None
        self._sources: tuple[torch.Tensor, ...] = ()
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None

    @property
    def max_rows(self) -> int:
        return self.storage.max_rows

    @property
    def capacity(self) -> int:
        return self.storage.capacity

    def adopt(self, cache: DraftKVCache) -> DraftKVCache:
        """``cache``'s rows in this runner's storage (``cache`` itself when already adopted here).

        Only one adopted cache is current: adopting another cache rewrites the rows, and the earlier one
        is refused from then on (adopt a batch's cache once it is the micro-batch's running batch).
        """
        return self.storage.adopt(cache)

    def reset(self) -> None:
        """Drop the captured graphs (they are captured again on use)."""
        self._captured.clear()
        self._stamp = None
        self._sources = ()

    def stats(self) -> dict[str, int]:
        return {"graphs": self.graphs, "replays": self.replays, "eager_calls": self.eager_calls}

    # ------------------------------------------------------------------------------ the engine's calls
    @torch.no_grad()
    def extend(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_valid: torch.Tensor | Sequence[int] | None = None,
    ) -> None:
        """``Eagle3Draft.extend``, eagerly (rare: rounds without speculation); in place on an adopted cache."""
        self.draft.extend(aux, next_ids, cache, num_valid=num_valid)

    @torch.no_grad()
    def propose(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_tokens: int,
        num_valid: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """``Eagle3Draft.propose`` (same inputs, tokens, cache state and host lengths afterwards), replayed
        from a graph when ``cache`` is adopted here.

        Raises ``ValueError`` when the update would not fit the storage's capacity (``max_length + T`` and
        the longest row afterwards ``+ num_tokens - 1`` must fit), as for bad ``num_valid``.
        """
        storage = self.storage
        if (cache._static is not storage or num_tokens < 1 or next_ids.dim() != 2 or next_ids.shape[1] == 0
                or next_ids.shape[0] != cache.batch_size):
            return self._eager(aux, next_ids, cache, num_tokens, num_valid)
        storage.check(cache)
        bsz, steps = next_ids.shape
        shape = (bsz, steps, num_tokens)
        pieces = self._pieces(aux, bsz, steps)
        if pieces is None:
            return self._eager(aux, next_ids, cache, num_tokens, num_valid)
        # Checked before anything is written, on the eager path too (whose reserve would refuse mid-way).
        counts, host_counts, every = self._counts(num_valid, bsz, steps)
        self._check_room(cache, steps, num_tokens, host_counts, every)
        if shape in self._eager_shapes:
            return self._eager(aux, next_ids, cache, num_tokens, num_valid)
        self._check_weights()
        captured = self._captured.get(shape)
        fresh = captured is None
        if captured is None:
            captured = self._make(shape)
        self._load(captured, pieces, next_ids, counts, every)
        if fresh:
            try:
                self._capture(captured, shape)
            except Exception as err:  # any capture failure: this shape runs eagerly
                self._eager_shapes.add(shape)
                warnings.warn(
                    f"DraftGraphRunner: propose for (B={bsz}, T={steps}, num_tokens={num_tokens}) could not be "
                    f"captured ({type(err).__name__}: {err}); that shape runs eagerly from now on",
                    RuntimeWarning, stacklevel=2,
                )
                return self._eager(aux, next_ids, cache, num_tokens, num_valid)
            self._captured[shape] = captured
            self.graphs += 1
        if captured.graph is not None:
            captured.graph.replay()
        else:
            assert captured.body is not None
            captured.body()
        self.replays += 1
        cache._count(steps, host_counts, every=every)
        return captured.out.clone()  # the static output is rewritten by the next replay

    # ------------------------------------------------------------------------------ inputs
    def _eager(
        self,
        aux: Sequence[torch.Tensor] | torch.Tensor,
        next_ids: torch.Tensor,
        cache: DraftKVCache,
        num_tokens: int,
        num_valid: torch.Tensor | Sequence[int] | None,
    ) -> torch.Tensor:
        self.eager_calls += 1
        return self.draft.propose(aux, next_ids, cache, num_tokens=num_tokens, num_valid=num_valid)

    def _pieces(self, aux: Sequence[torch.Tensor] | torch.Tensor, bsz: int, steps: int) -> list[torch.Tensor] | None:
        """The aux tensors when they cover ``[B, T, fc inputs]`` together; None (the eager path says why) if not."""
        pieces = [aux] if isinstance(aux, torch.Tensor) else list(aux)
        if not pieces or any(p.dim() != 3 or tuple(p.shape[:2]) != (bsz, steps) for p in pieces):
            return None
        return pieces if sum(p.shape[2] for p in pieces) == self.draft.fc.in_features else None

    def _counts(
        self, num_valid: torch.Tensor | Sequence[int] | None, bsz: int, steps: int,
    ) -> tuple[torch.Tensor | None, list[int] | None, bool]:
        """(counts to copy into the static tensor or None, host counts when known, every row counts ``T``)."""
        if num_valid is None:
            return None, None, True
        if isinstance(num_valid, torch.Tensor) and num_valid.device.type != "cpu":
            if tuple(num_valid.shape) != (bsz,):
                raise ValueError(f"num_valid has shape {tuple(num_valid.shape)}, expected ({bsz},): one count per row")
            return num_valid, None, False
        parsed = valid_counts(num_valid, bsz, steps, torch.device("cpu"), minimum=1)  # validates; host only
        assert parsed is not None
        if parsed.device is None:
            return None, parsed.host, True
        return parsed.device, parsed.host, False

    def _check_room(
        self, cache: DraftKVCache, steps: int, num_tokens: int, host_counts: list[int] | None, every: bool,
    ) -> None:
        """Every slot the body writes must exist: a graph cannot grow storage (nor be bounds-checked)."""
        longest = cache.max_length
        after = longest + steps
        host = cache._host
        if not every and host is not None and host_counts is not None:
            after = max((n + c for n, c in zip(host, host_counts, strict=True)), default=0)
        needed = max(longest + steps, after + num_tokens - 1)
        if needed > self.capacity:
            raise ValueError(
                f"propose needs {needed} positions per row (longest row {longest}, {steps} new, {num_tokens} "
                f"drafted) but the graph runner's storage holds {self.capacity}; make its capacity at least the "
                "longest sequence plus the widest update plus num_tokens"
            )

    def _check_weights(self) -> None:
        """Recapture after the draft's weights changed (in place or reassigned) since the graphs were made."""
        draft = self.draft
        sources = draft._fused_sources()
        embed = draft._modules.get("embed_tokens")
        if embed is not None:
            sources = (*sources, embed.weight)
        try:
            versions: tuple[int, ...] | None = tuple(s._version for s in sources)
        except RuntimeError:  # inference tensors track no versions (see reset)
            versions = None
        stamp = (tuple(s.data_ptr() for s in sources), versions)
        if stamp != self._stamp:
            self._captured.clear()
            self._stamp = stamp
            self._sources = tuple(s.detach() for s in sources)  # held: no new tensor can take their addresses

    def _make(self, shape: _Shape) -> _Captured:
        bsz, steps, num_tokens = shape
        storage = self.storage
        device, dtype = storage.key.device, storage.key.dtype
        with torch.inference_mode(False):  # plain tensors: written in place inside and outside inference_mode
            return _Captured(
                feats=torch.zeros(bsz, steps, self.draft.fc.in_features, dtype=dtype, device=device),
                ids=torch.zeros(bsz, steps, dtype=torch.long, device=device),
                counts=torch.full((bsz,), steps, dtype=torch.long, device=device),
                last_base=torch.arange(bsz, device=device) * steps - 1,
                out=torch.zeros(bsz, num_tokens, dtype=torch.long, device=device),
                view=DraftKVCache._of(storage.key[:bsz], storage.value[:bsz], storage.lengths[:bsz], 0, None),
            )

    def _load(
        self, captured: _Captured, pieces: list[torch.Tensor], next_ids: torch.Tensor, counts: torch.Tensor | None,
        every: bool,
    ) -> None:
        """Copy this call's inputs into the shape's static tensors (a few copies, no host reads)."""
        feats = captured.feats
        if len(pieces) == 1:
            feats.copy_(pieces[0])
        elif all(p.dtype == feats.dtype for p in pieces):
            torch.cat(pieces, dim=-1, out=feats)
        else:
            start = 0
            for piece in pieces:
                feats[..., start : start + piece.shape[2]].copy_(piece)
                start += piece.shape[2]
        captured.ids.copy_(next_ids)
        if every:
            if not captured.counts_full:
                captured.counts.fill_(next_ids.shape[1])
                captured.counts_full = True
            return
        assert counts is not None
        on_host = counts.device.type == "cpu" and captured.counts.device.type == "cuda"
        captured.counts.copy_(counts.pin_memory() if on_host else counts, non_blocking=on_host)
        captured.counts_full = False

    # ------------------------------------------------------------------------------ capture
    def _capture(self, captured: _Captured, shape: _Shape) -> None:
        """Build the body, run it once as a warm-up (lengths restored), and capture it (cuda mode)."""
        draft, view = self.draft, captured.view
        capacity = view.capacity
        fused = draft._fused()
        # What the body would otherwise make lazily, made here: inside a capture it would land in the graph's
        # pool, and a later eager call could replace it while the graph still reads it.
        view.slot_ids(capacity)
        view._rows(True)
        view._rows(False)
        if draft.__dict__["_rope_fixed"]:
            draft._rope_table(captured.feats, capacity)
        captured.body = body = self._body(fused, captured, shape[2])
        lengths = view.lengths
        saved = lengths.clone()
        try:
            if self.mode == "emulate":
                body()
                return
            with torch.cuda.device(lengths.device):
                main = torch.cuda.current_stream()
                side = torch.cuda.Stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    body()
                main.wait_stream(side)
                lengths.copy_(saved)
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads of the process (e.g. a sender) may keep using CUDA meanwhile.
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    body()
            captured.graph = graph
        finally:
            lengths.copy_(saved)  # the warm-up advanced them; the replay will do it for real
            captured.keep = (fused, draft.__dict__.get("_rope_tab"))

    def _body(self, f: Fused, captured: _Captured, num_tokens: int) -> Callable[[], None]:
        """``Eagle3Draft.propose`` with fixed shapes and addresses: what a graph captures.

        Reads ``feats``, ``ids``, ``counts`` and the storage's rows; writes keys/values at each row's
        length onwards, advances the lengths in place by ``counts`` and the tokens into ``out``.
        """
        draft, view = self.draft, captured.view
        bsz, steps = captured.ids.shape
        capacity = view.capacity
        flat_ids, flat_feats = captured.ids.view(-1), captured.feats.view(bsz * steps, -1)
        counts, last_base, out, lengths = captured.counts, captured.last_base, captured.out, view.lengths

        def body() -> None:
            hidden = F.linear(flat_feats, f.fc)
            positions = lengths if steps == 1 else lengths.unsqueeze(1) + view.slot_ids(steps)
            rows = draft._layer(f, flat_ids, hidden, bsz, steps, positions, view, capacity, True, capacity)
            lengths.add_(counts)
            # Each row's last valid position (clamped as the eager path clamps unvalidated device counts).
            last = rows if steps == 1 else rows.index_select(0, counts.clamp(min=1) + last_base)
            token = draft._greedy(f, last)
            tokens = [token]
            position = lengths
            for i in range(num_tokens - 1):
                if i:
                    position = position + 1
                last = draft._layer(f, token, last, bsz, 1, position, view, capacity, True, capacity)
                token = draft._greedy(f, last)
                tokens.append(token)
            torch.stack(tokens, dim=1, out=out)

        return body
