"""The vllm dialect's output imports inside real vLLM 0.32 and satisfies vLLM's own capability checks.

Each installed model file is adapted in memory, written to a temporary file and imported as a module of
vLLM's package (``vllm.model_executor.models.<name>_pipespec``), so its relative imports resolve as
the original's do; nothing is written into the vLLM tree. The classes must pass ``supports_eagle3()``
(the ``*ForCausalLM``) and carry ``supports_aux_hidden_states_over_pp = True`` in their own ``__dict__``
over ``EagleModelMixin`` (the decoder), as vLLM's llama.py does.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import vllm
from vllm.model_executor.models.interfaces import EagleModelMixin, supports_eagle3

from pipespec.codemods.adapt_vllm_native import GENERATOR, GENERATOR_VERSION, adapt_vllm_module

VLLM = Path(vllm.__file__).parent
MODELS = VLLM / "model_executor" / "models"
# file -> decoder; the holders come from the codemod's own outcome
FILES = ["gemma2", "gpt2", "qwen3_moe", "solar", "step1", "stablelm", "granite", "olmoe", "internlm2", "opt", "exaone4"]
pytestmark = pytest.mark.timeout(240)


def load_as(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@pytest.mark.parametrize("name", FILES)
def test_adapted_module_imports_and_passes_vllms_checks(name: str, tmp_path: Path) -> None:
    result = adapt_vllm_module((MODELS / f"{name}.py").read_text(), label=f"vllm/model_executor/models/{name}.py")
    adapted = [d for d in result.decoders if d.status == "adapted"]
    assert adapted, result.decoders
    path = tmp_path / f"{name}_pipespec.py"
    path.write_text(result.code)
    module = load_as(f"vllm.model_executor.models.{name}_pipespec", path)
    try:
        for outcome in adapted:
            decoder = getattr(module, outcome.class_name)
            assert issubclass(decoder, EagleModelMixin)
            assert decoder.__dict__.get("supports_aux_hidden_states_over_pp") is True
            assert decoder.__dict__["pipespec_generated_by"].startswith(f"{GENERATOR} v{GENERATOR_VERSION} ")
            assert outcome.causal_lm, f"{outcome.class_name}: no *ForCausalLM found"
            for holder_name in outcome.causal_lm:
                holder = getattr(module, holder_name)
                assert supports_eagle3(holder), holder_name
                if outcome.decoder_attr not in ("model", None) and "." not in outcome.decoder_attr:
                    assert isinstance(holder.__dict__["model"], property)  # vLLM's drafter reads target.model
                if outcome.decoder_attr is not None and "." in outcome.decoder_attr:  # OPT: model.decoder
                    assert {"set_aux_hidden_state_layers", "get_eagle3_default_aux_hidden_state_layers"} <= set(
                        holder.__dict__), holder_name
            source = (MODELS / f"{name}.py").read_text()
            if "self.embed_tokens =" not in source and "self.embedding =" not in source:  # e.g. GPT-2's wte
                assert isinstance(decoder.__dict__.get("embed_tokens"), property)
        original = importlib.import_module(f"vllm.model_executor.models.{name}")
        for outcome in adapted:  # the unadapted class really lacked the contract (the test is not vacuous)
            assert "supports_aux_hidden_states_over_pp" not in getattr(original, outcome.class_name).__dict__
    finally:
        sys.modules.pop(f"vllm.model_executor.models.{name}_pipespec", None)


def test_already_correct_files_come_back_byte_identical() -> None:
    for name in ("llama", "qwen2", "sarvam"):
        source = (MODELS / f"{name}.py").read_text()
        result = adapt_vllm_module(source, label=f"vllm/model_executor/models/{name}.py")
        assert result.code == source and {d.status for d in result.decoders} == {"unchanged"}, name
    for rel in ("models/deepseek_v4/nvidia/model.py", "models/kimi_k3/nvidia/model.py", "models/minimax_m3/nvidia/model.py"):
        source = (VLLM / rel).read_text()
        result = adapt_vllm_module(source, label=f"vllm/{rel}")
        assert result.code == source and {d.status for d in result.decoders} == {"unchanged"}, rel


SUBPROCESS = """
import importlib.util, sys
from vllm.model_executor.models.interfaces import EagleModelMixin, supports_eagle3
spec = importlib.util.spec_from_file_location("vllm.model_executor.models.deepseek_v2_pipespec", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
assert "vllm.model_executor.models.deepseek_v2" not in sys.modules
assert issubclass(module.DeepseekV2Model, EagleModelMixin)
assert module.DeepseekV2Model.__dict__["supports_aux_hidden_states_over_pp"] is True
assert supports_eagle3(module.DeepseekV2ForCausalLM)
print("ok")
"""


@pytest.mark.timeout(500)
def test_deepseek_v2_adapted_imports_in_a_process_of_its_own(tmp_path: Path) -> None:
    """deepseek_v2.py registers custom ops at import (vllm::min_latency_fused_qkv_a_proj), so its adapted
    copy and the original cannot both be imported in one process: the copy is checked in its own."""
    result = adapt_vllm_module((MODELS / "deepseek_v2.py").read_text(), label="vllm/model_executor/models/deepseek_v2.py")
    assert [d.status for d in result.decoders] == ["adapted"]
    path = tmp_path / "deepseek_v2_pipespec.py"
    path.write_text(result.code)
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS, str(path)], capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_opt_wrapper_shares_the_embedding_without_registering_it_twice(tmp_path: Path) -> None:
    """OPTForCausalLM.model is an OPTModel around the PP decoder: vLLM's drafter reads
    target.model.embed_tokens, which the wrapper gets as a property (not a second registered module)."""
    result = adapt_vllm_module((MODELS / "opt.py").read_text(), label="vllm/model_executor/models/opt.py")
    path = tmp_path / "opt_pipespec.py"
    path.write_text(result.code)
    module = load_as("vllm.model_executor.models.opt_pipespec", path)
    try:
        assert isinstance(module.OPTModel.__dict__.get("embed_tokens"), property)
        assert supports_eagle3(module.OPTForCausalLM)
        assert "embed_tokens" not in importlib.import_module("vllm.model_executor.models.opt").OPTModel.__dict__
    finally:
        sys.modules.pop("vllm.model_executor.models.opt_pipespec", None)


def test_out_of_tree_module_under_a_directory_named_vllm_finds_vllm_layer_classes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An out-of-tree model in a project's ``tests/vllm/`` importing ``LlamaDecoderLayer`` from the
    installed vLLM: the layer class (and its residual rule) is read from the installed vLLM, not looked
    for under the project directory that happens to be named vllm."""
    from pathlib import Path

    from pipespec.codemods.adapt_vllm_native import adapt_vllm_module

    source = (Path(__file__).parent / "plugin_scripts" / "toy_lm.py").read_text(encoding="utf-8")
    copy = tmp_path / "tests" / "vllm" / "toy_lm.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(source, encoding="utf-8")
    result = adapt_vllm_module(source, label=str(copy), classes=["ToyLMForCausalLM"])
    assert [d.status for d in result.decoders] == ["adapted"], result.decoders
