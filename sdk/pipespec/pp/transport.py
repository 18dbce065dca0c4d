"""Stage-to-stage transport: ONE message per hop, ONE broadcast per step, no metadata on the wire.

Hop layout. A non-last stage ``s`` sends the keys ``pipespec.contract.mixin.hop_keys(plan.stage(s), has_residual)``
— ``hidden_states``, ``residual`` (vLLM-style models only), the relayed aux keys, then its own aux
keys — packed back to back in that order into one contiguous buffer of ``len(keys) × B × T × H``
elements (one dtype)::

    | hidden_states [B,T,H] | (residual [B,T,H]) | aux_hidden_states_0 [B,T,H] | ... | aux_hidden_states_m [B,T,H] |

Both ends derive the key order from the layout plan and the shape ``(B, T)`` from what they already
know about the step (every stage sees the same broadcast, so it knows how many tokens the next forward
carries). Nothing but the payload crosses the wire, so a decode step costs one send per hop instead of
one per tensor (DESIGN.md: three sends 0.09–0.11 ms vs one packed send 0.026 ms on 2×H200).

Receive buffers are allocated once, sized for the largest forward announced up front (the longest
prompt); the tensors a stage receives are views into that buffer, valid until its next receive. A
sender packs into its own preallocated buffer, so a step allocates nothing on either side.

Every blocking call waits with the collective timeout and is marked for the stage watchdog; a failure
or timeout raises ``PeerLostError`` naming the peer stage.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.errors import UsageError
from pipespec.pp.launch import PeerLostError, StageContext


def _wait(ctx: StageContext, work: dist.Work | None, what: str, timeout: timedelta | None = None) -> None:
    """Wait for one transport call (``timeout``, default the collective timeout), turning a failure or
    timeout into ``PeerLostError``."""
    try:
        with ctx.waiting(what, timeout):
            if work is None:
                pass
            elif ctx.backend == "nccl":
                # NCCL: a wait with an explicit timeout is a *host* busy-wait until the kernel finishes
                # (sleeping between polls), which serialises the CPU with every hop. Plain wait() only
                # orders the current CUDA stream after the op; hangs are bounded by the process
                # group's own timeout (NCCL watchdog) and the stage watchdog.
                work.wait()
            else:
                work.wait(timeout or ctx.timeout)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistBackendError subclasses
        raise _lost(ctx, what, exc) from exc


def _lost(ctx: StageContext, what: str, exc: BaseException) -> PeerLostError:
    """``PeerLostError`` for a failed call; names the pipeline's first loss when this one is an echo."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PeerLostError(f"{what} failed ({first}){ctx.first_lost_peer(what + ' failed')}")


class _FlatBuffer:
    """A 1-D buffer that grows (never shrinks) to the largest size asked for."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.data = torch.empty(max(numel, 1), dtype=dtype, device=device)

    def take(self, numel: int) -> torch.Tensor:
        if numel > self.data.numel():
            self.data = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.data[:numel]


class HopLayout:
    """Where each key of one hop's message lives, for a given number of sequences and tokens.

    >>> lay = HopLayout(("hidden_states", "aux_hidden_states_0"), hidden_size=4)
    >>> lay.numel((1, 3)), lay.offset("aux_hidden_states_0", (1, 3))
    (24, 12)
    """

    def __init__(self, keys: Sequence[str], hidden_size: int) -> None:
        if not keys:
            raise ValueError("a hop carries at least hidden_states")
        self.keys = tuple(keys)
        self.hidden_size = hidden_size

    def block(self, leading_shape: Sequence[int]) -> int:
        return math.prod(leading_shape) * self.hidden_size

    def numel(self, leading_shape: Sequence[int]) -> int:
        return len(self.keys) * self.block(leading_shape)

    def offset(self, key: str, leading_shape: Sequence[int]) -> int:
        return self.keys.index(key) * self.block(leading_shape)

    def unpack(self, flat: torch.Tensor, leading_shape: Sequence[int]) -> IntermediateTensors:
        n = self.block(leading_shape)
        shape = (*leading_shape, self.hidden_size)
        return IntermediateTensors({k: flat[i * n : (i + 1) * n].view(shape) for i, k in enumerate(self.keys)})

    def pack_into(self, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor], leading_shape: Sequence[int]) -> None:
        n = self.block(leading_shape)
        shape = (*leading_shape, self.hidden_size)
        for key in self.keys:
            if key not in tensors:
                raise RuntimeError(
                    f"cannot send {key!r} to the next stage: the stage output has keys {sorted(tensors.keys())}"
                )
            if tuple(tensors[key].shape) != shape:
                raise RuntimeError(f"cannot send {key!r}: shape {tuple(tensors[key].shape)}, the hop layout expects {shape}")
        # One concatenating kernel for every key (not one copy per key): at decode sizes a hop is
        # latency-bound and each extra launch sits on the critical path (3 aux states cost ~40 us more
        # per hop on 2x H200 as separate copies).
        torch.cat([tensors[key].reshape(-1) for key in self.keys], out=flat[: n * len(self.keys)])


class HopSender:
    """Sends one stage's ``IntermediateTensors`` to the next stage as one packed message.

    ``depth`` is how many sends may be in flight at once, each from its own buffer: with 1 every
    ``send`` waits for its message to be taken (the stage cannot run ahead of the next one); with 2 a
    stage packs and sends one forward's output, then computes the next forward while that message
    travels, and waits only when it reuses the buffer two sends later. ``flush`` waits for all.
    """

    def __init__(
        self, ctx: StageContext, keys: Sequence[str], hidden_size: int, dtype: torch.dtype, dst: int,
        max_leading_shape: Sequence[int] = (1, 1), depth: int = 1,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.ctx, self.dst = ctx, dst
        self.layout = HopLayout(keys, hidden_size)
        self.buffers = [_FlatBuffer(self.layout.numel(max_leading_shape), dtype, ctx.device) for _ in range(depth)]
        self.pending: list[tuple[dist.Work, str] | None] = [None] * depth
        self.messages = 0
        self.bytes_sent = 0
        self.waited_s = 0.0

    @property
    def buffer(self) -> _FlatBuffer:
        """The buffer of the next send."""
        return self.buffers[self.messages % len(self.buffers)]

    def _settle(self, index: int) -> None:
        entry = self.pending[index]
        if entry is not None:
            self.pending[index] = None
            started = time.perf_counter()
            _wait(self.ctx, entry[0], entry[1])
            self.waited_s += time.perf_counter() - started

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        index = self.messages % len(self.buffers)
        self._settle(index)  # the buffer's previous message must be gone before it is overwritten
        leading = tuple(tensors[self.layout.keys[0]].shape[:-1])
        flat = self.buffers[index].take(self.layout.numel(leading))
        self.layout.pack_into(flat, tensors, leading)
        what = f"sending {len(self.layout.keys)} tensors {tuple(leading)} to stage {self.dst}"
        try:
            work = dist.isend(flat, self.dst)
        except Exception as exc:  # noqa: BLE001
            raise _lost(self.ctx, what, exc) from exc
        self.pending[index] = (work, what)
        self.messages += 1
        self.bytes_sent += flat.numel() * flat.element_size()
        if len(self.buffers) == 1:
            self._settle(index)

    def flush(self) -> None:
        """Wait until every message sent so far has been taken."""
        for index in range(len(self.buffers)):
            self._settle(index)


class HopReceiver:
    """Receives the previous stage's packed message into a preallocated buffer."""

    def __init__(
        self, ctx: StageContext, keys: Sequence[str], hidden_size: int, dtype: torch.dtype, src: int,
        max_leading_shape: Sequence[int] = (1, 1),
    ) -> None:
        self.ctx, self.src = ctx, src
        self.layout = HopLayout(keys, hidden_size)
        self.buffer = _FlatBuffer(self.layout.numel(max_leading_shape), dtype, ctx.device)
        self.messages = 0
        self.waited_s = 0.0

    def recv(self, leading_shape: Sequence[int]) -> IntermediateTensors:
        """The next message, shaped ``(*leading_shape, H)`` per key (views valid until the next ``recv``)."""
        flat = self.buffer.take(self.layout.numel(leading_shape))
        what = f"receiving {len(self.layout.keys)} tensors {tuple(leading_shape)} from stage {self.src}"
        try:
            work = dist.irecv(flat, self.src)
        except Exception as exc:  # noqa: BLE001
            raise _lost(self.ctx, what, exc) from exc
        started = time.perf_counter()
        _wait(self.ctx, work, what)
        self.waited_s += time.perf_counter() - started
        self.messages += 1
        return self.layout.unpack(flat, leading_shape)


class StepBroadcaster:
    """One fixed-size int64 message per step from the last stage to every stage.

    The size is fixed at construction (both sides compute it from the batch size and k), so the
    broadcast needs no size exchange. The meaning of the fields belongs to the engine
    (``pipespec.engine.step``).
    """

    def __init__(self, ctx: StageContext, numel: int, src: int) -> None:
        self.ctx, self.src = ctx, src
        self.buffer = torch.zeros(numel, dtype=torch.int64, device=ctx.device)
        self.messages = 0

    def broadcast(self, values: torch.Tensor | None = None, timeout: timedelta | None = None) -> torch.Tensor:
        """On ``src`` pass the message; every stage gets it back (a CPU tensor)."""
        if self.ctx.rank == self.src:
            if values is None or values.numel() != self.buffer.numel():
                raise RuntimeError(f"step message must have {self.buffer.numel()} int64 values")
            self.buffer.copy_(values.reshape(-1))
        if self.ctx.world_size > 1:
            what = f"step broadcast from stage {self.src}"
            try:
                work = dist.broadcast(self.buffer, self.src, async_op=True)
            except Exception as exc:  # noqa: BLE001
                raise _lost(self.ctx, what, exc) from exc
            _wait(self.ctx, work, what, timeout)
        self.messages += 1
        return self.buffer.cpu() if self.buffer.device.type != "cpu" else self.buffer.clone()


STEP_BACKEND_ENV = "PIPESPEC_STEP_BACKEND"


def step_backend(stage_backend: str) -> str:
    """The backend of the step messages: ``gloo`` (default), or the stages' own with
    ``$PIPESPEC_STEP_BACKEND=device``."""
    value = os.environ.get(STEP_BACKEND_ENV, "").strip() or "gloo"
    if value not in ("gloo", "device"):
        raise UsageError(f"{STEP_BACKEND_ENV}={value!r}: use gloo (host messages, the default) or device")
    return "gloo" if value == "gloo" else stage_backend


class StepChannel:
    """Fixed-size int64 messages from the last stage to every other stage, one stream per micro-batch,
    that never stall the pipeline.

    With several micro-batches in flight the last stage's message for micro-batch m is needed by the
    other stages only when m comes round again. So the last stage ``publish``-es it asynchronously (one
    ``isend`` per stage, waited for only when m's buffer is reused a round later), every other stage
    posts the matching receive (``expect``) as soon as it has launched m's round, and ``take``-s the
    message when m's turn returns — by then it has usually long arrived. ``take`` on the last stage
    returns what it published, so every stage applies the very same message.

    The messages travel on a process group of their own (created by every stage at construction),
    by default a **gloo** group of host tensors whatever the stages' backend: a message is made and read
    on the host, and on 2x H200 each NCCL send or receive cost ~0.2 ms of host time (plus a copy to and
    from the GPU) against tens of microseconds for gloo. ``$PIPESPEC_STEP_BACKEND=device`` keeps the
    stages' own backend (NCCL on CUDA): then a separate communicator, so a posted receive waiting for the
    last stage never holds up the stage-to-stage hops, and the receives and copies run on a side stream,
    so reading a message never waits for the forwards queued on the compute stream. Messages of one
    micro-batch stay in order (gloo tags them with the micro-batch; NCCL keeps one pair's operations in
    issue order, and every stage issues them in the same schedule order).
    """

    def __init__(self, ctx: StageContext, numel: int, num_streams: int) -> None:
        self.ctx = ctx
        self.src = ctx.world_size - 1
        self.numel = numel
        self.num_streams = num_streams
        self.backend = step_backend(ctx.backend)
        self.group = dist.new_group(backend=self.backend, timeout=ctx.timeout) if ctx.world_size > 1 else None
        device = ctx.device if self.backend == "nccl" else torch.device("cpu")
        self.buffers = [torch.zeros(numel, dtype=torch.int64, device=device) for _ in range(num_streams)]
        self.side = torch.cuda.Stream(ctx.device) if device.type == "cuda" else None
        self.pending: list[list[dist.Work]] = [[] for _ in range(num_streams)]
        self.own: list[torch.Tensor | None] = [None] * num_streams
        self.messages = 0
        self.waited_s = 0.0

    def _stream(self) -> Any:
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _tag(self, stream: int) -> int:
        return stream if self.backend == "gloo" else 0

    def _settle(self, stream: int, what: str) -> None:
        works, self.pending[stream] = self.pending[stream], []
        if works:
            started = time.perf_counter()
            with self._stream():
                for work in works:
                    _wait(self.ctx, work, what)
            self.waited_s += time.perf_counter() - started

    def publish(self, stream: int, values: torch.Tensor) -> None:
        """Last stage: send ``values`` (CPU int64, ``numel`` of them) to every other stage; returns at once."""
        if self.ctx.rank != self.src:
            raise RuntimeError(f"stage {self.ctx.rank} cannot publish: only the last stage ({self.src}) does")
        if values.numel() != self.numel:
            raise RuntimeError(f"step message must have {self.numel} int64 values, got {values.numel()}")
        self.own[stream] = values.reshape(-1).clone()
        self.messages += 1
        if self.group is None:
            return
        what = f"sending micro-batch {stream}'s step message to the other stages"
        self._settle(stream, what)  # its previous message (a round ago) must be gone before the buffer is reused
        with self._stream():
            buffer = self.buffers[stream]
            buffer.copy_(self.own[stream])
            try:
                self.pending[stream] = [
                    dist.isend(buffer, dst, group=self.group, tag=self._tag(stream)) for dst in range(self.src)
                ]
            except Exception as exc:  # noqa: BLE001
                raise _lost(self.ctx, what, exc) from exc

    def expect(self, stream: int) -> None:
        """Other stages: post the receive of ``stream``'s next message (returns at once)."""
        if self.ctx.rank == self.src:
            return
        if self.pending[stream]:
            raise RuntimeError(f"micro-batch {stream}: a step message is already expected and not yet taken")
        what = f"receiving micro-batch {stream}'s step message from stage {self.src}"
        with self._stream():
            try:
                self.pending[stream] = [dist.irecv(self.buffers[stream], self.src, group=self.group, tag=self._tag(stream))]
            except Exception as exc:  # noqa: BLE001
                raise _lost(self.ctx, what, exc) from exc

    def warm(self) -> None:
        """One throwaway message from the last stage to every other stage, before decoding.

        NCCL creates a point-to-point communicator lazily, on a group's first send or receive; measured
        on 2x H200 that cost ~0.1-0.5 s, which would otherwise land in the first decoding rounds (and in
        tokens/s). Every stage calls it once, before any ``publish``/``expect``.
        """
        if self.group is None:
            return
        what = "warming up the step-message channel"
        buffer = torch.zeros(1, dtype=torch.int64, device=self.buffers[0].device)
        with self._stream():
            try:
                if self.ctx.rank == self.src:
                    works = [dist.isend(buffer, dst, group=self.group, tag=self._tag(0)) for dst in range(self.src)]
                else:
                    works = [dist.irecv(buffer, self.src, group=self.group, tag=self._tag(0))]
            except Exception as exc:  # noqa: BLE001
                raise _lost(self.ctx, what, exc) from exc
            for work in works:
                _wait(self.ctx, work, what)
            if self.side is not None:
                self.side.synchronize()

    def take(self, stream: int) -> torch.Tensor:
        """``stream``'s message (a CPU tensor): waits for it on a non-last stage."""
        if self.ctx.rank == self.src:
            own = self.own[stream]
            if own is None:
                raise RuntimeError(f"micro-batch {stream}: no step message was published")
            self.own[stream] = None
            return own
        if not self.pending[stream]:
            raise RuntimeError(f"micro-batch {stream}: no step message was expected")
        what = f"receiving micro-batch {stream}'s step message from stage {self.src}"
        started = time.perf_counter()
        self._settle(stream, what)
        with self.ctx.waiting(what), self._stream():
            values = self.buffers[stream].cpu() if self.side is not None else self.buffers[stream].clone()
        self.waited_s += time.perf_counter() - started
        self.messages += 1
        return values

    def close(self) -> None:
        """Wait for every message published so far to be taken (the last stage, before it exits)."""
        for stream in range(self.num_streams):
            self._settle(stream, f"sending micro-batch {stream}'s step message to the other stages")
