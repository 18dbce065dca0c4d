"""The contract's names: the attributes, keys and classes that pipespec, vLLM and generated code agree on.

Each is spelled here once and imported everywhere else, codemods included (they emit these strings
into generated code, so the generated text follows this module). No imports: the codemods, the
CLI's pure commands and the source zoo read it without torch.

    >>> f"{AUX_KEY_PREFIX}{0}"
    'aux_hidden_states_0'
"""

from __future__ import annotations

#: Class attribute that says a decoder's forward relays aux states over PP (vLLM's ``EagleModelMixin``
#: flag; vLLM refuses EAGLE3 over PP without it). pipespec trusts it only in the class's own body.
AUX_OVER_PP_FLAG = "supports_aux_hidden_states_over_pp"

#: Aux states travel between stages under ``f"{AUX_KEY_PREFIX}{slot}"`` (vLLM's ``AUX_HIDDEN_STATE_KEY``).
AUX_KEY_PREFIX = "aux_hidden_states_"

#: Class attribute of generated code: generator, its version, the source and the spec it came from.
GENERATED_BY_ATTR = "pipespec_generated_by"

#: Class attribute of an adapted decoder: whether its stages hand over a separate ``residual``.
HAS_RESIDUAL_ATTR = "pipespec_has_residual"

#: Class attribute of an adapted decoder: the config key that holds its number of layers N.
NUM_LAYERS_KEY_ATTR = "pipespec_num_layers_key"

#: Class attribute of a decorated or runtime-adapted class: the ``AdapterSpec`` it was adapted by.
SPEC_ATTR = "pipespec_spec"

#: pipespec's decoder-side mixin: adapted transformers classes and the pipespec dialect's vLLM-style
#: classes inherit it (the vllm dialect's output inherits vLLM's own mixin instead).
AUX_MIXIN_MODULE, AUX_MIXIN = "pipespec.contract.mixin", "AuxHiddenStatesMixin"

#: vLLM's decoder-side mixin that holds the flag and the aux helpers (``vllm.model_executor.models.interfaces``).
VLLM_EAGLE_MIXIN = "EagleModelMixin"

#: What a decoder's forward calls to relay aux states by ``EagleModelMixin``'s contract (llama.py's
#: ``LlamaModel.forward``): collect the states received from upstream, pack its own for the next stage.
VLLM_AUX_CALLS = ("collect_remote_aux_hidden_states", "pack_local_aux_hidden_states")

#: vLLM's ``*ForCausalLM``-side EAGLE3 interface (``set_aux_hidden_state_layers`` and the default ids).
VLLM_EAGLE3_INTERFACE = "SupportsEagle3"
