"""The vLLM verifier on vLLM 0.32's own classes: the four inherited-flag cases the issue names."""

from __future__ import annotations

import pytest

from pipespec.integrations.vllm.readiness import (
    class_facts,
    decoder_class_of,
    judge_decoder_class,
    judge_vllm_class,
)


def test_llama_supported_by_its_own_flag() -> None:
    from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel

    verdict = judge_decoder_class(LlamaModel)
    assert verdict.supported and verdict.supported_by == "LlamaModel"
    assert judge_vllm_class(LlamaForCausalLM, pp=2).supported


def test_mistral_delegating_forward_keeps_llama_support() -> None:
    """MistralModel.forward only returns super().forward(...): it keeps LlamaModel's support."""
    from vllm.model_executor.models.mistral import MistralForCausalLM, MistralModel

    assert "forward" in MistralModel.__dict__
    verdict = judge_decoder_class(MistralModel)
    assert verdict.supported and verdict.supported_by == "LlamaModel"
    assert decoder_class_of(MistralForCausalLM) == ("model", MistralModel)
    assert "`MistralModel.forward` only delegates to super()" in verdict.reason
    assert judge_vllm_class(MistralForCausalLM, pp=2).supported


@pytest.mark.parametrize(("module", "name"), [("vllm.model_executor.models.moss_audio", "MossQwen3Model")])
def test_inherited_flag_over_overriding_forward_is_refused(module: str, name: str) -> None:
    """vLLM's own check passes it (the flag is inherited from Qwen2Model); its forward drops aux states.

    qwen3_vl's Qwen3LLMModel is the same case; its module needs torchvision, so it is judged from source below.
    """
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert cls.supports_aux_hidden_states_over_pp is True  # what vLLM reads
    verdict = judge_decoder_class(cls)
    assert not verdict.supported and not verdict.opted_out
    assert verdict.supported_by == "Qwen2Model"
    message = verdict.message("eagle3")
    assert message.startswith(f"{name} does not support eagle3 with pipeline parallelism: `{name}.forward` (")
    assert "inherited from `Qwen2Model`" in message
    assert f"adapter-gen {importlib.import_module(module).__file__} --dialect vllm" in message
    assert f"--dialect vllm --class {name}" in message and "pipespec[vllm]" in message


def test_mimo_opts_out_itself() -> None:
    from vllm.model_executor.models.mimo import MiMoForCausalLM, MiMoModel

    verdict = judge_decoder_class(MiMoModel)
    assert not verdict.supported and verdict.opted_out and verdict.supported_by == "MiMoModel"
    assert "`MiMoModel` sets supports_aux_hidden_states_over_pp = False itself" in verdict.message()
    assert "opts out on purpose" in verdict.message() and "pipespec[vllm]" not in verdict.message()
    assert not judge_vllm_class(MiMoForCausalLM, pp=2).supported


def test_decoder_without_aux_support_and_pp1_rules() -> None:
    from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM, Gemma2Model
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    assert not judge_decoder_class(Gemma2Model).supported
    verdict = judge_vllm_class(Gemma2ForCausalLM, pp=1)
    assert not verdict.supported and "does not implement SupportsEagle3" in verdict.reason
    # Qwen3-MoE: EAGLE3 at PP = 1 only in vLLM 0.32 (captures on every rank, packs nothing).
    assert judge_vllm_class(Qwen3MoeForCausalLM, pp=1).supported
    assert not judge_vllm_class(Qwen3MoeForCausalLM, pp=2).supported


def test_an_override_that_does_the_aux_handling_is_accepted() -> None:
    """A subclass whose own forward collects and packs keeps support; the check reads its code."""
    from vllm.model_executor.models.llama import LlamaModel

    assert class_facts(LlamaModel)[0].forward_is_transparent()
    namespace: dict[str, object] = {"LlamaModel": LlamaModel}
    exec(  # a real class defined from source, so inspect can read it
        compile(
            "class Custom(LlamaModel):\n"
            "    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):\n"
            "        return LlamaModel.forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)\n",
            "<custom>", "exec"),
        namespace,
    )
    custom = namespace["Custom"]
    assert isinstance(custom, type)
    # Source unavailable (defined from a string): not provably transparent, so refused with the reason.
    assert not judge_decoder_class(custom).supported


def _models_dir():  # type: ignore[no-untyped-def]
    import pathlib

    import vllm

    return pathlib.Path(vllm.__file__).parent / "model_executor" / "models"


@pytest.mark.parametrize(
    ("file", "name", "supported"),
    [("qwen3_vl.py", "Qwen3LLMModel", False), ("moss_audio.py", "MossQwen3Model", False),
     ("mistral.py", "MistralModel", True), ("mimo.py", "MiMoModel", False), ("llama.py", "LlamaModel", True),
     ("qwen3.py", "Qwen3Model", True), ("gemma2.py", "Gemma2Model", False)],
)
def test_source_verdicts_equal_the_imported_ones(file: str, name: str, supported: bool) -> None:
    """Read from source only (qwen3_vl cannot be imported without torchvision): the same verdicts."""
    import importlib

    from pipespec.integrations.vllm.readiness import judge_decoder_source

    verdict = judge_decoder_source(_models_dir() / file, name)
    assert verdict.supported is supported, verdict.reason
    if file != "qwen3_vl.py":
        imported = judge_decoder_class(getattr(importlib.import_module(f"vllm.model_executor.models.{file[:-3]}"), name))
        assert (imported.supported, imported.supported_by, imported.opted_out) == (
            verdict.supported, verdict.supported_by, verdict.opted_out)
    if name == "Qwen3LLMModel":
        assert "`Qwen3LLMModel.forward` (" in verdict.reason and "inherited from `Qwen2Model`" in verdict.reason
