"""One model over P pipeline ranks inside vLLM, each rank driven the way vLLM's V2 model runner drives it.

Rank side (``run_rank``, in a worker of ``pipespec.integrations.vllm.zoo_workers``, one process per rank
in vLLM's own process groups over gloo):

1. build the model under test (``harness.build``), with ``VLLM_PP_LAYER_PARTITION`` set when an explicit
   partition is asked for (vLLM's own switch; ``get_pp_indices`` reads it);
2. ids set by vLLM's ``set_eagle3_aux_hidden_state_layers`` (called; the draft's config it reads the ids
   from is a stand-in holding ``eagle_aux_hidden_state_layer_ids``), which also reserves the receive slots
   with ``reserve_aux_intermediate_tensor_slots``; ``verify_supports_aux_hidden_states_over_pp`` (called);
   the relay keys by ``PPHandler.configure_aux_hidden_state_relay`` → ``aux_hidden_state_relay_keys``
   (called, on a stand-in for the handler: ``PPHandler.__init__`` makes CUDA streams);
3. a non-first rank receives with ``get_pp_group().recv_tensor_dict`` (the worker's receive) and copies
   into the buffers of ``model.make_empty_intermediate_tensors`` key by key (mirrored from
   ``GPUModelRunner``'s input preparation: a key the buffers hold that was not sent is an error, and so is
   a sent key the buffers do not hold, which the runner would drop);
4. forward (``input_ids`` on the first rank only, as the runner passes them); a non-last rank merges the
   relay with ``PPHandler.relay_aux_hidden_states`` (called) and sends with
   ``get_pp_group().send_tensor_dict`` (the worker's send); the last rank returns its aux states.

Every rank receives exactly once from upstream and sends exactly once downstream, a failure included (a
failed rank drains its input and sends ``FAILED`` on), so one rank's error never leaves another blocked.

Parent side (``run_pipeline``): the ranks' answers checked against ``pipespec.contract.layout.plan_layout``
(layers, receive slots, relay keys, the keys each rank packs and sends) and the last rank's aux states
returned for the caller to compare with its reference (``max_error``).

Imports vLLM only inside the rank-side functions (the zoo's parent process never imports it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipespec.contract.layout import LayoutPlan, plan_layout
from pipespec.contract.names import AUX_KEY_PREFIX
from pipespec.integrations.vllm.harness import NUM_TOKENS, Job, _classes, _forward, build
from pipespec.integrations.vllm.reference_stream import AuxCheckError, aux_of

if TYPE_CHECKING:
    from pipespec.integrations.vllm.zoo_workers import WorkerPool

__all__ = ["FAILED", "PipelineError", "PipelineRun", "max_error", "pp3_ids", "pp3_partition", "run_pipeline", "run_rank"]

#: Key of the message a failed rank sends downstream instead of its tensors (its value: the reason).
FAILED = "pipespec_failed"
#: The speculative method named to vLLM's checks (its messages say it).
METHOD = "eagle3"


def pp3_partition(num_layers: int) -> tuple[int, ...]:
    """An uneven PP=3 partition (vLLM's own tests use even ones): the first half of the layers, one layer in
    the middle, the rest last.

    The first stage owns more than layer 0: vLLM's MoE decoders with a dense first layer
    (``first_k_dense_replace``) look for an MoE layer among their stage's layers at construction and fail,
    in vLLM itself, on a stage that owns layer 0 alone. Solar's skip connections (layers 1 -> 2 and 4 -> 5 in
    the zoo's tiny config) stay inside one stage, as vLLM's Solar needs (it never sends the states it keeps).

    >>> pp3_partition(6), pp3_partition(3), pp3_partition(8)
    ((3, 1, 2), (1, 1, 1), (4, 1, 3))
    """
    if num_layers < 3:
        raise ValueError(f"PP=3 needs at least 3 decoder layers, the model has {num_layers}")
    first = max(1, num_layers // 2)
    return (first, 1, num_layers - first - 1)


def pp3_ids(num_layers: int, partition: Sequence[int]) -> tuple[int, ...]:
    """Aux ids on every stage boundary (each belongs to the upstream stage: the middle rank relays the
    first boundary's and packs the second's), id 0 (the first rank's ``start_layer`` capture) and N.

    >>> pp3_ids(6, (3, 1, 2))
    (0, 3, 4, 6)
    """
    ids = {0, num_layers}
    bound = 0
    for count in partition[:-1]:
        bound += count
        ids.add(bound)
    return tuple(sorted(ids))


# ------------------------------------------------------------------------------------- rank side
@contextlib.contextmanager
def _layer_partition(partition: Sequence[int] | None) -> Iterator[None]:
    """vLLM's ``VLLM_PP_LAYER_PARTITION`` for the duration of one request (unset: vLLM's default rule)."""
    name = "VLLM_PP_LAYER_PARTITION"
    before = os.environ.pop(name, None)
    if partition is not None:
        os.environ[name] = ",".join(map(str, partition))
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


def _stand_in_spec_config(ids: Sequence[int]) -> Any:
    """What ``set_eagle3_aux_hidden_state_layers`` reads of a SpeculativeConfig: the draft's HF config and
    its ``eagle_aux_hidden_state_layer_ids`` (the zoo has no draft model to build a real one from)."""
    hf_config = types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=list(ids))
    return types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf_config))


class _RelayConfig(types.SimpleNamespace):
    """Stand-in for ``PPHandler``: the one attribute its ``configure_aux_hidden_state_relay`` sets and its
    ``relay_aux_hidden_states`` reads."""

    aux_hidden_state_relay_keys: tuple[str, ...] = ()


def _prepare(model: torch.nn.Module, ids: Sequence[int]) -> _RelayConfig:
    """The V2 runner's load-time steps for an EAGLE3 target over PP, by vLLM's own functions."""
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.v1.worker.gpu.pp_utils import PPHandler
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        set_eagle3_aux_hidden_state_layers,
        verify_supports_aux_hidden_states_over_pp,
    )

    set_eagle3_aux_hidden_state_layers(model, _stand_in_spec_config(ids))
    relay = _RelayConfig()
    if get_pp_group().world_size > 1:
        try:
            verify_supports_aux_hidden_states_over_pp(model, METHOD)
        except ValueError as exc:
            raise AuxCheckError(f"vLLM's V2 runner refuses it: {exc} ({_where_vllm_looks(model)})") from None
        PPHandler.configure_aux_hidden_state_relay(relay, model)  # type: ignore[arg-type]
    return relay


def _where_vllm_looks(model: torch.nn.Module) -> str:
    """Which module the V2 runner's helpers take for the decoder (they read the flag, the slot base and the
    hidden size there): ``get_language_model().model``, ``language_model.model``, else ``model.model``."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import _inner_decoder

    inner = _inner_decoder(model)
    found = "nothing" if inner is None else type(inner).__name__
    return (f"its verify_supports_aux_hidden_states_over_pp, reserve_aux_intermediate_tensor_slots and "
            f"aux_hidden_state_relay_keys read the decoder at model.model (or get_language_model().model): "
            f"{found} here, which does not set supports_aux_hidden_states_over_pp")


def _into_buffers(model: torch.nn.Module, received: dict[str, Any], rank: int) -> tuple[Any, list[str]]:
    """The received tensors copied into this rank's receive buffers as the runner copies them."""
    from vllm.sequence import IntermediateTensors

    buffers = model.make_empty_intermediate_tensors(  # type: ignore[operator]
        batch_size=NUM_TOKENS, dtype=torch.float32, device=torch.device("cpu"))
    held = list(buffers.tensors)
    missing = [k for k in held if k not in received]
    if missing:
        raise AuxCheckError(
            f"its receive buffers (make_empty_intermediate_tensors, aux slots reserved by vLLM's "
            f"reserve_aux_intermediate_tensor_slots) hold {', '.join(missing)}, which rank {rank - 1} did not send "
            f"(it sent {', '.join(received) or 'nothing'})")
    dropped = [k for k in received if k not in buffers.tensors]
    if dropped:
        raise AuxCheckError(
            f"rank {rank - 1} sends {', '.join(dropped)}, which its receive buffers do not hold "
            f"(they hold {', '.join(held)}): vLLM's runner would drop {'them' if len(dropped) > 1 else 'it'}")
    absent = [k for k in held if not isinstance(received[k], torch.Tensor)]
    if absent:
        raise AuxCheckError(
            f"rank {rank - 1} sends {', '.join(f'{k} = {type(received[k]).__name__}' for k in absent)} where its "
            "receive buffers hold a tensor, which vLLM's runner cannot copy: this decoder's PP hand-off fails in "
            "vLLM itself, with or without aux states")
    n = NUM_TOKENS
    tensors = {k: v[:n].copy_(received[k][:n]) for k, v in buffers.tensors.items()}
    return IntermediateTensors(tensors), held


def run_rank(job: Job, ids: tuple[int, ...], partition: tuple[int, ...] | None) -> dict[str, Any]:
    """This process's rank of ``job``'s model under test over the PP group (see the module docstring).

    Returns ``{"rank", "start", "end", "receives", "relays", "packed", "sends"}`` (aux keys each: the
    receive slots, vLLM's relay keys, what the model itself packed, what the rank sent after the relay;
    the last rank sends nothing) and, on the last rank, ``"aux"``: its aux states as arrays, in id order.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.pp_utils import PPHandler

    pp = get_pp_group()
    rank = pp.rank_in_group
    received = sent = False
    try:
        with _layer_partition(partition):
            tested_cls, _ = _classes(job)
            built = build(tested_cls, job)
            relay = _prepare(built.model, ids)
            answer: dict[str, Any] = {"rank": rank, "start": int(built.decoder.start_layer),
                                      "end": int(built.decoder.end_layer), "receives": [],
                                      "relays": list(relay.aux_hidden_state_relay_keys), "packed": [], "sends": []}
            intermediate = None
            if not pp.is_first_rank:
                received = True
                got = pp.recv_tensor_dict(all_gather_group=get_tp_group())
                assert got is not None
                if FAILED in got:
                    raise UpstreamFailed(str(got[FAILED]))
                intermediate, held = _into_buffers(built.model, got, rank)
                answer["receives"] = [k for k in held if k.startswith(AUX_KEY_PREFIX)]
            out = _forward(built, intermediate, with_input_ids=pp.is_first_rank)
            if pp.is_last_rank:
                answer["aux"] = [t.numpy() for t in aux_of(out, f"{job.causal_lm} on the last PP rank")]
                return answer
            if not isinstance(out, IntermediateTensors):
                raise AuxCheckError(f"rank {rank} returned {type(out).__name__}, not IntermediateTensors")
            answer["packed"] = [k for k in out.tensors if k.startswith(AUX_KEY_PREFIX)]
            merged = PPHandler.relay_aux_hidden_states(relay, intermediate, out)  # type: ignore[arg-type]
            answer["sends"] = [k for k in merged.tensors if k.startswith(AUX_KEY_PREFIX)]
            sent = True
            pp.send_tensor_dict(merged.tensors, all_gather_group=get_tp_group())
            return answer
    except BaseException as exc:
        if not received and not pp.is_first_rank:
            pp.recv_tensor_dict(all_gather_group=get_tp_group())  # drain: upstream's send completes
        if not sent and not pp.is_last_rank:
            why = str(exc) if isinstance(exc, UpstreamFailed) else f"rank {rank} failed"
            pp.send_tensor_dict({FAILED: why}, all_gather_group=get_tp_group())
        raise


class UpstreamFailed(Exception):
    """An earlier rank failed and sent ``FAILED`` instead of its tensors (its own error is the reason)."""


# ----------------------------------------------------------------------------------- parent side
class PipelineError(Exception):
    """A rank failed, or what the ranks did differs from the plan: the message is the row's reason."""


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """What every rank did, checked against ``plan``; ``aux`` is the last rank's aux states in id order."""

    plan: LayoutPlan
    ranks: tuple[dict[str, Any], ...]

    @property
    def aux(self) -> list[np.ndarray]:
        return list(self.ranks[-1]["aux"])

    def sends(self, rank: int) -> tuple[str, ...]:
        """The aux keys ``rank`` sent, in slot order (a dict's order means nothing on the wire)."""
        return _by_slot(self.ranks[rank]["sends"])


def _by_slot(keys: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(keys, key=lambda k: int(k[len(AUX_KEY_PREFIX):])))


def run_pipeline(pool: WorkerPool, job: Job, ids: Sequence[int], num_layers: int, pp: int,
                 partition: Sequence[int] | None = None) -> PipelineRun:
    """Run ``job``'s model under test over ``pool``'s ``pp`` ranks with aux ``ids`` (``partition``: layer
    counts per stage, None for vLLM's default) and check each rank against ``plan_layout``.

    Raises ``PipelineError`` naming the rank and what differs; values are the caller's to compare
    (``max_error``). Example: ``run_pipeline(pool, job, (0, 3, 4, 6), 6, 3, (3, 1, 2)).sends(1)``
    is ``('aux_hidden_states_0', 'aux_hidden_states_1', 'aux_hidden_states_2')`` when the middle rank relays
    as planned.
    """
    plan = plan_layout(num_layers, pp, ids, partition)
    request = ("rank", (job, plan.aux_layers, None if partition is None else tuple(partition)))
    answers = pool.run(pp, request)
    where = f"PP={pp}" + ("" if partition is None else f" (partition {list(plan.partition)})")
    # rank order: the first rank that failed on its own or differs from its stage's plan is the cause (a
    # rank after it fails on what it received, or reports it upstream)
    for stage, (kind, got) in zip(plan.stages, answers):
        if kind != "ok":
            if str(got).startswith(UpstreamFailed.__name__):
                continue
            raise PipelineError(f"{where} rank {stage.rank}: {got}")
        _compare_rank(stage, got, where, plan.aux_layers)
    if any(kind != "ok" for kind, _ in answers):  # only upstream reports: the failed rank answered none
        raise PipelineError(f"{where}: {'; '.join(f'rank {r}: {a}' for r, (_, a) in enumerate(answers))}")
    ranks = tuple(a for _, a in answers)
    if len(ranks[-1]["aux"]) != len(plan.aux_layers):
        raise PipelineError(f"{where} rank {pp - 1} returned {len(ranks[-1]['aux'])} aux states for ids "
                            f"{list(plan.aux_layers)}")
    return PipelineRun(plan=plan, ranks=ranks)


def _compare_rank(stage: Any, got: dict[str, Any], where: str, ids: tuple[int, ...]) -> None:
    r = stage.rank
    if (got["start"], got["end"]) != (stage.start_layer, stage.end_layer):
        raise PipelineError(f"{where} rank {r} owns layers [{got['start']}, {got['end']}), the layout plan says "
                            f"[{stage.start_layer}, {stage.end_layer})")
    checks = (
        ("reserves receive slots for", got["receives"], stage.receives),
        ("relays (vLLM's aux_hidden_state_relay_keys)", got["relays"], stage.relays),
        ("packs (its own aux states)", got["packed"], stage.own_keys if not stage.is_last else ()),
        ("sends", list(_by_slot(got["sends"])), stage.sends),
    )
    for what, keys, planned in checks:
        if tuple(keys) != tuple(planned):
            raise PipelineError(f"{where} rank {r} {what} {list(keys)}, the layout plan says {list(planned)} "
                                f"(ids {list(ids)})")


def max_error(run: PipelineRun, reference: dict[int, np.ndarray]) -> tuple[int, float]:
    """(id, max abs error) of the last rank's aux state farthest from ``reference`` (shape mismatch and NaN
    count as infinite)."""
    errs = []
    for layer_id, got in zip(run.plan.aux_layers, run.aux):
        want = reference[layer_id]
        err = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
        errs.append((layer_id, err if err == err else float("inf")))
    return max(errs, key=lambda e: e[1])
