"""The zoo: tiny models, the stage-vs-reference comparison, and `pipespec zoo` over a subset of types.

The subset runs through the CLI (`--json`, `--write-coverage`) on real transformers classes adapted by
`pipespec.adapt`; the comparator tests feed deliberately wrong adaptations through the same runner
and require `failed` — a zoo that cannot fail would prove nothing.
"""

from __future__ import annotations

import copy
import functools
import io
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipespec.cli import main
from pipespec.contract.intermediate import IntermediateTensors
from pipespec.integrations.transformers.zoo import check, compare, tiny
from pipespec.integrations.transformers.zoo.check import run_type
from pipespec.integrations.transformers.zoo.compare import compare_stage_outputs
from pipespec.integrations.transformers.zoo.reference import (
    BATCH,
    find_decoder,
    make_input_ids,
    run_reference,
)
from pipespec.integrations.transformers.zoo.shapes import classify_forward_shape
from pipespec.integrations.transformers.zoo.stages import InProcessPipeline, uneven_partition, zoo_aux_ids
from pipespec.integrations.transformers.zoo.tiny import TinyBuildError, build_tiny_model, tiny_config

# Adaptable families the issue names, one hybrid (Mamba + attention), and two that must be declined:
# a BERT-style stack (no layer loop in the decoder's forward) and an RNN whose state crosses layers.
VERIFIED_SUBSET = [
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt2", "olmo2", "granite", "cohere",
    "stablelm", "jamba",
]
# (key words of the codemod's reason: the stack's loop is not in this forward; an RNN state crosses layers)
DECLINED_SUBSET = {"bert": "loop", "rwkv": "`state`"}


# ------------------------------------------------------------------------------- layout choices
def test_uneven_partition_grows_with_rank():
    assert uneven_partition(6, 1) == [6]
    assert uneven_partition(6, 2) == [2, 4]
    assert uneven_partition(6, 3) == [1, 2, 3]


@given(st.integers(1, 48), st.integers(1, 8))
def test_uneven_partition_is_a_partition(n, p):
    if p > n:
        with pytest.raises(ValueError):
            uneven_partition(n, p)
        return
    counts = uneven_partition(n, p)
    assert len(counts) == p and sum(counts) == n and min(counts) >= 1


def test_aux_ids_cover_zero_every_boundary_and_last():
    assert zoo_aux_ids(6, [1, 2, 3]) == [0, 1, 2, 3, 6]
    ids = zoo_aux_ids(12, [2, 4, 6])
    assert {0, 2, 6, 12} <= set(ids) and ids == sorted(set(ids))


# ------------------------------------------------------------------------------- tiny models
def test_generic_recipe_sets_the_tiny_sizes():
    config, fixes = tiny_config("llama")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (64, 6, 4, 2)
    assert (config.vocab_size, config.intermediate_size, config.max_position_embeddings) == (256, 128, 128)
    assert fixes == ()


def test_layer_type_list_keeps_one_layer_of_each_kind():
    values = ["mamba"] * 7 + ["attention"] + ["mamba"] * 40
    out = tiny._truncate_layer_list(values, 6)
    assert len(out) == 6 and set(out) == {"mamba", "attention"}
    pattern = (["sliding_attention"] * 5 + ["full_attention"]) * 8
    assert tiny._truncate_layer_list(pattern, 6) == pattern[:6]


def test_composite_config_gets_a_tiny_text_decoder():
    """gemma3 only builds through AutoModelForCausalLM.from_config; its text config is the tiny one."""
    built = build_tiny_model("gemma3")
    text = built.config.get_text_config(decoder=True)
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (64, 6, 256)
    assert built.num_parameters < tiny.MAX_TINY_PARAMS
    assert not built.model.training


def test_latent_attention_needs_kv_heads_equal_heads():
    config, _ = tiny_config("deepseek_v3")
    assert config.num_key_value_heads == config.num_attention_heads
    assert (config.qk_rope_head_dim, config.qk_nope_head_dim) == (8, 16)


def test_per_type_fix_is_recorded():
    built = build_tiny_model("musicgen")
    assert built.fixes == ("musicgen",)
    assert make_input_ids(built).shape[0] == BATCH * built.model.config.num_codebooks


def test_oversized_recipe_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(tiny, "MAX_TINY_PARAMS", 1000)
    with pytest.raises(TinyBuildError, match="parameters"):
        build_tiny_model("llama")


def test_forward_shapes_are_classified_from_source():
    import transformers

    assert classify_forward_shape(transformers.LlamaModel) == "llama"
    assert classify_forward_shape(transformers.Qwen3NextModel) == "llama-like"
    assert classify_forward_shape(transformers.GPT2Model) == "gpt2"
    assert classify_forward_shape(transformers.BertModel) == "bert"
    assert classify_forward_shape(transformers.MambaModel) == "ssm"
    assert classify_forward_shape(transformers.models.bart.modeling_bart.BartDecoder) == "bart-opt"


# ------------------------------------------------------------------------------- the comparator
@pytest.fixture(scope="module")
def llama_setup():
    """A tiny llama, its reference, and a factory of adapted stage instances holding its weights."""
    from pipespec.integrations.transformers.adapt import adapt
    from pipespec.integrations.transformers.infer import decoder_class_for_model_type

    built = build_tiny_model("llama")
    decoder = find_decoder(built.model, decoder_class_for_model_type("llama"))
    adapted = adapt(type(decoder))
    ids = make_input_ids(built)
    with torch.no_grad():
        reference = run_reference(decoder, "layers", "norm", ids)
    template = check._make_adapted_instance(adapted, decoder)
    return decoder, adapted, template, ids, reference


@pytest.mark.timeout(120)
def test_reference_follows_the_contract(llama_setup):
    """id L < N is what enters layer L (HF's hidden_states[L]); id N is pre-norm, HF's last entry is not."""
    decoder, _, _, ids, reference = llama_setup
    hs = reference.hf_hidden_states
    assert hs is not None and len(hs) == 7
    for layer in range(6):
        assert torch.equal(reference.aux[layer], hs[layer])
    assert torch.equal(decoder.norm(reference.aux[6]), reference.last_hidden_state)
    assert not torch.allclose(reference.aux[6], hs[6])


@pytest.mark.timeout(120)
def test_correct_stages_agree_and_wrong_id_mapping_is_caught(llama_setup):
    _, _, template, ids, reference = llama_setup
    partition, aux = [1, 2, 3], [0, 1, 3, 6]
    final, aux_list = InProcessPipeline(lambda: copy.deepcopy(template), 3, partition, aux).forward(ids)
    problems, abs_err, _ = compare_stage_outputs(final, aux_list, aux, reference)
    assert problems == [] and abs_err <= 1e-6

    # The checkpoint-convention trap: the states of ids 1 and 3 labelled one layer later (2 and 4).
    problems, _, rel = compare_stage_outputs(final, aux_list, [0, 2, 4, 6], reference)
    assert rel > compare.REL_TOL
    assert [p.split(":")[0] for p in problems] == ["aux id 2", "aux id 4"]
    # Slots in the wrong order.
    problems, _, _ = compare_stage_outputs(final, aux_list[::-1], aux, reference)
    assert len(problems) >= 2
    # A missing state is a problem, never a shorter list accepted.
    problems, _, _ = compare_stage_outputs(final, aux_list[:-1], aux, reference)
    assert any("3 aux states returned" in p for p in problems)


def _wrong_adapter(mistake: str):
    """An `adapt` that returns the real adapted class with one deliberate bug."""
    from pipespec.integrations.transformers.adapt import adapt as real_adapt

    def adapt(cls, spec=None):
        base = real_adapt(cls, spec)

        class Wrong(base):  # type: ignore[misc, valid-type]
            @functools.wraps(base.forward)  # same signature: the zoo still finds the cache keyword
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                if mistake == "rotate-slots" and isinstance(out, tuple):
                    output, aux = out
                    return output, list(aux[1:]) + list(aux[:1])
                if mistake == "forget-the-cache":  # every stage recomputes from only the tokens it is given
                    for name in ("cache", "past_key_values"):
                        kwargs.pop(name, None)
                    kwargs["use_cache"] = False
                    return super().forward(*args, **kwargs)
                if mistake == "drop-relayed-key" and isinstance(out, IntermediateTensors) and self.pipespec_stage.relays:
                    key = self.pipespec_stage.relays[0]
                    return IntermediateTensors({k: v for k, v in out.items() if k != key})
                return out

        Wrong.__name__ = base.__name__
        return Wrong

    return adapt


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mistake", "reason"),
    [("rotate-slots", "aux id"), ("drop-relayed-key", "sent keys")],
)
def test_wrong_adaptation_fails_through_the_cli(monkeypatch, capsys, mistake, reason):
    import pipespec.integrations.transformers.adapt as adapt_module

    monkeypatch.setattr(adapt_module, "adapt", _wrong_adapter(mistake))
    code = main(["zoo", "--model-types", "llama", "--json"])
    [row] = json.loads(capsys.readouterr().out)
    assert code == 1
    assert row["status"] == "failed" and reason in row["reason"], row


@pytest.mark.timeout(120)
def test_decode_steps_with_stage_caches_verify_and_catch_a_stage_without_cache(monkeypatch):
    """gemma2's sliding window (4) is shorter than prefill + steps, so masks from the stage cache matter."""
    import pipespec.integrations.transformers.adapt as adapt_module

    for model_type in ("llama", "gemma2"):
        result = run_type(model_type, pp_sizes=(2, 3), decode_steps=2)
        assert result.status == "verified", result.reason
        assert "prefill + 2 decode steps" in result.reason
    monkeypatch.setattr(adapt_module, "adapt", _wrong_adapter("forget-the-cache"))
    assert run_type("llama", pp_sizes=(1,)).status == "verified"  # one forward cannot tell
    result = run_type("llama", pp_sizes=(1,), decode_steps=2)
    assert result.status == "failed" and "decode step 1" in result.reason, result.reason


@pytest.mark.timeout(240)  # two spawned workers each import torch and transformers
def test_parallel_workers_keep_the_order_and_the_verdicts(capsys):
    assert main(["zoo", "--model-types", "rwkv,llama", "--jobs", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model_type"], r["status"]) for r in rows] == [("rwkv", "declined"), ("llama", "verified")]


@pytest.mark.timeout(60)
def test_pipeline_sizes_larger_than_the_model_do_not_verify():
    result = run_type("llama", pp_sizes=(7, 8))
    assert result.status == "declined" and "no requested pipeline size fits 6 layers" in result.reason


# ------------------------------------------------------------------------------- the CLI
@pytest.mark.timeout(300)
def test_zoo_subset_through_the_cli(capsys, tmp_path):
    """~15 types: the adaptable ones verified at P=1,2,3, the others declined with their reason."""
    report = tmp_path / "coverage.md"
    types = VERIFIED_SUBSET + list(DECLINED_SUBSET)
    code = main(["zoo", "--model-types", ",".join(types), "--json", "--write-coverage", str(report)])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["model_type"] for r in rows] == types
    assert all(set(r) == {"model_type", "status", "reason", "max_abs_err"} for r in rows)
    by_type = {r["model_type"]: r for r in rows}
    for t in VERIFIED_SUBSET:
        assert by_type[t]["status"] == "verified", by_type[t]
        assert "P=1,2,3" in by_type[t]["reason"]
        assert by_type[t]["max_abs_err"] is not None and by_type[t]["max_abs_err"] <= 1e-4
    for t, why in DECLINED_SUBSET.items():
        assert by_type[t]["status"] == "declined" and why in by_type[t]["reason"], by_type[t]
        assert by_type[t]["max_abs_err"] is None
    text = report.read_text()
    assert f"| verified | {len(VERIFIED_SUBSET)} |" in text and "| failed | 0 |" in text
    assert "| jamba | verified |" in text and "| rwkv | declined |" in text


def test_unknown_model_type_is_a_usage_error(capsys):
    assert main(["zoo", "--model-types", "llama,not_a_model"]) == 2
    assert "unknown model type 'not_a_model'" in capsys.readouterr().err


def test_zero_stages_is_a_usage_error(capsys):
    assert main(["zoo", "--model-types", "llama", "--pp", "0"]) == 2
    assert "--pp 0" in capsys.readouterr().err


def test_progress_bar_only_on_a_terminal():
    from pipespec.cli.zoo_transformers import _Progress

    result = check.ZooResult(model_type="llama", status="verified")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    pipe, tty = io.StringIO(), Tty()
    _Progress(pipe)(1, 2, result)
    _Progress(tty)(1, 2, result)
    assert pipe.getvalue() == ""
    assert "1/2" in tty.getvalue() and "verified 1" in tty.getvalue()
