"""Pipeline layout planning: which stage owns which layers and which aux-state slots.

Pure arithmetic, no torch. This file is the contract of DESIGN.md in code:

* aux id ``L`` (0 ≤ L ≤ N) is the residual stream entering layer ``L`` (id N: last layer's output);
* stage ``s`` owns layers ``[start_s, end_s)`` and produces the ids ``start_s < L ≤ end_s``
  (stage 0 also produces id 0), so an id on a stage boundary belongs to the upstream stage;
* slot = position of the id in the sorted id list, key = ``aux_hidden_states_{slot}``;
* a non-last stage sends the relayed keys ``[0, slot_base_s)`` then its own keys; the last stage
  collects ``[0, slot_base_last)`` and appends its own.

Example::

    >>> plan = plan_layout(32, 4, aux_layers=[29, 2, 16])
    >>> [(s.start_layer, s.end_layer, s.produces) for s in plan.stages]
    [(0, 8, (2,)), (8, 16, (16,)), (16, 24, ()), (24, 32, (29,))]
    >>> plan.stages[2].sends
    ('aux_hidden_states_0', 'aux_hidden_states_1')
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipespec.contract.names import AUX_KEY_PREFIX
from pipespec.errors import LayoutError

BOUNDARY_RULES = ("allow", "reject-at-stage-end")


def aux_key(slot: int) -> str:
    """Key under which the aux state of ``slot`` travels between stages."""
    return f"{AUX_KEY_PREFIX}{slot}"


def eagle3_default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE3's default aux ids ``(2, N//2, N-3)``, deduplicated, sorted and clipped to ``[0, N]``."""
    _check_num_layers(num_layers)
    return tuple(sorted({min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)}))


def default_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """vLLM's ``get_pp_indices`` rule: ``N // P`` each, the remainder one by one to the stages
    before the last, from the second-to-last backwards.

    >>> default_partition(10, 4)
    (2, 3, 3, 2)
    """
    _check_num_layers(num_layers)
    _check_pp_size(pp_size, num_layers)
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return tuple(counts)


@dataclass(frozen=True)
class StagePlan:
    """What one pipeline stage does with layers and aux states."""

    rank: int
    pp_size: int
    start_layer: int
    end_layer: int
    slot_base: int
    produces: tuple[int, ...]
    sends: tuple[str, ...]
    relays: tuple[str, ...]
    collects: tuple[str, ...]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.pp_size - 1

    @property
    def receives(self) -> tuple[str, ...]:
        """Aux keys the previous stage sends to this one (the receive slots to reserve)."""
        return tuple(aux_key(i) for i in range(self.slot_base)) if self.rank > 0 else ()

    @property
    def own_keys(self) -> tuple[str, ...]:
        return tuple(aux_key(self.slot_base + i) for i in range(len(self.produces)))

    @property
    def capture_input(self) -> bool:
        """True when this stage captures id 0 (what enters layer 0)."""
        return bool(self.produces) and self.produces[0] == 0

    @property
    def capture_after_layers(self) -> frozenset[int]:
        """Global layer indices after which this stage captures a state (id L after layer L-1)."""
        return frozenset(i - 1 for i in self.produces if i > 0)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_layer": self.start_layer,
            "end_layer": self.end_layer,
            "slot_base": self.slot_base,
            "produces": list(self.produces),
            "sends": list(self.sends),
            "relays": list(self.relays),
            "collects": list(self.collects),
        }


@dataclass(frozen=True)
class LayoutPlan:
    """The whole pipeline: the partition and one ``StagePlan`` per rank."""

    num_layers: int
    aux_layers: tuple[int, ...]
    partition: tuple[int, ...]
    boundary_rule: str
    stages: tuple[StagePlan, ...]

    @property
    def pp_size(self) -> int:
        return len(self.stages)

    def stage(self, rank: int) -> StagePlan:
        if not 0 <= rank < self.pp_size:
            raise LayoutError(f"stage rank {rank} is out of range: the pipeline has {self.pp_size} stages (0..{self.pp_size - 1})")
        return self.stages[rank]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "aux_layers": list(self.aux_layers),
            "stages": [s.to_json_dict() for s in self.stages],
        }


def normalize_aux_ids(aux_layers: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """Dedupe and sort aux ids, rejecting any outside ``[0, N]``."""
    ids: set[int] = set()
    for value in aux_layers:
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"aux layer id {value!r} is not an integer: ids are layer indices in 0..{num_layers}")
        if not 0 <= value <= num_layers:
            raise LayoutError(
                f"aux layer id {value} is out of range: ids must satisfy 0 <= id <= num_layers ({num_layers}); "
                f"id {num_layers} is the last layer's output"
            )
        ids.add(value)
    return tuple(sorted(ids))


def plan_layout(
    num_layers: int,
    pp_size: int,
    aux_layers: Iterable[int] = (),
    partition: Sequence[int] | None = None,
    boundary_rule: str = "allow",
    require_aux: bool = False,
) -> LayoutPlan:
    """Plan every stage of a ``pp_size``-stage pipeline over ``num_layers`` decoder layers."""
    _check_num_layers(num_layers)
    _check_pp_size(pp_size, num_layers)
    counts = _check_partition(partition, num_layers, pp_size) if partition is not None else default_partition(num_layers, pp_size)
    if boundary_rule not in BOUNDARY_RULES:
        raise LayoutError(f"boundary rule {boundary_rule!r} is unknown: use one of {', '.join(BOUNDARY_RULES)}")
    ids = normalize_aux_ids(aux_layers, num_layers)
    if require_aux and not ids:
        raise LayoutError("aux capture is on but no aux layer ids were given: pass at least one id in 0..num_layers")

    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    if boundary_rule == "reject-at-stage-end":
        for rank in range(pp_size - 1):
            if bounds[rank + 1] in ids:
                raise LayoutError(
                    f"aux layer id {bounds[rank + 1]} ends stage {rank} (layers [{bounds[rank]}, {bounds[rank + 1]})), "
                    "which the boundary rule reject-at-stage-end forbids: this model's captured value needs the next "
                    "stage's weights; move the id or change the partition"
                )

    stages = []
    for rank in range(pp_size):
        start, end = bounds[rank], bounds[rank + 1]
        lo = 0 if rank == 0 else bisect.bisect_right(ids, start)
        hi = bisect.bisect_right(ids, end)
        produces = ids[lo:hi]
        is_last = rank == pp_size - 1
        upstream = tuple(aux_key(i) for i in range(lo)) if rank > 0 else ()
        own = tuple(aux_key(i) for i in range(lo, hi))
        stages.append(
            StagePlan(
                rank=rank,
                pp_size=pp_size,
                start_layer=start,
                end_layer=end,
                slot_base=lo,
                produces=produces,
                sends=() if is_last else upstream + own,
                relays=() if is_last else upstream,
                collects=upstream if is_last else (),
            )
        )
    return LayoutPlan(num_layers=num_layers, aux_layers=ids, partition=tuple(counts), boundary_rule=boundary_rule, stages=tuple(stages))


def _check_num_layers(num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise LayoutError(f"num_layers {num_layers!r} is invalid: a model needs at least 1 decoder layer")


def _check_pp_size(pp_size: int, num_layers: int) -> None:
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise LayoutError(f"pipeline size {pp_size!r} is invalid: it must be an integer >= 1")
    if pp_size > num_layers:
        raise LayoutError(
            f"pipeline size {pp_size} is larger than num_layers {num_layers}: every stage needs at least one layer"
        )


def _check_partition(partition: Sequence[int], num_layers: int, pp_size: int) -> tuple[int, ...]:
    counts = tuple(partition)
    if len(counts) != pp_size:
        raise LayoutError(f"partition {list(counts)} has {len(counts)} entries but the pipeline has {pp_size} stages: "
                          "give one layer count per stage")
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise LayoutError(f"partition {list(counts)} contains {c!r}: every stage needs a positive integer layer count")
    if sum(counts) != num_layers:
        raise LayoutError(f"partition {list(counts)} sums to {sum(counts)} but the model has {num_layers} layers: "
                          "the counts must add up to num_layers")
    return counts
