"""Overlap transport: send each aux state the moment it is captured, while the stage's later layers run.

Relay (``pipespec.pp.transport``, the default) packs every tensor of a hop into ONE message sent at the
end of the stage's forward. At prefill that message is large (3 aux states of 8k tokens × H=8192 in
bf16 take ~1.1 ms per hop on NVLink) and nothing else happens while it travels. The overlap option
sends an aux state as soon as the adapted forward captures it — asynchronously, so the stage's
remaining layers compute while it travels — and a middle stage forwards the aux states it relays as
soon as they arrive. The final hop message then carries only ``hidden_states`` (+ ``residual``).

Trade-off (see docs/benchmarks.md, P1/P2): overlap wins at prefill sizes, where a state captured early
in the stage hides its transfer behind the later layers; at decode sizes (T ≤ 64) one packed message
beats several small ones (DESIGN.md: three sends 0.09–0.11 ms vs one packed send 0.026 ms on 2×H200),
so relay stays the default and an engine may pick overlap per forward (e.g. for prefills only: both
ends must pick the same mode for the same forward, which they can, since every stage knows the token
count of every forward from the step broadcast).

Wire protocol (no metadata; both ends derive it from the layout plan). A non-last stage ``s`` sends,
to stage ``s + 1``, in this order, each as its own message:

1. the relayed keys ``[0, slot_base_s)`` in slot order (a middle stage sends each as soon as it has
   received it, before its own forward starts);
2. its own keys in slot order, each when the forward captures it — except the *aliased boundary key*:
   an id equal to ``end_s`` is the stage's output ``hidden_states`` itself (models without a separate
   residual), so it is not sent twice; the receiver copies it out of ``hidden_states``. The sender
   checks that the captured tensor really is its output hidden state and refuses otherwise
   (``alias_boundary=False`` turns aliasing off);
3. ``hidden_states`` (+ ``residual``, packed into one message).

The receiver posts matching receives in the same order into one buffer laid out exactly like relay's
(``HopLayout(hop_keys(stage s))``), so the ``IntermediateTensors`` it returns has the same keys, shapes
and values as relay mode's, and the model code cannot tell the two apart.

API (what an engine wires in; one ``OverlapTransport`` per stage process, used for every forward)::

    from pipespec.pp.overlap import OverlapTransport

    hop = OverlapTransport(ctx, plan, hidden_size, dtype, has_residual=False, max_leading_shape=(1, T_max))
    hop.attach(model)                   # non-last stages: captured states go straight to the wire
    ...
    received = hop.recv((B, T)) if not ctx.is_first else None   # relays upstream states on the fly
    out = model(..., intermediate_tensors=received)
    if not ctx.is_last:
        hop.send(out)                   # late own keys (if any) + hidden (+ residual); waits for all sends
    ...
    hop.detach(model)                   # back to plain relay behaviour of the model object

``attach`` installs the model's ``aux_overlap_sink`` (called by ``capture_aux_hidden_state``, which
vLLM-dialect generated code uses) and wraps ``collect_remote_aux_hidden_states`` so that the list an
HF-generated forward appends its captures to reports each append (that code appends directly).
A forward that reports no capture at all still works: ``send`` then sends the missing own keys
before ``hidden_states``, in the same wire order (correct, just not overlapped).

On CUDA every send is issued on a side stream that first waits on the compute stream (so it sends the
finished value), the tensor is ``record_stream``-ed on that side stream and kept referenced until
``send`` has waited on its send (so the caching allocator cannot hand its memory to a later layer), and
the compute stream is ordered after the sends only at the end of ``send``. Every wait is marked for the stage watchdog and
raises ``PeerLostError`` naming the peer on failure; on gloo it uses the collective timeout, on NCCL it
is stream-ordered (the relay transport's choice: a timed NCCL wait is a host busy-wait) and bounded by
the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import LayoutPlan, StagePlan
from pipespec.contract.mixin import HIDDEN_KEY, RESIDUAL_KEY, hop_keys
from pipespec.pp.launch import PeerLostError, StageContext
from pipespec.pp.transport import HopLayout

__all__ = ["OverlapHop", "OverlapTransport", "plan_overlap_hop"]


@dataclass(frozen=True)
class OverlapHop:
    """The wire order of one hop (stage ``rank`` → ``rank + 1``) in overlap mode.

    >>> from pipespec.contract.layout import plan_layout
    >>> hop = plan_overlap_hop(plan_layout(8, 2, aux_layers=[2, 4, 7]).stage(0), has_residual=False)
    >>> hop.aux, hop.aliased, hop.base
    (('aux_hidden_states_0',), 'aux_hidden_states_1', ('hidden_states',))
    """

    rank: int
    keys: tuple[str, ...]  # every key the receiver gets: relay's hop_keys, same order, same buffer layout
    aux: tuple[str, ...]  # aux keys sent one message each, in this order (relayed first, then own)
    aliased: str | None  # own boundary key the receiver copies out of hidden_states (never sent)
    base: tuple[str, ...]  # the final packed message: hidden_states (+ residual)
    relayed: tuple[str, ...]  # the subset of ``aux`` the stage passes through from its own input


def plan_overlap_hop(stage: StagePlan, has_residual: bool, alias_boundary: bool = True) -> OverlapHop:
    """The overlap wire order of the hop ``stage`` sends (``stage`` must not be the last one)."""
    if stage.is_last:
        raise ValueError(f"stage {stage.rank} is the last stage: it sends nothing")
    keys = hop_keys(stage, has_residual)
    base = (HIDDEN_KEY, RESIDUAL_KEY) if has_residual else (HIDDEN_KEY,)
    aliased = None
    # With a separate residual the captured value is hidden + residual, a different tensor: send it.
    if alias_boundary and not has_residual and stage.produces and stage.produces[-1] == stage.end_layer:
        aliased = stage.own_keys[-1]
    aux = tuple(k for k in stage.sends if k != aliased)
    return OverlapHop(stage.rank, keys, aux, aliased, base, stage.relays)


class _CaptureList(list):  # type: ignore[type-arg]
    """The list an HF-generated forward appends its captured states to; reports each append."""

    def __init__(self, on_append: Callable[[int, torch.Tensor], None]) -> None:
        super().__init__()
        self._on_append = on_append

    def append(self, value: torch.Tensor) -> None:
        super().append(value)
        self._on_append(len(self) - 1, value)


class OverlapTransport:
    """One stage's end of the overlap protocol: ``recv`` from the previous stage, ``send`` to the next.

    ``max_leading_shape`` sizes the receive buffer once (the largest ``(B, T)`` announced up front); it
    grows if a larger forward comes. Counters: ``messages`` and ``bytes_sent`` (what this stage sent).
    """

    def __init__(
        self, ctx: StageContext, plan: LayoutPlan, hidden_size: int, dtype: torch.dtype, *,
        has_residual: bool = False, max_leading_shape: Sequence[int] = (1, 1), alias_boundary: bool = True,
    ) -> None:
        if plan.pp_size != ctx.world_size:
            raise ValueError(f"the layout plans {plan.pp_size} stages but the world has {ctx.world_size} processes")
        self.ctx, self.plan, self.hidden_size, self.dtype = ctx, plan, hidden_size, dtype
        self.stage = plan.stage(ctx.rank)
        self.device = ctx.device
        self.out_hop = None if self.stage.is_last else plan_overlap_hop(self.stage, has_residual, alias_boundary)
        self.in_hop = None if self.stage.is_first else plan_overlap_hop(plan.stage(ctx.rank - 1), has_residual, alias_boundary)
        self.in_layout = HopLayout(self.in_hop.keys, hidden_size) if self.in_hop else None
        self._recv_buffer = (
            torch.empty(self.in_layout.numel(max_leading_shape), dtype=dtype, device=self.device) if self.in_layout else None
        )
        self.base_layout = HopLayout(self.out_hop.base, hidden_size) if self.out_hop else None
        self._base_buffer: torch.Tensor | None = None
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.out_hop else None
        self._pending: list[tuple[Any, torch.Tensor, str]] = []
        self._captured: dict[str, torch.Tensor] = {}
        self._sent: set[str] = set()
        self.messages = 0
        self.messages_received = 0
        self.bytes_sent = 0

    # ------------------------------------------------------------------------------ model side
    def attach(self, model: nn.Module) -> None:
        """Make ``model`` hand each captured aux state to this transport (non-last stages; else a no-op)."""
        mine = getattr(model, "pipespec_stage", None)
        if mine != self.stage:
            raise ValueError(
                f"the model is configured as {mine} but this transport is stage {self.stage.rank} of the plan "
                f"{self.plan.to_json_dict()}: call set_pipeline_stage / set_aux_hidden_state_layers first"
            )
        if self.out_hop is None:
            return
        own = self.stage.own_keys
        original = type(model).collect_remote_aux_hidden_states.__get__(model)

        def collect(intermediate_tensors: Mapping[str, torch.Tensor] | None) -> list[torch.Tensor]:
            remote = original(intermediate_tensors)
            if remote:  # a stage that collects is the last one: nothing to overlap
                return remote
            return _CaptureList(lambda i, value: self.capture(own[i], value) if i < len(own) else None)

        model.__dict__["collect_remote_aux_hidden_states"] = collect
        model.__dict__["aux_overlap_sink"] = self.capture

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Undo ``attach``: the model captures into plain lists again and has no sink."""
        model.__dict__.pop("collect_remote_aux_hidden_states", None)
        model.__dict__.pop("aux_overlap_sink", None)

    def capture(self, key: str, value: torch.Tensor) -> None:
        """The sink: start sending ``value`` under ``key`` now (the aliased boundary key is only noted)."""
        hop = self.out_hop
        if hop is None or self._captured.get(key) is value:
            return  # the sink and the capture list both report a capture_aux_hidden_state call
        self._captured[key] = value
        if key != hop.aliased:
            self._isend(key, value)

    # ------------------------------------------------------------------------------ receiving
    def recv(self, leading_shape: Sequence[int]) -> IntermediateTensors:
        """This forward's tensors from the previous stage, keyed like relay mode's (views valid until
        the next ``recv``). A middle stage sends each relayed key on as soon as it has arrived."""
        hop, layout = self.in_hop, self.in_layout
        if hop is None or layout is None:
            raise RuntimeError(f"stage {self.stage.rank} is the first stage: it receives nothing")
        leading = tuple(int(n) for n in leading_shape)
        numel = layout.numel(leading)
        assert self._recv_buffer is not None
        if numel > self._recv_buffer.numel():
            self._recv_buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
        flat = self._recv_buffer[:numel]
        tensors = layout.unpack(flat, leading)
        src = self.ctx.rank - 1
        posted = []
        for key in (*hop.aux, "base"):
            if key == "base":
                # hidden_states (+ residual) sit back to back at the start of the relay layout.
                view = flat[: len(hop.base) * layout.block(leading)]
            else:
                view = tensors[key].view(-1)
            what = f"receiving {key if key != 'base' else '+'.join(hop.base)} {leading} from stage {src} (overlap)"
            posted.append((key, self._post(lambda v=view: dist.irecv(v, src), what), what))
        for key, work, what in posted:
            self._wait(work, what)
            if key != "base" and key in self.stage.relays:
                self._isend(key, tensors[key])
        if hop.aliased is not None:
            # The previous stage's boundary id is its output hidden_states: rebuild the slot, not the wire.
            tensors[hop.aliased].copy_(tensors[HIDDEN_KEY])
            if hop.aliased in self.stage.relays:
                self._isend(hop.aliased, tensors[hop.aliased])
        self.messages_received += len(posted)
        return tensors

    # ------------------------------------------------------------------------------ sending
    def send(self, out: Mapping[str, torch.Tensor]) -> None:
        """Finish this forward's hop: own keys the forward did not report, then hidden (+ residual);
        returns when every send of the forward has completed (the buffers may then be reused)."""
        hop = self.out_hop
        if hop is None:
            raise RuntimeError(f"stage {self.stage.rank} is the last stage: it sends nothing")
        try:
            hidden = out[HIDDEN_KEY]
            for key in hop.aux:
                if key in self._sent:
                    continue
                if key in hop.relayed:
                    raise RuntimeError(f"relayed key {key!r} was not sent on: call recv() before the forward")
                self._isend(key, self._value(out, key))  # the forward did not report it: send it late
            if hop.aliased is not None:
                captured = self._captured.get(hop.aliased, self._value(out, hop.aliased))
                if not _same_tensor(captured, hidden) or not _same_tensor(self._value(out, hop.aliased), hidden):
                    raise RuntimeError(
                        f"overlap transport: {hop.aliased!r} (aux id {self.stage.end_layer}, the stage boundary) is not "
                        "the stage's output hidden_states tensor, so it cannot be rebuilt from it on the next stage; "
                        "construct OverlapTransport(..., alias_boundary=False)"
                    )
            leading = tuple(hidden.shape[:-1])
            if len(hop.base) == 1 and hidden.is_contiguous() and hidden.dtype == self.dtype:
                self._isend(HIDDEN_KEY, hidden)  # one tensor: send it as it is, no packing copy
            else:
                assert self.base_layout is not None
                numel = self.base_layout.numel(leading)
                if self._base_buffer is None or self._base_buffer.numel() < numel:
                    self._base_buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
                flat = self._base_buffer[:numel]
                self.base_layout.pack_into(flat, out, leading)
                self._isend("+".join(hop.base), flat, check=False)
            self._wait_pending()
        finally:
            self._captured.clear()
            self._sent.clear()

    def _value(self, out: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
        if key not in out:
            raise RuntimeError(f"cannot send {key!r} to the next stage: the stage output has keys {sorted(out.keys())}")
        return out[key]

    def _isend(self, key: str, tensor: torch.Tensor, check: bool = True) -> None:
        dst = self.ctx.rank + 1
        if check:
            expected = tensor.shape[-1] == self.hidden_size and tensor.dtype == self.dtype
            if not expected:
                raise RuntimeError(
                    f"cannot send {key!r}: shape {tuple(tensor.shape)} {tensor.dtype}, the hop carries "
                    f"[..., {self.hidden_size}] {self.dtype}"
                )
        t = tensor if tensor.is_contiguous() else tensor.contiguous()
        what = f"sending {key} {tuple(t.shape[:-1]) if check else ''} to stage {dst} (overlap)"
        if self._side is not None:
            # The side stream waits for the compute stream's work so far (the value is final), the send
            # runs behind it, and the compute stream goes on with the next layers.
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                work = self._post(lambda: dist.isend(t, dst), what)
            t.record_stream(self._side)
        else:
            work = self._post(lambda: dist.isend(t, dst), what)
        self._pending.append((work, t, what))  # keeps ``t`` alive until its send completed
        self._sent.add(key)
        self.messages += 1
        self.bytes_sent += t.numel() * t.element_size()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, []
        for work, _tensor, what in pending:
            self._wait(work, what)

    # ------------------------------------------------------------------------------ errors
    def _post(self, call: Callable[[], Any], what: str) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistBackendError subclasses
            raise self._lost(what, exc) from exc

    def _wait(self, work: Any, what: str) -> None:
        try:
            with self.ctx.waiting(what):
                if work is None:
                    pass
                elif self.ctx.backend == "nccl":
                    # As the relay transport does: a timed NCCL wait busy-waits the host; a plain wait orders
                    # the current stream after the op (so buffers are reused only after it), and a hang is
                    # bounded by the process group's timeout and the stage watchdog.
                    work.wait()
                else:
                    work.wait(self.ctx.timeout)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(what, exc) from exc

    def _lost(self, what: str, exc: BaseException) -> PeerLostError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return PeerLostError(f"{what} failed ({first}){self.ctx.first_lost_peer(what + ' failed')}")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same storage, offset, shape and strides (identity without comparing values)."""
    return a is b or (
        a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        and a.dtype == b.dtype
    )
