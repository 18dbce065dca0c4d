"""``pipespec.adapt``: adapted HF decoders run as pipeline stages and agree with transformers in float32.

The oracle is the original transformers class with the same weights: ``last_hidden_state`` for the
final output, ``output_hidden_states[L]`` for aux id L < N, the input of the final norm for id N (the
last layer's output), and for decoding the original model with its own cache, step by step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DummyLayer

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import plan_layout
from pipespec.contract.spec import AdapterSpec
from pipespec.contract.verify import find_registered_support, verify_supports_aux_hidden_states_over_pp
from pipespec.errors import LayoutError, UnsupportedModelError
from pipespec.integrations.transformers.adapt import adapt, cache_kwarg_name, spec_for_class
from pipespec.integrations.transformers.infer import decoder_class_for_model_type, infer_spec
from pipespec.integrations.transformers.stage_cache import StageCache, new_stage_cache

N = 6
PARTITIONS = {1: None, 2: [2, 4], 3: [1, 3, 2]}  # uneven; boundaries at 2 and at 1, 4
ALL_IDS = list(range(N + 1))  # every id, so every stage boundary carries one
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2"]
RTOL, ATOL = 1e-5, 1e-5


def tiny(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The decoder stack of a tiny random float32 causal LM of ``model_type`` (6 layers, GQA)."""
    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
    )
    if model_type == "gemma2":
        config.sliding_window = 4  # decoding below runs past the window
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(config).eval()
    return getattr(lm, lm.base_model_prefix)


def stages_of(decoder: torch.nn.Module, pp: int, aux_ids: list[int] = ALL_IDS) -> list[torch.nn.Module]:
    """One adapted module per stage, each holding the reference weights."""
    adapted = adapt(type(decoder))
    out = []
    for rank in range(pp):
        stage = adapted(decoder.config).eval()
        stage.load_state_dict(decoder.state_dict())
        stage.set_pipeline_stage(rank, pp, PARTITIONS[pp])
        stage.set_aux_hidden_state_layers(aux_ids)
        out.append(stage)
    return out


def run_pipeline(stages: list[torch.nn.Module], input_ids: torch.Tensor, **kwargs: Any) -> tuple[Any, list[torch.Tensor]]:
    """Hand IntermediateTensors from stage to stage, as the transport would; return the last stage's pair."""
    received: IntermediateTensors | None = None
    for rank, stage in enumerate(stages):
        per_stage = {k: (v[rank] if isinstance(v, list) else v) for k, v in kwargs.items()}
        out = stage(input_ids=input_ids if rank == 0 else None, intermediate_tensors=received, **per_stage)
        if rank < len(stages) - 1:
            assert isinstance(out, IntermediateTensors)
            assert set(out) == {"hidden_states", *stage.pipespec_stage.sends}
            received = IntermediateTensors({k: v.clone() for k, v in out.items()})  # a copy, like a send
    return out


def reference(decoder: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """(last_hidden_state, output_hidden_states, input of the final norm) of the original model."""
    norm = getattr(decoder, infer_spec(type(decoder)).norm_attr)
    seen: dict[str, torch.Tensor] = {}
    hook = norm.register_forward_hook(lambda module, args, output: seen.__setitem__("pre_norm", args[0]))
    try:
        out = decoder(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    return out.last_hidden_state, out.hidden_states, seen["pre_norm"]


@pytest.fixture(scope="module", params=FAMILIES)
def decoder(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny(request.param)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_stages_reproduce_last_hidden_state_and_every_aux_id(decoder: torch.nn.Module, pp: int) -> None:
    """Final hidden = HF last_hidden_state; aux id L < N = HF hidden_states[L]; id N = pre-norm output."""
    input_ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_final, want_hidden, want_pre_norm = reference(decoder, input_ids)
        final, aux = run_pipeline(stages_of(decoder, pp), input_ids, use_cache=False)
    torch.testing.assert_close(final.last_hidden_state, want_final, rtol=RTOL, atol=ATOL)
    assert len(aux) == N + 1
    for layer_id, got in zip(ALL_IDS, aux):
        want = want_hidden[layer_id] if layer_id < N else want_pre_norm
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, i=layer_id: f"aux id {i}: {m}")


def _steps() -> list[tuple[str, int, int]]:
    """Prefill 5 tokens, 4 single-token steps, roll back to 7 positions, then 2 more steps."""
    return [("run", 0, 5), ("run", 5, 6), ("run", 6, 7), ("run", 7, 8), ("run", 8, 9), ("crop", 7, 7), ("run", 7, 9), ("run", 9, 10)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp,explicit_positions", [(2, False), (3, True)])
def test_multi_step_decoding_with_stage_caches_matches_the_original_cache(
    decoder: torch.nn.Module, pp: int, explicit_positions: bool
) -> None:
    """Each step's final hidden and aux states equal the original model's, through a rollback.

    At P=2 positions come from the stage cache (``position_ids=None``): a stage that does not own layer
    0 must still see its own length. At P=3 the engine's convention (explicit positions) is used.
    """
    stages = stages_of(decoder, pp, aux_ids=[2, 3, N])
    caches = [new_stage_cache(stage, record_past=True) for stage in stages]
    kw = cache_kwarg_name(type(decoder))
    ref_cache = DynamicCache(config=decoder.config)
    ref_cache.activate_past_recording()
    tokens = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for op, a, b in _steps():
            if op == "crop":
                for cache in caches:
                    cache.crop(a)
                ref_cache.crop(a - ref_cache.get_seq_length())
                assert [c.get_seq_length() for c in caches] == [a] * pp
                continue
            ids = tokens[:, a:b]
            want = decoder(input_ids=ids, use_cache=True, output_hidden_states=True, **{kw: ref_cache})
            extra = {"position_ids": torch.arange(a, b)[None]} if explicit_positions else {}
            final, aux = run_pipeline(stages, ids, use_cache=True, **{kw: caches}, **extra)
            torch.testing.assert_close(final.last_hidden_state, want.last_hidden_state, rtol=RTOL, atol=ATOL)
            for got, layer_id in zip(aux[:2], (2, 3)):
                torch.testing.assert_close(got, want.hidden_states[layer_id], rtol=RTOL, atol=ATOL)
            assert [c.get_seq_length() for c in caches] == [b] * pp


@pytest.mark.timeout(120)
def test_a_plain_dynamic_cache_on_a_later_stage_decodes_wrongly() -> None:
    """The trap StageCache exists for: without it, stage 1 reads layer 0's empty cache and drifts."""
    decoder = tiny("llama")
    stages = stages_of(decoder, 2, aux_ids=[])
    plain = [DynamicCache(config=decoder.config) for _ in stages]
    ref_cache = DynamicCache(config=decoder.config)
    tokens = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for a, b in [(0, 5), (5, 6), (6, 7)]:
            want = decoder(input_ids=tokens[:, a:b], use_cache=True, cache=ref_cache).last_hidden_state
            got = run_pipeline(stages, tokens[:, a:b], use_cache=True, cache=plain)
    assert plain[1].get_seq_length() == 0  # layer 0 is stage 0's: stage 1 sees nothing there
    assert not torch.allclose(got.last_hidden_state, want, rtol=1e-3, atol=1e-3)


def test_stage_cache_owns_only_its_layers_and_crops_to_an_absolute_length() -> None:
    """Unowned layers refuse updates (and are dummies where transformers has them); size queries answer
    from the first owned layer, in every release."""
    decoder = tiny("llama")
    stage = stages_of(decoder, 3)[1]  # layers [1, 4)
    cache = new_stage_cache(stage)
    assert isinstance(cache, StageCache) and (cache.start_layer, cache.end_layer) == (1, 4)
    if DummyLayer is not None:  # transformers without DummyLayer: StageCache remaps size queries instead
        assert [isinstance(layer, DummyLayer) for layer in cache.layers] == [True, False, False, False, True, True]
    kv = torch.zeros(1, 2, 5, 16)
    for idx in (1, 2, 3):
        cache.update(kv, kv, idx)
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(1, 0) == (6, 0)
    cache.crop(3)
    assert cache.get_seq_length() == 3
    cache.crop(-1)  # transformers' own convention: drop that many
    assert cache.get_seq_length() == 2
    with pytest.raises(ValueError, match="cannot crop the stage cache to 4 positions: it holds 2"):
        cache.crop(4)
    with pytest.raises(NotImplementedError):
        cache.update(kv, kv, 0)  # a stage running a layer it does not own fails loudly


# --------------------------------------------------------------------------------- class contract
def test_adapted_class_is_cached_marked_and_accepted_by_the_verifier() -> None:
    """Same class → same adapted class; the marker is in its own dict; verify accepts it with a layout."""
    cls = transformers.LlamaModel
    adapted = adapt(cls)
    assert adapt(cls) is adapted and adapt(adapted) is adapted
    assert adapted.__name__ == "AdaptedLlamaModel" and adapted.__mro__[1] is cls
    own = adapted.__dict__
    assert own["supports_aux_hidden_states_over_pp"] is True
    assert own["pipespec_spec"].name == "llama" and own["pipespec_num_layers_key"] == "num_hidden_layers"
    assert own["pipespec_has_residual"] is False and own["pipespec_cache_kwarg"] == "cache"
    support = find_registered_support(adapted)
    assert support.supported_by is adapted
    model = adapted(tiny("llama").config)
    layout = plan_layout(N, 3, aux_layers=[2, 3, 5], partition=[1, 3, 2])
    assert verify_supports_aux_hidden_states_over_pp(model, "eagle3", layout).cls is adapted
    with pytest.raises(LayoutError, match="has 6 layers"):
        verify_supports_aux_hidden_states_over_pp(model, "eagle3", plan_layout(8, 2))


def test_subclass_that_inherits_forward_uses_its_parents_spec_and_source() -> None:
    """A subclass without its own forward adapts from the parent's source and the parent's spec."""

    class MyLlama(transformers.LlamaModel):
        pass

    assert spec_for_class(MyLlama).name == "llama"
    adapted = adapt(MyLlama)
    assert adapted.__mro__[1] is MyLlama
    decoder = tiny("llama")
    stage = adapted(decoder.config).eval()
    stage.load_state_dict(decoder.state_dict())
    ids = torch.randint(3, 250, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(stage(input_ids=ids).last_hidden_state, decoder(input_ids=ids).last_hidden_state)


def test_unadaptable_decoder_raises_unsupported_with_the_codemod_reason() -> None:
    """Zamba feeds a copy of the embeddings to every layer: declined, with that reason."""
    zamba = decoder_class_for_model_type("zamba")
    with pytest.raises(UnsupportedModelError, match=r"`ZambaModel` cannot run as pipeline stages: .*original_hidden_states"):
        adapt(zamba)


def test_spec_marked_unsupported_is_refused_before_any_rewrite() -> None:
    off = AdapterSpec(
        name="off", decoder_class="transformers.models.llama.modeling_llama:LlamaModel", supported=False, reason="not today"
    )
    with pytest.raises(UnsupportedModelError, match="cannot run as pipeline stages: not today"):
        adapt(transformers.LlamaModel, off)


def test_non_first_stage_without_intermediate_tensors_says_what_is_missing() -> None:
    decoder = tiny("qwen2")
    stage = stages_of(decoder, 2)[1]
    with pytest.raises(ValueError, match="is pipeline stage 1: pass the previous stage's intermediate_tensors"):
        stage(input_ids=None, intermediate_tensors=None)


def test_last_stage_without_aux_ids_returns_the_plain_output() -> None:
    decoder = tiny("llama")
    (stage,) = stages_of(decoder, 1, aux_ids=[])
    out = stage(input_ids=torch.randint(3, 250, (1, 4)))
    assert isinstance(out, transformers.modeling_outputs.BaseModelOutputWithPast)


def test_cache_kwarg_follows_the_source() -> None:
    """5.24 forwards take `cache`; a forward that still takes `past_key_values` keeps it."""
    assert cache_kwarg_name(transformers.LlamaModel) == "cache"
    assert cache_kwarg_name(adapt(transformers.GPT2Model)) == "cache"

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, inputs_embeds=None):  # noqa: ANN001, ANN201
            return input_ids

    assert cache_kwarg_name(OldStyle) == "past_key_values"

    class NoCache(torch.nn.Module):
        def forward(self, input_ids=None):  # noqa: ANN001, ANN201
            return input_ids

    with pytest.raises(UnsupportedModelError, match="takes no cache argument"):
        cache_kwarg_name(NoCache)


# ------------------------------------------------------------------------------------- inference
def test_infer_spec_reads_gpt2_attribute_names_from_source() -> None:
    spec = infer_spec(transformers.GPT2Model, "gpt2")
    assert (spec.layers_attr, spec.embed_attr, spec.norm_attr, spec.residual) == ("h", "wte", "ln_f", False)
    assert spec.num_layers_key == "num_hidden_layers" and spec.architectures == ("GPT2LMHeadModel",)
    assert spec.supported and spec.decoder_class == "transformers.models.gpt2.modeling_gpt2:GPT2Model"


def test_infer_spec_from_source_text_and_for_unadaptable_classes() -> None:
    source = '''
class Stack:
    def __init__(self, config):
        self.blocks = [Block() for _ in range(config.n_blocks)]

    def forward(self, input_ids=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.tok(input_ids)
        x = inputs_embeds
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)
'''
    spec = infer_spec(source, module="mine.model")
    assert (spec.layers_attr, spec.embed_attr, spec.norm_attr, spec.num_layers_key) == ("blocks", "tok", "final_norm", "n_blocks")
    assert spec.decoder_class == "mine.model:Stack" and spec.name == "stack"
    jamba_like = infer_spec(decoder_class_for_model_type("zamba2"), "zamba2")
    assert not jamba_like.supported and "original_hidden_states" in jamba_like.reason


@pytest.mark.parametrize(
    "model_type,name",
    [
        ("llama", "LlamaModel"), ("gpt2", "GPT2Model"), ("gemma3_text", "Gemma3TextModel"), ("bart", "BartDecoder"),
        ("opt", "OPTDecoder"), ("exaone", "LlamaModel"),
    ],
)
def test_decoder_class_for_model_type_finds_the_stack(model_type: str, name: str) -> None:
    """Through the causal-LM class's __init__, and through wrappers that only run `self.decoder` (Bart, OPT)."""
    assert decoder_class_for_model_type(model_type).__name__ == name


def _pairs() -> Iterator[tuple[int, int]]:
    return itertools.combinations(range(N + 1), 2)


def test_boundary_ids_belong_to_the_upstream_stage_in_the_adapted_forward() -> None:
    """Ids on stage ends are captured by the stage that ends there and relayed, never twice."""
    decoder = tiny("llama")
    ids = torch.randint(3, 250, (1, 5))
    with torch.no_grad():
        _, want_hidden, want_pre_norm = reference(decoder, ids)
        for a, b in _pairs():
            final, aux = run_pipeline(stages_of(decoder, 3, aux_ids=[a, b]), ids, use_cache=False)
            for layer_id, got in zip((a, b), aux):
                want = want_hidden[layer_id] if layer_id < N else want_pre_norm
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_pipespec_adapt_is_callable_before_and_after_importing_the_submodule():
    import importlib

    from transformers.models.llama.modeling_llama import LlamaModel

    import pipespec

    first = pipespec.adapt(LlamaModel)
    importlib.import_module("pipespec.integrations.transformers.adapt")  # rebinds the package attribute to the module
    assert pipespec.adapt(LlamaModel) is first
    assert "supports_aux_hidden_states_over_pp" in first.__dict__
