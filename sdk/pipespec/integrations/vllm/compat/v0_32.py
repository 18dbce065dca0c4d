"""vLLM 0.32: the base of pipespec's per-release rules; later releases override only what changed.

Each answer here was read in vLLM 0.32.0's source (the installed CPU build):

* runners: both the V1 runner (``v1/worker/gpu_model_runner.py``, ``cpu_model_runner.py``) and the V2 runner
  (``v1/worker/gpu/model_runner.py``, whose ``PPHandler.relay_aux_hidden_states`` relays aux states between
  PP ranks). ``VllmConfig.use_v2_model_runner`` picks one per run: ``VLLM_USE_V2_MODEL_RUNNER`` when set,
  else V1 without Triton (the CPU build) or for features V2 lacks, else V2;
* speculative methods with aux hidden states: the runners test ``method`` against the names
  eagle3, dflash, dspark and extract_hidden_states (``SpeculativeConfig.compute_hash`` lists the same four);
* the draft's aux ids: ``get_eagle3_aux_layers_from_config`` in the V2 runner's ``eagle3_utils``.

vLLM is imported inside the methods only: the gate and the source-level tests read this module without it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pipespec.integrations.vllm.compat.probe import RunnerFacts


class Runner(enum.Enum):
    """The model runner a vLLM run uses, by what matters to EAGLE3 over PP."""

    V1 = "V1 model runner"  # drafter on the last rank only; never relays aux states between ranks
    V2 = "V2 model runner"  # relays aux states through IntermediateTensors (PPHandler)
    STANDALONE_CPU = "standalone CPU model runner"  # 0.34's non-x86 CPU runner without Triton: no speculative decoding


class Vllm032:
    """pipespec's rules for vLLM 0.32 (and the interface every release module implements)."""

    MINOR = (0, 32)
    #: What this module assumes of the tree; the source-level tests compare it with the release's source.
    RUNNERS = RunnerFacts(v1_runner=True, v2_runner=True, v2_relays_aux=True, runner_switch=True,
                          method_config_aux=False)
    #: Speculative methods whose draft reads the target's aux hidden states (by name, where vLLM decides so).
    AUX_METHODS = ("eagle3", "dflash", "dspark", "extract_hidden_states")

    @property
    def name(self) -> str:
        return f"{self.MINOR[0]}.{self.MINOR[1]}"

    # ------------------------------------------------------------------------------------ runner
    def runner_for(self, vllm_config: Any | None = None) -> Runner:
        """The runner ``vllm_config`` runs on; without a config, the one this build picks by default."""
        if vllm_config is not None:
            return Runner.V2 if vllm_config.use_v2_model_runner else Runner.V1
        import vllm.envs as envs
        from vllm.triton_utils import HAS_TRITON

        chosen = envs.VLLM_USE_V2_MODEL_RUNNER
        if chosen is not None:
            return Runner.V2 if chosen else Runner.V1
        return Runner.V2 if self._v2_by_default(bool(HAS_TRITON)) else Runner.V1

    def _v2_by_default(self, has_triton: bool) -> bool:
        """``use_v2_model_runner`` with the variable unset, before per-run features: V2 needs Triton."""
        return has_triton

    def relays_aux_over_pp(self, vllm_config: Any | None = None) -> bool:
        """Whether the run's runner relays aux hidden states between PP ranks (only the V2 runner does)."""
        return self.runner_for(vllm_config) is Runner.V2

    def runner_refusal(self, method: str, pp: int, runner: Runner) -> str:
        """The one line for an aux-state method over PP on a runner that does not relay them."""
        return (
            f"pipespec: {method} over PP={pp} cannot run on vLLM's {runner.value} (the one vLLM {self.name} picks "
            "for this run: the V2 runner needs Triton and lacks some features): it creates the drafter on the last "
            "rank only and never relays aux hidden states between ranks. Use PP=1, or vLLM's V2 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=1, a GPU build)"
        )

    # ------------------------------------------------------------------------- speculative methods
    def method_uses_aux(self, method: str | None) -> bool:
        """Whether the method named ``method`` reads aux hidden states (``pipespec verify``: no config)."""
        return method in self.AUX_METHODS

    def aux_method(self, speculative_config: Any | None) -> str | None:
        """The method's name when the run's speculative config uses aux hidden states, else None."""
        method = getattr(speculative_config, "method", None)
        return method if speculative_config is not None and self.method_uses_aux(method) else None

    def draft_aux_ids(self, speculative_config: Any) -> tuple[int, ...] | None:
        """The aux ids the draft asks for, read the way vLLM reads them (None: the target's defaults)."""
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        return get_eagle3_aux_layers_from_config(speculative_config)

    # ------------------------------------------------------------- private state pipespec touches
    def forget_cached_architectures(self) -> None:
        """Clear ``_MODEL_ARCH_BY_HASH`` (the architecture -> class cache of ``get_model_architecture``)."""
        from vllm.model_executor.model_loader import utils

        utils._MODEL_ARCH_BY_HASH.clear()

    def config_registry(self) -> dict[str, Any]:
        """vLLM's own HF config classes by model type (``transformers_utils.config._CONFIG_REGISTRY``)."""
        from vllm.transformers_utils.config import _CONFIG_REGISTRY

        return _CONFIG_REGISTRY  # type: ignore[no-any-return]

    def custom_op_registry(self) -> dict[str, type]:
        """``CustomOp`` / ``PluggableLayer`` classes by registered name (``custom_op.op_registry``)."""
        from vllm.model_executor import custom_op

        return custom_op.op_registry

    # ---------------------------------------------- the Transformers modeling backend (transformers_backend)
    def backend_layer_names(self, model: Any) -> dict[int, str]:
        """Layer index -> the layer's module name under the wrapped transformers model, as ``Base`` maps them
        (its private ``_layer_names``, which its own EAGLE3 path reads too)."""
        return model._layer_names  # type: ignore[no-any-return]

    def backend_model_call(self, model: Any, input_ids: Any, positions: Any, intermediate_tensors: Any,
                           inputs_embeds: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The wrapped transformers model's raw outputs, called as ``Base.forward`` calls it (mirrored: a non-first
        rank runs on the received ``hidden_states`` as ``inputs_embeds``; a batch dimension added; never both
        ``input_ids`` and ``inputs_embeds``), so a subclass can read what its recorders captured."""
        if not model.pp_group.is_first_rank:
            assert intermediate_tensors is not None
            input_ids = None
            inputs_embeds = intermediate_tensors["hidden_states"]
        if input_ids is not None and input_ids.ndim == 1:
            input_ids = input_ids[None, ...]
        if inputs_embeds is not None and inputs_embeds.ndim == 2:
            inputs_embeds = inputs_embeds[None, ...]
        if positions.ndim == 1:
            positions = positions[None, ...]
        if input_ids is not None and inputs_embeds is not None:
            input_ids = None
        outputs = model.model(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False,
                              position_ids=positions, return_dict=False, **kwargs)
        return tuple(outputs)

    @contextmanager
    def custom_op_registration(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
        """``vllm.utils.torch_utils.direct_register_custom_op`` replaced by ``wrap(original)`` while inside."""
        from vllm.utils import torch_utils

        original = torch_utils.direct_register_custom_op
        torch_utils.direct_register_custom_op = wrap(original)
        try:
            yield
        finally:
            torch_utils.direct_register_custom_op = original
