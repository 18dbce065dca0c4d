"""Draft checkpoints: Format A/B round trips, aux-id conventions, and every validation error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from pipespec.engine.draft.model import Eagle3Draft
from pipespec.engine.draft_checkpoint.conventions import to_input_index
from pipespec.engine.draft_checkpoint.formats import detect_draft_format
from pipespec.engine.draft_checkpoint.info import TargetInfo
from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint
from pipespec.engine.draft_checkpoint.read import inspect_draft_checkpoint
from pipespec.engine.draft_checkpoint.write import save_draft_checkpoint
from pipespec.engine.tiny_checkpoints import make_random_draft
from pipespec.errors import CheckpointError, UsageError

N = 8
TARGET_CONFIG = LlamaConfig(hidden_size=32, vocab_size=80, num_hidden_layers=N, rms_norm_eps=1e-5)
TARGET = TargetInfo.from_config(TARGET_CONFIG)
DEFAULT_IDS = (2, 4, 5)  # (2, N//2, N-3) for N = 8


def _embed(vocab: int = 80, hidden: int = 32) -> nn.Embedding:
    gen = torch.Generator().manual_seed(11)
    emb = nn.Embedding(vocab, hidden)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, hidden, generator=gen))
    return emb


def _write(tmp: Path, fmt: str = "B", *, with_embedding: bool = False, draft_vocab: int | None = 48,
           ids: tuple[int, ...] | None = DEFAULT_IDS, **kwargs: Any) -> tuple[Path, Eagle3Draft]:
    draft = make_random_draft(TARGET_CONFIG, num_aux=3, with_embedding=with_embedding, draft_vocab_size=draft_vocab, seed=4)
    path = save_draft_checkpoint(draft, tmp / f"draft{fmt}", format=fmt, aux_layers=ids, **kwargs)  # type: ignore[arg-type]
    return path, draft


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _outputs(draft: Eagle3Draft) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 80, (2, 6), generator=gen)
    aux = [torch.randn(2, 6, 32, generator=gen) for _ in range(3)]
    with torch.no_grad():
        hidden = draft(ids, draft.combine_aux(aux))
        return torch.cat((hidden, draft.logits(hidden), draft.greedy_target_ids(hidden)[..., None].float()), dim=-1)


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", ["A", "B"])
@pytest.mark.parametrize("with_embedding", [True, False])
def test_round_trip_gives_identical_outputs(tmp_path: Path, fmt: str, with_embedding: bool) -> None:
    path, original = _write(tmp_path, fmt, with_embedding=with_embedding)
    embed = _embed()
    if not with_embedding:
        original.embed_tokens = embed
    loaded = load_draft_checkpoint(path, TARGET, target_embed=embed)
    assert loaded.info.format == fmt
    assert loaded.embedding == ("own" if with_embedding else "shared")
    assert (loaded.model.embed_tokens is embed) == (not with_embedding)  # shared, not copied
    assert torch.equal(loaded.model.d2t, original.d2t) and torch.equal(loaded.model.t2d, original.t2d)
    assert torch.equal(_outputs(loaded.model), _outputs(original))
    assert loaded.info.aux_layers == DEFAULT_IDS
    assert loaded.bytes_read == sum(t.numel() * t.element_size() for t in load_file(str(path / "model.safetensors")).values())


@pytest.mark.parametrize("fmt", ["A", "B"])
def test_full_vocabulary_draft_is_written_without_vocab_maps(tmp_path: Path, fmt: str) -> None:
    """The identity map is not written (vLLM's Eagle3 models have no draft_id_to_target_id then and
    refuse the tensor); it reads back as the identity, with equal outputs."""
    path, original = _write(tmp_path, fmt, draft_vocab=80)
    assert not original.d2t.any()
    names = set(load_file(str(path / "model.safetensors")))
    assert "d2t" not in names and "t2d" not in names
    loaded = load_draft_checkpoint(path, TARGET, target_embed=_embed())
    original.embed_tokens = loaded.model.embed_tokens
    assert torch.equal(loaded.model.d2t, original.d2t) and torch.equal(loaded.model.t2d, original.t2d)
    assert torch.equal(_outputs(loaded.model), _outputs(original))
    pruned, _ = _write(tmp_path / "pruned", fmt)  # a pruned vocabulary keeps both maps
    assert {"d2t", "t2d"} <= set(load_file(str(pruned / "model.safetensors")))


def test_formats_use_their_own_tensor_names(tmp_path: Path) -> None:
    a, _ = _write(tmp_path, "A")
    b, _ = _write(tmp_path, "B")
    names_a = set(load_file(str(a / "model.safetensors")))
    names_b = set(load_file(str(b / "model.safetensors")))
    assert "midlayer.self_attn.q_proj.weight" in names_a and not any(n.startswith("layers.") for n in names_a)
    assert "layers.0.hidden_norm.weight" in names_b and not any(n.startswith("midlayer.") for n in names_b)
    cfg_a = json.loads((a / "config.json").read_text())
    cfg_b = json.loads((b / "config.json").read_text())
    assert cfg_a["architectures"] == ["LlamaForCausalLMEagle3"] and "eagle_config" in cfg_a
    assert cfg_b["architectures"] == ["Eagle3Speculator"] and "transformer_layer_config" in cfg_b
    assert "speculators_config" in cfg_b


def test_bfloat16_load_and_pytorch_bin_weights(tmp_path: Path) -> None:
    path, original = _write(tmp_path, "A", with_embedding=True)
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    loaded = load_draft_checkpoint(path, TARGET, dtype=torch.bfloat16)
    assert loaded.model.fc.weight.dtype == torch.bfloat16 and loaded.model.d2t.dtype == torch.long
    assert torch.equal(loaded.model.fc.weight, original.fc.weight.to(torch.bfloat16))


# ------------------------------------------------------------------------------ conventions
def test_format_a_reads_output_convention_by_default(tmp_path: Path) -> None:
    """SpecForge writes [1, N//2-1, N-4]; that is input-index [2, N//2, N-3]."""
    path, _ = _write(tmp_path, "A")
    assert json.loads((path / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    info = inspect_draft_checkpoint(path, TARGET)
    assert (info.aux_convention, info.aux_layers, info.config_aux_layers) == ("output", DEFAULT_IDS, (1, 3, 4))
    assert info.aux_convention_source == "format A default"
    explicit = inspect_draft_checkpoint(path, TARGET, aux_convention="input")
    assert (explicit.aux_convention, explicit.aux_layers) == ("input", (1, 3, 4))
    assert explicit.aux_convention_source == "--aux-convention"


def test_format_b_reads_input_convention_by_default(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, "B")
    info = inspect_draft_checkpoint(path, TARGET)
    assert (info.aux_convention, info.aux_layers) == ("input", DEFAULT_IDS)
    shifted = inspect_draft_checkpoint(path, TARGET, aux_convention="output")
    assert shifted.aux_layers == (3, 5, 6)
    assert shifted.to_json_dict()["aux_convention"] == "output"


def test_writer_convention_round_trips_through_the_reader(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, "B", ids=(0, 4, 8), write_convention="input")
    assert inspect_draft_checkpoint(path, TARGET).aux_layers == (0, 4, 8)
    with pytest.raises(UsageError, match="id 0 has no layer"):
        _write(tmp_path, "A", ids=(0, 4, 8))


def test_missing_ids_fall_back_to_eagle3_default_with_a_warning(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, "A", ids=None)
    info = inspect_draft_checkpoint(path, TARGET, aux_convention="output")
    assert info.aux_layers == DEFAULT_IDS and info.config_aux_layers is None
    assert info.aux_convention_source.startswith("default ids")
    assert any("EAGLE3 default" in w for w in info.warnings)


def test_to_input_index_dedupes_and_sorts() -> None:
    assert to_input_index([28, 1, 15, 15], "output") == (2, 16, 29)
    assert to_input_index([5, 2], "input") == (2, 5)
    with pytest.raises(UsageError):
        to_input_index([1], "middle")  # type: ignore[arg-type]


def test_format_detection_aliases() -> None:
    assert detect_draft_format({"architectures": ["Eagle3LlamaForCausalLM"]}) == "A"
    assert detect_draft_format({"speculators_model_type": "eagle3"}) == "B"
    with pytest.raises(CheckpointError, match="unknown draft checkpoint format"):
        detect_draft_format({"architectures": ["LlamaForCausalLM"]})


# -------------------------------------------------------------------------------- rejections
def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.pop(name)


def _set(name: str, value: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(name, value(t))


def _bad_d2t(t: dict[str, torch.Tensor]) -> torch.Tensor:
    d2t = t["d2t"].clone()
    d2t[-1] = 80  # draft id 47 -> 127, outside a vocabulary of 80
    return d2t


CONFIG_ERRORS: dict[str, tuple[str, Callable[[dict[str, Any]], None], str]] = {
    "unknown-format": ("B", lambda c: [c.__setitem__("architectures", ["MysteryDraft"]), c.pop("speculators_model_type")],
                       "unknown draft checkpoint format"),
    "id-above-n": ("B", lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [2, 4, 9]), "exceeds the target's N=8"),
    "output-id-n": ("A", lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, 8]),
                    "largest valid id is N-1"),
    "negative-id": ("B", lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [-1, 4, 5]), "negative id -1"),
    "non-integer-id": ("B", lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [2, "4", 5]), "list of integers"),
    "fc-vs-ids": ("B", lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [2, 5]), "takes 3 aux states"),
    "duplicate-ids": ("B", lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [2, 5, 5]), "resolve to 2"),
    "target-hidden": ("B", lambda c: c.__setitem__("target_hidden_size", 64), "target_hidden_size 64"),
    "vocab": ("A", lambda c: c.__setitem__("vocab_size", 81), "vocab_size 81"),
    "draft-vocab-vs-head": ("A", lambda c: c.__setitem__("draft_vocab_size", 40), "lm_head.weight has 48 rows"),
    "no-layer-config": ("B", lambda c: c.pop("transformer_layer_config"), "no transformer_layer_config"),
    "head-dim": ("B", lambda c: c["transformer_layer_config"].__setitem__("head_dim", 4),
                 "tensor layers.0.self_attn."),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors_are_checkpoint_errors(tmp_path: Path, case: str) -> None:
    fmt, edit, needle = CONFIG_ERRORS[case]
    path, _ = _write(tmp_path, fmt)
    _edit_config(path, edit)
    with pytest.raises(CheckpointError) as err:
        load_draft_checkpoint(path, TARGET, target_embed=_embed())
    assert needle in str(err.value)


TENSOR_ERRORS: dict[str, tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = {
    "missing-layer-tensor": ("B", _drop("layers.0.hidden_norm.weight"), "layers.0.hidden_norm.weight"),
    "missing-fc": ("A", _drop("fc.weight"), "missing tensor fc.weight"),
    "missing-d2t": ("A", _drop("d2t"), "missing tensor d2t"),
    "fc-not-multiple": ("A", _set("fc.weight", lambda t: torch.zeros(32, 95)), "not a multiple"),
    "fc-rows": ("A", _set("fc.weight", lambda t: torch.zeros(31, 96)), "expected [32, k*H_t]"),
    "d2t-out-of-range": ("B", _set("d2t", _bad_d2t), "outside the target vocabulary"),
    "d2t-float": ("B", _set("d2t", lambda t: t["d2t"].float()), "integer tensor"),
    "t2d-disagrees": ("B", _set("t2d", lambda t: ~t["t2d"]), "t2d disagrees with d2t"),
    "t2d-size": ("B", _set("t2d", lambda t: t["t2d"][:79]), "tensor t2d has shape [79], expected [80]"),
    "embed-shape": ("A", _set("embed_tokens.weight", lambda t: torch.zeros(81, 32)), "embed_tokens.weight has shape"),
}


@pytest.mark.parametrize("case", list(TENSOR_ERRORS))
def test_tensor_errors_are_checkpoint_errors(tmp_path: Path, case: str) -> None:
    fmt, edit, needle = TENSOR_ERRORS[case]
    path, _ = _write(tmp_path, fmt, with_embedding=True)
    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError) as err:
        load_draft_checkpoint(path, TARGET, target_embed=_embed())
    assert needle in str(err.value)


def test_full_vocabulary_draft_needs_no_d2t(tmp_path: Path) -> None:
    path, original = _write(tmp_path, "A", draft_vocab=None, with_embedding=True)
    assert not {"d2t", "t2d"} & set(load_file(str(path / "model.safetensors")))  # as other tools write it too
    loaded = load_draft_checkpoint(path, TARGET)
    assert int(loaded.model.d2t.abs().sum()) == 0 and bool(loaded.model.t2d.all())
    assert torch.equal(_outputs(loaded.model), _outputs(original))


def test_no_embedding_anywhere_is_an_error(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, "B")
    with pytest.raises(CheckpointError, match="no embed_tokens weights"):
        load_draft_checkpoint(path, TARGET, target_embed=None)


def test_draft_hidden_differs_from_target_without_embedding(tmp_path: Path) -> None:
    draft = make_random_draft(TARGET_CONFIG, num_aux=3, hidden_size=48, draft_vocab_size=48)
    path = save_draft_checkpoint(draft, tmp_path / "d", format="B", aux_layers=DEFAULT_IDS, include_embedding=False)
    with pytest.raises(CheckpointError, match="cannot share the target's input embedding"):
        inspect_draft_checkpoint(path, TARGET)
    # With its own embedding a wider draft is fine (fc maps 3 x 32 -> 48).
    draft.embed_tokens = nn.Embedding(80, 48)
    path = save_draft_checkpoint(draft, tmp_path / "d2", format="B", aux_layers=DEFAULT_IDS)
    loaded = load_draft_checkpoint(path, TARGET)
    assert loaded.model.fc.weight.shape == (48, 96) and loaded.embedding == "own"


def test_directory_problems(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        inspect_draft_checkpoint(tmp_path, TARGET)
    path, _ = _write(tmp_path, "B")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no draft weights"):
        inspect_draft_checkpoint(path, TARGET)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        inspect_draft_checkpoint(path, TARGET)


def test_bad_convention_flag_is_a_usage_error(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, "B")
    with pytest.raises(UsageError, match="--aux-convention 'middle'"):
        inspect_draft_checkpoint(path, TARGET, aux_convention="middle")  # type: ignore[arg-type]


def test_unexpected_tensors_are_reported_not_loaded(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, "B", with_embedding=True)
    _edit_tensors(path, _set("verifier_lm_head.weight", lambda t: torch.zeros(4, 4)))
    loaded = load_draft_checkpoint(path, TARGET)
    assert any("verifier_lm_head.weight" in w for w in loaded.warnings)


def test_target_info_from_multimodal_style_dict() -> None:
    info = TargetInfo.from_config({"text_config": {"num_hidden_layers": 3, "hidden_size": 16, "vocab_size": 10}})
    assert info == TargetInfo(3, 16, 10)
    with pytest.raises(CheckpointError, match="lacks"):
        TargetInfo.from_config({"hidden_size": 16})
