"""vLLM 0.33: what changed for pipespec since 0.32 (read in 0.33.0's source).

* ``VllmConfig.use_v2_model_runner`` no longer falls back to V1 for a missing Triton on an unspecified
  platform (``not HAS_TRITON and not current_platform.is_unspecified()``);
* the V2 runner asks ``eagle3_utils.requires_aux_hidden_states(spec)`` whether a method needs aux states:
  eagle3 unless its draft's ``eagle_config`` says ``use_aux_hidden_state: false``, and dflash, dspark,
  extract_hidden_states. With only a method name (``pipespec verify``) the names of 0.32 still answer.

Unchanged: the runners and their files, the aux-id reader, the contract symbols.
"""

from __future__ import annotations

from typing import Any

from pipespec.integrations.vllm.compat.v0_32 import Vllm032


class Vllm033(Vllm032):
    """pipespec's rules for vLLM 0.33."""

    MINOR = (0, 33)

    def _v2_by_default(self, has_triton: bool) -> bool:
        from vllm.platforms import current_platform

        return has_triton or bool(current_platform.is_unspecified())

    def aux_method(self, speculative_config: Any | None) -> str | None:
        if speculative_config is None:
            return None
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import requires_aux_hidden_states

        return str(speculative_config.method) if requires_aux_hidden_states(speculative_config) else None
