"""Reading a draft directory: ``config.json``, the weight files, tensor headers and tensors.

Errors name the file and the fix. Imports torch and safetensors; must not import the draft model or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipespec.errors import CheckpointError

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json: a draft checkpoint directory needs config.json + weights")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object (the draft's config), got a JSON {type(raw).__name__}")
    return raw


def weight_files(path: Path) -> list[Path]:
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a shard index ({exc}): expected a JSON object with a weight_map") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map: cannot tell which shard holds which tensor")
        return [path / str(name) for name in sorted(set(weight_map.values()))]
    if (path / "pytorch_model.bin").is_file():
        return [path / "pytorch_model.bin"]
    raise CheckpointError(f"{path}: no draft weights: expected one of {list(_WEIGHT_FILES)}")


def tensor_shapes(files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: weight file listed in the index is missing")
        if file.suffix == ".bin":
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            shapes.update({k: tuple(v.shape) for k, v in state.items()})
            continue
        with open_safetensors(file) as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def open_safetensors(file: Path) -> Any:
    """``safe_open``, with a truncated or corrupt file reported as a ``CheckpointError`` naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc}): re-download or re-export the draft") from None


def read_tensors(files: Sequence[Path]) -> tuple[dict[str, torch.Tensor], int]:
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    for file in files:
        if file.suffix == ".bin":
            part = dict(torch.load(file, map_location="cpu", weights_only=True))
        else:
            with open_safetensors(file) as handle:
                part = {key: handle.get_tensor(key) for key in handle.keys()}
        nbytes += sum(t.numel() * t.element_size() for t in part.values())
        tensors.update(part)
    return tensors, nbytes

