"""Stage-scoped loading: each stage reads exactly its tensors; every broken checkpoint gets a clear error."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipespec.engine.target import build_target_stage
from pipespec.engine.tiny_checkpoints import write_tiny_target
from pipespec.errors import CheckpointError, LayoutError, UnsupportedModelError
from pipespec.pp import loading
from pipespec.pp.loading import open_checkpoint

N = 6


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("sharded") / "t", "llama", num_layers=N, max_shard_size="40KB")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("single") / "t", "qwen2", num_layers=4)


def _expected_names(names: list[str], start: int, end: int, first: bool, last: bool, embed_on_last: bool) -> set[str]:
    """What a stage owns, computed from tensor names alone (independent of the loader)."""
    out = set()
    for name in names:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            if start <= int(m.group(1)) < end:
                out.add(name)
        elif name.startswith("model.embed_tokens."):
            if first or (last and embed_on_last):
                out.add(name)
        elif name.startswith(("model.norm.", "lm_head.")):
            if last:
                out.add(name)
        else:
            raise AssertionError(f"unexpected tensor {name}")
    return out


def test_sharded_checkpoint_is_inventoried_without_reading_data(sharded: Path) -> None:
    ckpt = open_checkpoint(sharded)
    assert len(ckpt.files) > 1, "the fixture should be sharded"
    on_disk = sum(len(load_file(f)) for f in ckpt.files)
    assert len(ckpt.tensors) == on_disk
    assert ckpt.total_bytes == sum(t.numel() * t.element_size() for f in ckpt.files for t in load_file(f).values())


@pytest.mark.parametrize("embed_on_last", [False, True])
def test_each_stage_reads_exactly_its_share(sharded: Path, embed_on_last: bool) -> None:
    """Bytes read per stage = its layers (+ embedding / norm + head); the stages partition the checkpoint."""
    ckpt = open_checkpoint(sharded)
    names = sorted(ckpt.tensors)
    partition = (1, 3, 2)
    total = 0
    for rank in range(3):
        stage = build_target_stage(str(sharded), rank, 3, partition=partition, aux_layers=(2, 4), embed_on_last=embed_on_last)
        s = stage.stage
        want = _expected_names(names, s.start_layer, s.end_layer, s.is_first, s.is_last, embed_on_last)
        assert set(stage.report.loaded) == want
        assert stage.load.bytes_read == sum(ckpt.tensors[n].nbytes for n in want)
        total += stage.load.bytes_read
        # What this stage does not own was never materialised.
        layers = stage.decoder.layers
        for i, layer in enumerate(layers):
            assert layer.self_attn.q_proj.weight.is_meta == (not s.start_layer <= i < s.end_layer)
        assert stage.decoder.embed_tokens.weight.is_meta == (not (s.is_first or (s.is_last and embed_on_last)))
        assert stage.decoder.norm.weight.is_meta == (not s.is_last)
        assert not stage.decoder.rotary_emb.inv_freq.is_meta
    embed_bytes = sum(ckpt.tensors[n].nbytes for n in names if n.startswith("model.embed_tokens."))
    assert total == ckpt.total_bytes + (embed_bytes if embed_on_last else 0)


def test_loaded_weights_equal_the_checkpoint(single: Path) -> None:
    stage = build_target_stage(str(single), 1, 2, aux_layers=())
    saved = load_file(str(single / "model.safetensors"))
    assert torch.equal(stage.decoder.layers[3].self_attn.q_proj.bias, saved["model.layers.3.self_attn.q_proj.bias"])
    assert torch.equal(stage.lm_head.weight, saved["lm_head.weight"])


def test_tied_head_shares_the_embedding_on_the_last_stage(tmp_path: Path) -> None:
    path = write_tiny_target(tmp_path / "tied", "llama", num_layers=2, tie_word_embeddings=True)
    assert "lm_head.weight" not in open_checkpoint(path).tensors
    stage = build_target_stage(str(path), 1, 2)
    assert stage.lm_head.weight is stage.embed.weight
    assert not stage.lm_head.weight.is_meta


# ------------------------------------------------------------------------------------- errors
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_config_and_weights_are_named(tmp_path: Path, single: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        open_checkpoint(empty)
    (empty / "config.json").write_text((single / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"neither model.safetensors nor .*found pytorch_model.bin"):
        open_checkpoint(empty)


def test_missing_shard_is_named(tmp_path: Path, sharded: Path) -> None:
    broken = _copy(sharded, tmp_path / "b")
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{shard.name} is missing"):
        open_checkpoint(broken)


def test_missing_tensor_names_the_tensor_and_the_stage(tmp_path: Path, single: Path) -> None:
    broken = _copy(single, tmp_path / "b")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    build_target_stage(str(broken), 0, 2)  # stage 0 owns layers 0-1: unaffected
    with pytest.raises(CheckpointError, match=r"'model.layers.3.mlp.up_proj.weight' is missing .*stage 1 \(layers \[2, 4\)\)"):
        build_target_stage(str(broken), 1, 2)


def test_wrong_shape_and_dtype_are_refused(tmp_path: Path, single: Path) -> None:
    broken = _copy(single, tmp_path / "shape")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' .*shape \[7\] but the model expects \[32\]"):
        build_target_stage(str(broken), 1, 2)
    broken = _copy(single, tmp_path / "dtype")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="dtype torch.int32 but the model expects torch.float32"):
        build_target_stage(str(broken), 1, 2)


def _no_reads(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("a weight file was opened before the model was refused")


def test_unsupported_model_is_refused_before_any_weight_is_read(
    tmp_path: Path, single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "qwen2_off.toml").write_text(
        '[adapter]\nname = "qwen2_off"\narchitectures = ["Qwen2ForCausalLM"]\n'
        'decoder_class = "transformers.models.qwen2.modeling_qwen2:Qwen2Model"\n'
        'supported = false\nreason = "switched off for this test"\n'
    )
    monkeypatch.setenv("PIPESPEC_ADAPTERS_PATH", str(specs))
    monkeypatch.setattr(loading, "safe_open", _no_reads)
    with pytest.raises(UnsupportedModelError, match="switched off for this test"):
        build_target_stage(str(single), 0, 2)


def test_boundary_rule_is_enforced_before_any_weight_is_read(
    tmp_path: Path, single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "qwen2_strict.toml").write_text(
        '[adapter]\nname = "qwen2_strict"\narchitectures = ["Qwen2ForCausalLM"]\n'
        'decoder_class = "transformers.models.qwen2.modeling_qwen2:Qwen2Model"\n'
        '[aux]\nboundary_rule = "reject-at-stage-end"\n'
    )
    monkeypatch.setenv("PIPESPEC_ADAPTERS_PATH", str(specs))
    monkeypatch.setattr(loading, "safe_open", _no_reads)
    with pytest.raises(LayoutError, match="aux layer id 2 ends stage 0"):
        build_target_stage(str(single), 1, 2, aux_layers=(1, 2, 4))


def test_index_pointing_at_the_wrong_shard_is_refused(tmp_path: Path, sharded: Path) -> None:
    broken = _copy(sharded, tmp_path / "b")
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[-1]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps tensor '{re.escape(name)}' to {shards[-1]}, which does not contain it"):
        open_checkpoint(broken)
