"""vLLM 0.32's qwen3_vl / MossQwen3 bug, out of tree: a subclass that inherits the aux-over-PP flag.

``OverridingQwen2Model`` subclasses vLLM's ``Qwen2Model`` (which sets
``supports_aux_hidden_states_over_pp = True``) and overrides ``forward`` with a plain PP loop that
captures nothing. vLLM's own check reads the inherited flag and lets it through; over PP the draft would
then read missing aux states. pipespec judges the class itself and adapts it (or refuses it).
"""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix
from vllm.sequence import IntermediateTensors


class OverridingQwen2Model(Qwen2Model):
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class OverridingQwen2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's Qwen2ForCausalLM (SupportsEagle3 inherited) building the overriding decoder."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)  # Qwen2ForCausalLM.__init__ would build a second decoder (duplicate layer names)
        config = vllm_config.model_config.hf_config.get_text_config()
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = OverridingQwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
