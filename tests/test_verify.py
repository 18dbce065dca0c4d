"""Load-time verifier: support decided on the class itself, with real transformers classes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2Config
from transformers.models.llama.modeling_llama import LlamaModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

import pipespec
from pipespec.contract.layout import plan_layout
from pipespec.contract.mixin import AuxHiddenStatesMixin
from pipespec.contract.registry import Registry, builtin_adapters_dir
from pipespec.contract.verify import verify_supports_aux_hidden_states_over_pp
from pipespec.errors import LayoutError, SpecError, UnsupportedModelError, UsageError


@pytest.fixture
def registry() -> Registry:
    return Registry([("builtin", builtin_adapters_dir())])


def tiny_qwen2_config() -> Qwen2Config:
    return Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1)


class MiMoModel(Qwen2Model):
    """MiMo-style: inherits a supported class, brings its own forward that ignores aux states."""

    def forward(self, input_ids=None, **kwargs):  # type: ignore[override]
        return super().forward(input_ids=input_ids, **kwargs)


class PlainQwen2Subclass(Qwen2Model):
    """Inherits forward untouched: support carries over."""

    extra_flag = True


def test_spec_named_class_is_supported(registry):
    support = verify_supports_aux_hidden_states_over_pp(Qwen2Model, "eagle3", registry=registry)
    assert support.supported_by is Qwen2Model and support.spec is not None and support.spec.name == "qwen2"


def test_mimo_style_subclass_overriding_forward_is_rejected(registry):
    model = MiMoModel(tiny_qwen2_config())
    with pytest.raises(UnsupportedModelError) as err:
        verify_supports_aux_hidden_states_over_pp(model, "eagle3", plan_layout(4, 2, [1, 2, 3]), registry)
    msg = str(err.value)
    assert msg.startswith("`MiMoModel` does not support eagle3 with pipeline parallelism:")
    assert "`MiMoModel` overrides forward" in msg and "`Qwen2Model`" in msg and "adapter-gen" in msg


def test_subclass_without_forward_override_stays_supported(registry):
    model = PlainQwen2Subclass(tiny_qwen2_config())
    support = verify_supports_aux_hidden_states_over_pp(model, "eagle3", plan_layout(4, 2, [1, 2, 3]), registry)
    assert support.supported_by is Qwen2Model


def test_inherited_marker_does_not_make_an_overriding_subclass_supported(registry):
    class Marked(AuxHiddenStatesMixin, nn.Module):
        supports_aux_hidden_states_over_pp = True

        def forward(self, x):
            return x

    class Child(Marked):
        def forward(self, x):
            return x * 2

    assert verify_supports_aux_hidden_states_over_pp(Marked, registry=registry).supported_by is Marked
    with pytest.raises(UnsupportedModelError, match="`Child` overrides forward"):
        verify_supports_aux_hidden_states_over_pp(Child, registry=registry)


def test_unknown_class_is_rejected_with_the_way_out(registry):
    class Stranger(nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="no adapter spec or @pipespec.adapter names .*adapter-gen new"):
        verify_supports_aux_hidden_states_over_pp(Stranger, registry=registry)


def test_layer_count_mismatch_and_unknown_method(registry):
    model = Qwen2Model(tiny_qwen2_config())
    with pytest.raises(LayoutError, match="has 4 layers .* planned for 8"):
        verify_supports_aux_hidden_states_over_pp(model, "eagle3", plan_layout(8, 2, [2]), registry)
    with pytest.raises(UsageError, match="speculative method 'medusa' is unknown"):
        verify_supports_aux_hidden_states_over_pp(model, "medusa", registry=registry)


def test_spec_boundary_rule_is_enforced_even_if_layout_did_not_ask(tmp_path):
    (tmp_path / "llama_strict.toml").write_text(
        '[adapter]\nname = "llama_strict"\ndecoder_class = "transformers.models.llama.modeling_llama:LlamaModel"\n'
        '[aux]\nboundary_rule = "reject-at-stage-end"\n'
    )
    reg = Registry([("builtin", builtin_adapters_dir()), ("path", tmp_path)])
    with pytest.raises(LayoutError, match="aux layer id 4 ends stage 0"):
        verify_supports_aux_hidden_states_over_pp(LlamaModel, "eagle3", plan_layout(8, 2, [2, 4, 6]), reg)
    verify_supports_aux_hidden_states_over_pp(LlamaModel, "eagle3", plan_layout(8, 2, [2, 5, 6]), reg)


def test_decorator_registers_and_marks_the_class():
    @pipespec.adapter(architectures=["ToyDecoratedForCausalLM"], residual=True, capture="hidden + residual")
    class ToyDecorated(AuxHiddenStatesMixin, nn.Module):
        def forward(self, x):
            return x

    assert "supports_aux_hidden_states_over_pp" in ToyDecorated.__dict__
    assert ToyDecorated.pipespec_has_residual is True
    spec = pipespec.lookup("ToyDecoratedForCausalLM")
    assert spec is not None and spec.capture == "hidden + residual"
    assert pipespec.lookup(ToyDecorated) is spec
    assert verify_supports_aux_hidden_states_over_pp(ToyDecorated).supported_by is ToyDecorated


def test_decorator_requires_the_mixin():
    with pytest.raises(SpecError, match="must inherit pipespec.AuxHiddenStatesMixin"):
        pipespec.adapter(architectures=["X"])(type("NoMixin", (nn.Module,), {}))


def test_embed_rules_share_or_keep_or_fail():
    from pipespec.contract.embed import maybe_share_target_embed, spec_decode_needs_target_embed
    from pipespec.errors import CheckpointError

    assert [spec_decode_needs_target_embed(m, 2, True) for m in ("eagle", "eagle3", "dflash", "dspark", "ngram")] == [True] * 4 + [False]
    assert not spec_decode_needs_target_embed("eagle3", 2, False)
    target = nn.Embedding(10, 4)
    draft = nn.Module()
    draft.embed_tokens = None
    assert maybe_share_target_embed(draft, target) == "shared" and draft.embed_tokens.weight is target.weight
    own = nn.Module()
    own.embed_tokens = nn.Embedding(10, 4)
    keep = own.embed_tokens.weight
    assert maybe_share_target_embed(own, target) == "own" and own.embed_tokens.weight is keep
    meta = nn.Module()
    with torch.device("meta"):
        meta.embed_tokens = nn.Embedding(10, 4)
    with pytest.raises(CheckpointError, match="has no embed_tokens weights"):
        maybe_share_target_embed(meta, None)
