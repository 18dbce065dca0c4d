"""vLLM 0.34: what changed for pipespec since 0.33 (read in 0.34.0's source).

* The V1 runner is gone (``gpu_model_runner.py``, ``cpu_model_runner.py`` deleted) and with it
  ``VllmConfig.use_v2_model_runner`` and ``envs.VLLM_USE_V2_MODEL_RUNNER`` (set to anything but 1, the
  platform refuses to start). Every runner is the V2 family — GPU, XPU and the x86 CPU runner
  (``CPUModelRunner(GPUModelRunner)``), all with the aux relay — except the standalone CPU runner of
  non-x86 CPUs without Triton (``Platform.uses_standalone_cpu_model_runner``), which refuses speculative
  decoding itself. So nothing here reads ``use_v2_model_runner``.
* Whether a method uses aux states is the method config's ``uses_aux_hidden_states``
  (``SpeculativeConfig.uses_aux_hidden_states``): eagle3 (per its draft's ``eagle_config``), dflash and
  every DFlash subclass (dspark and others under the name dflash), extract_hidden_states, and methods
  registered with ``register_speculative_method`` (``spec.custom_method`` holds their name; ``method``
  becomes the built-in one they are based on).
"""

from __future__ import annotations

from typing import Any

from pipespec.integrations.vllm.compat.probe import RunnerFacts
from pipespec.integrations.vllm.compat.v0_32 import Runner
from pipespec.integrations.vllm.compat.v0_33 import Vllm033


class Vllm034(Vllm033):
    """pipespec's rules for vLLM 0.34."""

    MINOR = (0, 34)
    RUNNERS = RunnerFacts(v1_runner=False, v2_runner=True, v2_relays_aux=True, runner_switch=False,
                          method_config_aux=True)

    def runner_for(self, vllm_config: Any | None = None) -> Runner:
        from vllm.platforms import current_platform

        return Runner.STANDALONE_CPU if current_platform.uses_standalone_cpu_model_runner() else Runner.V2

    def _v2_by_default(self, has_triton: bool) -> bool:
        return True  # nothing to fall back to (and runner_for does not ask)

    def runner_refusal(self, method: str, pp: int, runner: Runner) -> str:
        return (
            f"pipespec: {method} over PP={pp} cannot run on vLLM's {runner.value} (vLLM {self.name} uses it on "
            "non-x86 CPUs without Triton): it runs no speculative decoding. Use an x86 CPU, a GPU build, or "
            "install Triton"
        )

    def method_uses_aux(self, method: str | None) -> bool:
        if method in self.AUX_METHODS:
            return True
        from vllm.v1.worker.gpu.spec_decode.speculator_config import (
            SpeculatorConfig,
            get_custom_speculator_config_class,
        )

        custom = get_custom_speculator_config_class(method)
        if custom is None:
            return False
        # A registered method: built on an aux-state method, or answering the question itself.
        return custom.base_method in self.AUX_METHODS or (
            custom.uses_aux_hidden_states is not SpeculatorConfig.uses_aux_hidden_states)

    def aux_method(self, speculative_config: Any | None) -> str | None:
        if speculative_config is None or not speculative_config.uses_aux_hidden_states:
            return None
        return str(speculative_config.custom_method or speculative_config.method)
