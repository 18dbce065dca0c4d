"""Model-side contract: what an adapted ``forward`` calls to capture, pack and collect aux states.

A model class gains these methods by inheriting ``AuxHiddenStatesMixin`` (generated code and the
``pipespec.adapt`` runtime path add it). State lives on the instance: each stage process configures
its own model with ``set_pipeline_stage`` and ``set_aux_hidden_state_layers``; two models in one
process never share a plan. Planning happens there, once; ``forward`` only reads cached attributes.

An adapted forward looks like::

    aux = self.collect_remote_aux_hidden_states(intermediate_tensors)  # last stage, else []
    if self.aux_capture_input:                                         # id 0, stage 0
        aux.append(hidden_states)
    for idx in range(self.start_layer, self.end_layer):
        hidden_states = self.layers[idx](hidden_states, ...)
        if idx in self.aux_capture_after_layers:                        # id idx + 1
            aux.append(hidden_states)
    if not self.is_last_stage:
        return IntermediateTensors({"hidden_states": hidden_states}
                                   | self.pack_local_aux_hidden_states(local_aux)) ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import LayoutPlan, StagePlan, plan_layout
from pipespec.contract.names import AUX_KEY_PREFIX
from pipespec.errors import LayoutError

HIDDEN_KEY = "hidden_states"
RESIDUAL_KEY = "residual"


def aux_hidden_state_relay_keys(stage: StagePlan) -> tuple[str, ...]:
    """Keys a stage passes through from its input to its output (empty on the first and last stage)."""
    return stage.relays


def hop_keys(stage: StagePlan, has_residual: bool) -> tuple[str, ...]:
    """Every key ``stage`` sends to the next one, in a fixed order both sides derive from the plan."""
    base = (HIDDEN_KEY, RESIDUAL_KEY) if has_residual else (HIDDEN_KEY,)
    return base + stage.sends


def tensor_mapping(tensors: object) -> Mapping[str, torch.Tensor] | None:
    """The ``key -> tensor`` mapping of stage tensors: pipespec's ``IntermediateTensors`` (a Mapping) or
    vLLM's (not one: ``key in it`` and iteration do not work, its dict is ``.tensors``), or a plain dict."""
    if tensors is None:
        return None
    inner = getattr(tensors, "tensors", None)
    if not isinstance(tensors, Mapping) and isinstance(inner, Mapping):
        return inner
    if isinstance(tensors, Mapping):
        return tensors
    raise TypeError(f"expected intermediate tensors (a mapping or an object with .tensors), got {type(tensors).__name__}")


def merge_tensors(tensors: IntermediateTensors, extra: Mapping[str, torch.Tensor]) -> IntermediateTensors:
    """``tensors`` plus ``extra``, of the same type (vLLM's ``IntermediateTensors`` has no ``|``)."""
    if isinstance(tensors, Mapping):
        return tensors | extra
    own = tensor_mapping(tensors)
    assert own is not None
    return type(tensors)({**own, **extra})  # type: ignore[call-arg]


def reserve_aux_intermediate_tensor_slots(
    tensors: IntermediateTensors, stage: StagePlan, like: str = HIDDEN_KEY
) -> IntermediateTensors:
    """Add the aux receive slots ``stage`` gets from its predecessor, shaped like ``tensors[like]``."""
    present = tensor_mapping(tensors)
    assert present is not None
    template = present[like]
    extra = {key: torch.zeros_like(template) for key in stage.receives if key not in present}
    return merge_tensors(tensors, extra)


def relay_aux_hidden_states(
    received: Mapping[str, torch.Tensor] | None, outgoing: IntermediateTensors, relay_keys: Sequence[str]
) -> IntermediateTensors:
    """Merge the upstream aux states this stage passes through into what it sends on."""
    if not relay_keys:
        return outgoing
    received = tensor_mapping(received)
    if received is None:
        raise RuntimeError(f"stage must relay {list(relay_keys)} but received no intermediate tensors")
    missing = [k for k in relay_keys if k not in received]
    if missing:
        raise RuntimeError(f"cannot relay aux hidden state {missing[0]!r}: keys present are {sorted(received.keys())}")
    check_received_aux_shapes(received, relay_keys)
    return merge_tensors(outgoing, {k: received[k] for k in relay_keys})


def check_received_aux_shapes(received: Mapping[str, torch.Tensor], keys: Sequence[str]) -> None:
    """Every aux state of a hop has the shape of the hop's ``hidden_states``; refuse one that does not.

    A wrong shape means the two stages disagree on the hop layout (ids, partition, token count or hidden
    size); passed on silently it would reach the draft as a wrong-sized input or a misleading error.
    """
    received = tensor_mapping(received)
    hidden = received.get(HIDDEN_KEY) if received is not None else None
    if received is None or hidden is None:
        return
    for key in keys:
        shape = received[key].shape
        if shape != hidden.shape:
            raise RuntimeError(
                f"aux hidden state {key!r} from the previous stage has shape {list(shape)} but its hidden_states has "
                f"{list(hidden.shape)}: the stages disagree on the hop layout (aux ids, partition, tokens or hidden size)"
            )


class AuxHiddenStatesMixin:
    """Aux-state capture/pack/collect for one pipeline stage of a decoder stack.

    Class attributes a spec (or generated code) sets:

    * ``pipespec_num_layers_key`` — the config key holding N;
    * ``pipespec_has_residual`` — whether stage hand-offs carry a separate ``residual``.
    """

    pipespec_num_layers_key: ClassVar[str] = "num_hidden_layers"
    pipespec_has_residual: ClassVar[bool] = False
    AUX_HIDDEN_STATE_KEY: ClassVar[str] = AUX_KEY_PREFIX

    # Per-instance state; the class-level defaults describe an unconfigured single-stage model.
    _pipespec_pp: tuple[int, int, tuple[int, ...] | None] | None = None
    _pipespec_aux_ids: tuple[int, ...] = ()
    _pipespec_layout: LayoutPlan | None = None
    _pipespec_stage: StagePlan | None = None
    _pipespec_boundary_rule: str = "allow"
    # ``[start, end)`` the module materialised its layers for (vLLM's ``make_layers``), when it did so
    # itself; generated vLLM-dialect code sets it. The stage plan must agree, else forward would run
    # layers this module does not hold.
    pipespec_built_layer_range: tuple[int, int] | None = None

    # Cached for forward: plain attributes, no planning or host sync on the hot path.
    aux_capture_input: bool = False
    aux_capture_after_layers: frozenset[int] = frozenset()

    # ----------------------------------------------------------------- configuration (called once)
    def pipespec_num_layers(self) -> int:
        config: Any = getattr(self, "config", None)
        value = getattr(config, self.pipespec_num_layers_key, None) if config is not None else None
        if value is None:
            layers = getattr(self, "layers", None)
            if layers is None:
                raise RuntimeError(
                    f"{type(self).__name__} has no config.{self.pipespec_num_layers_key} and no `layers`: cannot tell N"
                )
            value = len(layers)
        return int(value)

    def set_pipeline_stage(
        self, rank: int, pp_size: int, partition: Sequence[int] | None = None, boundary_rule: str | None = None
    ) -> None:
        """Declare which stage of a ``pp_size``-stage pipeline this module is."""
        self._pipespec_pp = (rank, pp_size, tuple(partition) if partition is not None else None)
        if boundary_rule is not None:
            self._pipespec_boundary_rule = boundary_rule
        self._pipespec_replan()

    def set_aux_hidden_state_layers(self, ids: Iterable[int]) -> None:
        """Set the aux ids the draft needs (input-index convention; deduped and sorted)."""
        self._pipespec_aux_ids = tuple(ids)
        self._pipespec_replan()

    def _pipespec_replan(self) -> None:
        rank, pp_size, partition = self._pipespec_pp or (0, 1, None)
        plan = plan_layout(
            self.pipespec_num_layers(),
            pp_size,
            aux_layers=self._pipespec_aux_ids,
            partition=partition,
            boundary_rule=self._pipespec_boundary_rule,
        )
        stage = plan.stage(rank)
        built = self.pipespec_built_layer_range
        if built is not None and self._pipespec_pp is not None and tuple(built) != (stage.start_layer, stage.end_layer):
            raise LayoutError(
                f"{type(self).__name__} was built with layers [{built[0]}, {built[1]}) but stage {rank} of {pp_size} "
                f"(partition {list(plan.partition)}) owns [{stage.start_layer}, {stage.end_layer}): pass "
                "set_pipeline_stage the rank, pipeline size and partition the model was built with"
            )
        self._pipespec_layout = plan
        self._pipespec_stage = stage
        self.aux_capture_input = stage.capture_input
        self.aux_capture_after_layers = stage.capture_after_layers

    # ------------------------------------------------------------------------- plan accessors
    @property
    def pipespec_layout(self) -> LayoutPlan:
        if self._pipespec_layout is None:
            self._pipespec_replan()
        assert self._pipespec_layout is not None
        return self._pipespec_layout

    @property
    def pipespec_stage(self) -> StagePlan:
        if self._pipespec_stage is None:
            self._pipespec_replan()
        assert self._pipespec_stage is not None
        return self._pipespec_stage

    @property
    def start_layer(self) -> int:
        return self.pipespec_stage.start_layer

    @property
    def end_layer(self) -> int:
        return self.pipespec_stage.end_layer

    @property
    def is_first_stage(self) -> bool:
        return self.pipespec_stage.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.pipespec_stage.is_last

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.pipespec_layout.aux_layers

    @property
    def aux_hidden_state_relay_keys(self) -> tuple[str, ...]:
        return aux_hidden_state_relay_keys(self.pipespec_stage)

    # ------------------------------------------------------------------------ forward helpers
    # Optional overlap sink: ``sink(key, tensor)`` is called the moment a state is captured, so a runtime
    # can start sending it while the stage's remaining layers compute (see docs/engine.md, "overlap").
    aux_overlap_sink: Callable[[str, torch.Tensor], None] | None = None

    def capture_aux_hidden_state(self, local_aux: list[torch.Tensor], value: torch.Tensor) -> None:
        """Record one captured state (in id order) and hand it to the overlap sink, if any."""
        sink = self.aux_overlap_sink
        if sink is not None:
            sink(self.pipespec_stage.own_keys[len(local_aux)], value)
        local_aux.append(value)

    def pack_local_aux_hidden_states(self, states: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Key this stage's captured states (in id order) by their global slots."""
        stage = self.pipespec_stage
        if len(states) != len(stage.produces):
            raise RuntimeError(
                f"stage {stage.rank} captured {len(states)} aux hidden states but produces ids {list(stage.produces)}"
            )
        return dict(zip(stage.own_keys, states))

    def collect_remote_aux_hidden_states(self, intermediate_tensors: Mapping[str, torch.Tensor] | None) -> list[torch.Tensor]:
        """The aux states produced upstream, in id order (a fresh list the caller appends to)."""
        keys = self.pipespec_stage.collects
        if not keys:
            return []
        intermediate_tensors = tensor_mapping(intermediate_tensors)  # vLLM's IntermediateTensors is not a Mapping
        if intermediate_tensors is None:
            raise RuntimeError(f"missing aux hidden state {keys[0]!r}: this stage received no intermediate tensors")
        out = []
        for key in keys:
            if key not in intermediate_tensors:
                raise RuntimeError(
                    f"missing aux hidden state {key!r} in the tensors from the previous stage; "
                    f"keys present: {sorted(intermediate_tensors.keys())}"
                )
            out.append(intermediate_tensors[key])
        check_received_aux_shapes(intermediate_tensors, keys)
        return out

    def relay_aux_hidden_states(
        self, received: Mapping[str, torch.Tensor] | None, outgoing: IntermediateTensors
    ) -> IntermediateTensors:
        return relay_aux_hidden_states(received, outgoing, self.pipespec_stage.relays)

    def make_stage_output(
        self, hidden_states: torch.Tensor, local_aux: Sequence[torch.Tensor],
        received: Mapping[str, torch.Tensor] | None, residual: torch.Tensor | None = None,
    ) -> IntermediateTensors:
        """What a non-last stage returns: hidden (+ residual) + relayed + own aux states."""
        out = IntermediateTensors({HIDDEN_KEY: hidden_states})
        if residual is not None:
            out[RESIDUAL_KEY] = residual
        out = out | self.pack_local_aux_hidden_states(local_aux)
        return self.relay_aux_hidden_states(received, out)

    def make_empty_intermediate_tensors(
        self, leading_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, hidden_size: int | None = None
    ) -> IntermediateTensors:
        """Receive buffers for this stage: exactly the keys the previous stage sends."""
        if hidden_size is None:
            hidden_size = int(getattr(self, "config", None).hidden_size)
        shape = (*leading_shape, hidden_size)
        tensors = IntermediateTensors({HIDDEN_KEY: torch.zeros(shape, dtype=dtype, device=device)})
        if self.pipespec_has_residual:
            tensors[RESIDUAL_KEY] = torch.zeros(shape, dtype=dtype, device=device)
        return reserve_aux_intermediate_tensor_slots(tensors, self.pipespec_stage)
