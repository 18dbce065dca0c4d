"""vLLM's Transformers modeling backend under pipespec's aux-state contract: an adapted subclass per class.

vLLM serves an architecture it has no native class for (and, with ``model_impl="transformers"``, any
architecture) through ``vllm.model_executor.models.transformers``: a ``Base`` class wrapping the
transformers model itself. Its EAGLE3 path (vLLM 0.32-0.34, the same code in each) records aux states
with transformers' ``OutputRecorder`` hooks on ``_layer_names[id - 1]``, so a draft asking for id 0
fails at load (``KeyError: -1``), and on a non-last rank its ``forward`` returns
``IntermediateTensors({"hidden_states": ...})`` only: the states it recorded are dropped, and the decoder
has no ``supports_aux_hidden_states_over_pp``, so vLLM refuses EAGLE3 over PP.

``Pipespec<Class>`` (built on first use for each text causal-LM class of the backend, e.g.
``PipespecTransformersForCausalLM``, ``PipespecTransformersMoEForCausalLM``) follows DESIGN.md's
contract instead:

* ``set_aux_hidden_state_layers(ids)`` plans the stage with ``pipespec.contract.layout.plan_layout``
  (vLLM's partition) and records, through the same transformers ``OutputRecorder`` machinery vLLM uses,
  the output of layer ``L - 1`` for every id ``start < L <= end`` this rank produces, and on the first
  rank id 0: what enters layer 0 (the embedding output after any scaling the model applies), read by a
  parameter-free tap module that a forward pre-hook on layer 0 calls with that layer's input;
* ``forward`` on a non-last rank returns ``hidden_states`` plus its own states under
  ``aux_hidden_states_<slot>`` (slot bases from the plan); the last rank reads the upstream slots from
  what it received (a missing key is an error naming the key and the keys present) and returns
  ``(hidden_states, upstream + own)`` in id order. Relaying through middle ranks is the runner's
  (vLLM's ``PPHandler.relay_aux_hidden_states``), as for vLLM's own decoders;
* the wrapped transformers model (the ``.model`` vLLM's runner inspects) carries
  ``supports_aux_hidden_states_over_pp = True``, ``AUX_HIDDEN_STATE_KEY`` and the stage's slot base, which
  is what vLLM's ``verify_supports_aux_hidden_states_over_pp``, ``reserve_aux_intermediate_tensor_slots`` and
  ``aux_hidden_state_relay_keys`` read.

Without a draft (no ``set_aux_hidden_state_layers`` call) ``forward`` is vLLM's own. ``backend_verdict`` is
what ``adapt_at_load.decide`` asks for a class of the backend. The multimodal classes are left to vLLM at
PP = 1 and refused over PP (their decoder is a sub-model whose own capture registry transformers
dispatches separately); pooling classes are not causal LMs.

What depends on the vLLM release (``Base.forward``'s input handling, mirrored; the private ``_layer_names``
map; both the same in 0.32-0.34) is read through ``compat`` (``backend_model_call``, ``backend_layer_names``).
Imports vLLM's Transformers backend lazily (first use of a ``Pipespec*`` class); importing this module
imports torch, pipespec's layout and ``compat`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipespec.contract.layout import StagePlan, plan_layout
from pipespec.contract.names import AUX_KEY_PREFIX, AUX_OVER_PP_FLAG
from pipespec.errors import UsageError
from pipespec.integrations.verdict import Verdict
from pipespec.integrations.vllm import compat

__all__ = ["BACKEND_PACKAGE", "SPEC_LABEL", "BackendVerdict", "TransformersAuxOverPP", "adapted_class",
           "backend_verdict", "is_backend_class", "resolve_backend_class"]

BACKEND_PACKAGE = "vllm.model_executor.models.transformers"
SPEC_LABEL = "transformers backend"
#: Prefix of the adapted classes' names in this module (``Pipespec`` + the backend class's name).
CLASS_PREFIX = "Pipespec"
#: Keys of the states recorded through transformers' output capture: ``pipespec_aux_<id>``.
RECORD_PREFIX = "pipespec_aux_"
TAP_NAME = "pipespec_aux_input_tap"


class AuxInputTap(nn.Module):
    """Identity, called with what enters the first rank's first layer so transformers can record it
    (``OutputRecorder`` records module outputs; the input of layer 0 is no module's output in general:
    Gemma scales the embedding between the lookup and the loop). Holds no parameters."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def _call_tap(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    hidden = args[0] if args else kwargs["hidden_states"]
    getattr(layer, TAP_NAME)(hidden)


class TransformersAuxOverPP:
    """Put before a vLLM Transformers-backend ``*ForCausalLM`` class: aux states per DESIGN.md over PP."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self._pipespec_stage: StagePlan | None = None
        self._pipespec_record_order: tuple[int, ...] = ()
        self._pipespec_record_kwargs: dict[str, bool] = {}
        self._pipespec_release = compat.current()  # the installed vLLM's rules (Base's private parts)
        # What vLLM's runner reads on the decoder (``_inner_decoder(model)`` is ``model.model`` here).
        decoder = self.model  # type: ignore[attr-defined]
        setattr(decoder, AUX_OVER_PP_FLAG, True)
        decoder.AUX_HIDDEN_STATE_KEY = AUX_KEY_PREFIX
        decoder._aux_slot_base_cached = 0

    # --------------------------------------------------------------------------------- planning
    def _stage_plan(self, layers: tuple[int, ...]) -> StagePlan:
        """This rank's ``StagePlan`` for ``layers`` under vLLM's layer partition."""
        from vllm.distributed.utils import get_pp_indices

        n = int(self.text_config.num_hidden_layers)  # type: ignore[attr-defined]
        group = self.pp_group  # type: ignore[attr-defined]
        size, rank = int(group.world_size), int(group.rank_in_group)
        partition = [end - start for start, end in (get_pp_indices(n, r, size) for r in range(size))]
        return plan_layout(n, size, layers, partition=partition).stage(rank)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Record the aux states this rank produces (ids sorted and deduplicated; 0 <= id <= N)."""
        stage = self._stage_plan(tuple(layers))
        if self._pipespec_stage is not None:
            if self._pipespec_stage == stage:
                return
            raise RuntimeError(
                f"{type(self).__name__}: aux hidden-state layers are already {list(self._pipespec_stage.produces)} on "
                f"this rank; transformers installs its capture hooks once, so set them once, before the first forward"
            )
        decoder = self.model  # type: ignore[attr-defined]
        recorders = {f"{RECORD_PREFIX}{i}": self._recorder(decoder, stage, i) for i in stage.produces}
        _install_recorders(decoder, recorders)
        # transformers returns recorded outputs in the order of the model class's capture registry (shared by
        # every instance of the class), so the order is read back rather than assumed.
        flags = decoder._can_record_outputs
        self._pipespec_record_order = tuple(int(k[len(RECORD_PREFIX):]) for k in flags if k in recorders)
        self._pipespec_record_kwargs = {f"output_{k}": True for k in recorders}
        decoder._aux_slot_base_cached = 0 if stage.is_first else stage.slot_base
        self._pipespec_stage = stage

    def _recorder(self, decoder: nn.Module, stage: StagePlan, aux_id: int) -> Any:
        """The ``OutputRecorder`` of id ``aux_id``: layer ``aux_id - 1``'s output, or for id 0 the input tap."""
        from transformers.utils.output_capturing import OutputRecorder

        names = self._pipespec_release.backend_layer_names(self)
        if aux_id == 0:
            layer_name = names[stage.start_layer]
            layer = decoder.get_submodule(layer_name)
            if not hasattr(layer, TAP_NAME):
                layer.add_module(TAP_NAME, AuxInputTap())
                layer.register_forward_pre_hook(_call_tap, with_kwargs=True)
            return OutputRecorder(AuxInputTap, layer_name=f"{layer_name}.{TAP_NAME}")
        layer_name = names[aux_id - 1]
        return OutputRecorder(type(decoder.get_submodule(layer_name)), layer_name=layer_name)

    # ---------------------------------------------------------------------------------- forward
    def collect_remote_aux_hidden_states(self, intermediate_tensors: Any) -> list[torch.Tensor]:
        """On the last rank of a pipeline: the upstream slots ``[0, slot_base)`` from what it received."""
        stage = self._pipespec_stage
        if stage is None or not stage.collects:
            return []
        present = dict(intermediate_tensors.tensors) if intermediate_tensors is not None else {}
        missing = [k for k in stage.collects if k not in present]
        if missing:
            raise RuntimeError(
                f"Missing {missing[0]} from PP intermediate tensors on rank {stage.rank} (keys present: "
                f"{sorted(present)}): the previous rank did not send the aux states the plan gives it"
            )
        return [present[k] for k in stage.collects]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        stage = self._pipespec_stage
        if stage is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)  # type: ignore[misc]
        from vllm.sequence import IntermediateTensors

        remote = self.collect_remote_aux_hidden_states(intermediate_tensors)
        outputs = self._pipespec_release.backend_model_call(self, input_ids, positions, intermediate_tensors,
                                                            inputs_embeds, {**self._pipespec_record_kwargs, **kwargs})
        hidden_states = outputs[0][0, ...]
        local = self._recorded(outputs)
        if not stage.is_last:
            return IntermediateTensors({"hidden_states": hidden_states, **dict(zip(stage.own_keys, local))})
        aux = remote + local
        return (hidden_states, aux) if aux else hidden_states

    def _recorded(self, outputs: tuple[Any, ...]) -> list[torch.Tensor]:
        """This rank's recorded states in id order (batch dimension removed)."""
        stage = self._pipespec_stage
        assert stage is not None
        count = len(self._pipespec_record_order)
        if count == 0:
            return []
        records = outputs[-count:] if len(outputs) > count else ()
        if len(records) != count or not all(isinstance(r, tuple) and len(r) == 1 for r in records):
            raise RuntimeError(
                f"{type(self).__name__}: transformers recorded {len(outputs) - 1} outputs of "
                f"{type(self.model).__name__} for {count} aux ids {list(stage.produces)} (one each expected): "  # type: ignore[attr-defined]
                "its forward does not record outputs through @capture_outputs, or a layer ran more than once"
            )
        by_id = {i: r[0][0, ...] for i, r in zip(self._pipespec_record_order, records)}
        return [by_id[i] for i in stage.produces]


def _install_recorders(decoder: nn.Module, recorders: dict[str, Any]) -> None:
    """Add ``recorders`` to the transformers model's capture registry and install its hooks (once per
    model, as vLLM's own ``set_aux_hidden_state_layers`` does: before dynamo traces the model)."""
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    if getattr(decoder, "_output_capturing_hooks_installed", False):
        raise RuntimeError(
            f"{type(decoder).__name__} already has its output-capture hooks installed, so new aux recorders would "
            "never run: set the aux hidden-state layers before the model's first forward that records outputs"
        )
    flags = decoder._can_record_outputs
    if flags is None:
        raise RuntimeError(
            f"{type(decoder).__name__} declares no _can_record_outputs: transformers cannot record its layer outputs, "
            "so vLLM's Transformers backend cannot capture aux hidden states for it"
        )
    flags.update(recorders)
    maybe_install_capturing_hooks(decoder)


# ------------------------------------------------------------------------------------- classes
_ADAPTED: dict[type, type] = {}


def adapted_class(backend_cls: type) -> type:
    """``Pipespec<Class>``: ``TransformersAuxOverPP`` put before the backend class ``backend_cls``."""
    if backend_cls not in _ADAPTED:
        name = f"{CLASS_PREFIX}{backend_cls.__name__}"
        _ADAPTED[backend_cls] = type(name, (TransformersAuxOverPP, backend_cls),
                                     {"__module__": __name__, "__qualname__": name})
    return _ADAPTED[backend_cls]


def __getattr__(name: str) -> type:
    """``module:Pipespec<Class>`` as vLLM's registry imports it, in any process (built on first use)."""
    if not name.startswith(CLASS_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    backend = importlib.import_module(BACKEND_PACKAGE)
    backend_cls = backend.__dict__.get(name[len(CLASS_PREFIX):])
    if not isinstance(backend_cls, type) or _kind(backend_cls) != "text":
        raise AttributeError(f"{name}: vLLM's Transformers backend has no text causal-LM class "
                             f"{name[len(CLASS_PREFIX):]!r} for pipespec to adapt")
    cls = adapted_class(backend_cls)
    globals()[name] = cls
    return cls


# ------------------------------------------------------------------------------------- verdicts
def is_backend_class(cls: type) -> bool:
    """Whether ``cls`` is (or derives from) a class of vLLM's Transformers modeling backend."""
    return any(k.__module__ == BACKEND_PACKAGE or k.__module__.startswith(BACKEND_PACKAGE + ".") for k in cls.__mro__)


def _kind(cls: type) -> str:
    """"text" (a text causal LM), "multimodal", or "other" (pooling, classification, draft heads)."""
    from vllm.model_executor.models.transformers.causal import CausalMixin
    from vllm.model_executor.models.transformers.multimodal import MultiModalMixin

    if not issubclass(cls, CausalMixin):
        return "other"
    return "multimodal" if issubclass(cls, MultiModalMixin) else "text"


@dataclass(frozen=True)
class BackendVerdict:
    """What the plugin does for a Transformers-backend class: supported, adapt or refuse."""

    decision: Verdict
    reason: str
    spec: str | None = None
    target: str | None = None  # module:Class of the adapted class ("adapt" only)


def backend_verdict(cls: type, method: str, pp: int) -> BackendVerdict:
    """The plugin's decision for ``cls``, a class of vLLM's Transformers backend (``is_backend_class``)."""
    needs = f"{method} with pipeline parallelism" if pp > 1 else method
    if issubclass(cls, TransformersAuxOverPP):
        return BackendVerdict(Verdict.SUPPORTED, f"{cls.__name__} is pipespec's Transformers-backend subclass: it "
                                                 "captures id 0 and packs, collects and concatenates aux states per stage")
    kind = _kind(cls)
    if kind == "multimodal":
        why = (f"{cls.__name__} nests its text decoder in a transformers sub-model, whose outputs transformers records "
               "through that sub-model's own registry; pipespec's subclass covers the text-only backend classes")
        if pp == 1:
            return BackendVerdict(Verdict.SUPPORTED, f"{cls.__name__} implements vLLM's SupportsEagle3 (PP = 1; "
                                                     f"pipespec leaves it to vLLM: {why})")
        return BackendVerdict(Verdict.REFUSE, f"{cls.__name__} does not support {needs}: {why}. Run it at PP=1")
    if kind == "other":
        return BackendVerdict(Verdict.REFUSE, f"{cls.__name__} does not support {needs}: it is not a causal language "
                                              "model of vLLM's Transformers backend")
    backend = _backend_class_of(cls)
    if backend is not cls:
        return BackendVerdict(Verdict.REFUSE, f"{cls.__name__} does not support {needs}: it derives from vLLM's "
                                              f"{backend.__name__}, and pipespec adapts vLLM's own backend classes only; "
                                              f"derive it from {__name__}.{CLASS_PREFIX}{backend.__name__} instead")
    target = f"{__name__}:{CLASS_PREFIX}{cls.__name__}"
    if pp > 1:
        why = (f"{cls.__name__} does not support {needs}: on a non-last rank vLLM's Transformers backend returns "
               "hidden_states only (the aux states it recorded are dropped) and its decoder has no "
               f"{AUX_OVER_PP_FLAG}")
    else:
        why = (f"{cls.__name__} records {method} aux states at `_layer_names[id - 1]`, so a draft asking for id 0 "
               "(the embeddings) fails at load, and it cannot relay them over PP")
    reason = f"{why}; adapted as {target}"
    return BackendVerdict(Verdict.ADAPT, reason, SPEC_LABEL, target)


def resolve_backend_class(architecture: str) -> type:
    """The backend class vLLM serves ``architecture`` with under ``model_impl="transformers"``.

    A backend name (``TransformersForCausalLM``) is looked up in vLLM's registry; a transformers
    architecture (``LlamaForCausalLM``) is resolved by vLLM itself (``ModelConfig.registry.resolve_model_cls``)
    on that architecture's default config, written to a temporary directory that is removed after.
    """
    import tempfile

    import transformers
    from vllm.config import ModelConfig
    from vllm.model_executor.models import ModelRegistry

    entry = ModelRegistry.models.get(architecture)
    if entry is not None and getattr(entry, "module_name", "").startswith(BACKEND_PACKAGE):
        return entry.load_model_cls()  # type: ignore[no-any-return]
    hf_cls = getattr(transformers, architecture, None)
    if not isinstance(hf_cls, type) or not issubclass(hf_cls, transformers.PreTrainedModel):
        raise UsageError(f"--architecture {architecture}: transformers {transformers.__version__} has no model class of "
                         "that name, so vLLM's Transformers backend cannot serve it; give config.json's `architectures` "
                         "name (e.g. LlamaForCausalLM) or a backend class (e.g. TransformersForCausalLM)")
    config = hf_cls.config_class()
    config.architectures = [architecture]
    with tempfile.TemporaryDirectory(prefix="pipespec-verify-") as directory:
        config.save_pretrained(directory)
        try:
            model_config = ModelConfig(model=directory, dtype="float32", skip_tokenizer_init=True,
                                       model_impl="transformers")
            cls, _ = model_config.registry.resolve_model_cls(model_config.architectures, model_config=model_config)
        except ValueError as exc:  # vLLM's own refusal, e.g. "is not compatible with vLLM"
            raise UsageError(f"--architecture {architecture} --model-impl transformers: vLLM refuses it: "
                             f"{' '.join(str(exc).split())}") from None
    return cls  # type: ignore[no-any-return]


def _backend_class_of(cls: type) -> type:
    """The first class of ``cls``'s MRO defined in vLLM's backend package."""
    return next(k for k in cls.__mro__ if k.__module__.startswith(BACKEND_PACKAGE))
