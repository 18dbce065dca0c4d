"""Stage-scoped loading: read only the tensors this stage owns from an HF safetensors checkpoint.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. ``open_checkpoint`` reads only the JSON parts (config, index, and the
safetensors headers — names, dtypes, shapes, byte ranges); no tensor data. ``materialize`` then takes a
module tree built on the meta device and gives real storage only to the modules that hold a wanted
tensor, copying each tensor in from ``safetensors.safe_open`` (which maps the file and reads just that
tensor's bytes). Everything else stays on meta and costs nothing.

Nothing here talks to other processes: a stage loads on its own, so a slow or failing stage cannot
deadlock the others in a collective during loading (the vLLM #50959 draft-loader deadlock).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pipespec.errors import CheckpointError, UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: where it lives and how big it is."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Checkpoint:
    """The inventory of a checkpoint directory (config + every tensor's header), no tensor data."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {what}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON ({exc}): {what}") from None


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header (8-byte length + JSON) without touching tensor data."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", raw)
            if length > 100_000_000:
                raise CheckpointError(f"{path} is not a safetensors file (header length {length} is implausible)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard {path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), int(end) - int(begin))
    return out


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Inventory an HF checkpoint directory; clear ``CheckpointError`` for each way it can be wrong."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory: pass the checkpoint directory (config.json + *.safetensors)")
    config = _read_json(directory / "config.json", "every checkpoint directory needs its config.json")
    tensors: dict[str, TensorInfo] = {}
    if (directory / INDEX_FILE).exists():
        index = _read_json(directory / INDEX_FILE, "the shard index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{directory / INDEX_FILE} has no weight_map: cannot tell which shard holds which tensor")
        headers = {}
        for shard in sorted(set(weight_map.values())):
            headers[shard] = read_safetensors_header(directory / shard)
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise CheckpointError(f"{directory / INDEX_FILE} maps tensor {name!r} to {shard}, which does not contain it")
            tensors[name] = headers[shard][name]
    elif (directory / SINGLE_FILE).exists():
        tensors = read_safetensors_header(directory / SINGLE_FILE)
    else:
        found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
        hint = f" (found {', '.join(found)}; convert it with save_pretrained(safe_serialization=True))" if found else ""
        raise CheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    return Checkpoint(directory=directory, config=config, tensors=tensors)


@dataclass
class TensorReader:
    """Reads single tensors from a checkpoint, keeping count of the bytes it read."""

    checkpoint: Checkpoint
    bytes_read: int = 0
    tensors_read: int = 0
    names_read: list[str] = field(default_factory=list)
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    def __contains__(self, name: str) -> bool:
        return name in self.checkpoint.tensors

    def info(self, name: str, needed_by: str = "") -> TensorInfo:
        try:
            return self.checkpoint.tensors[name]
        except KeyError:
            by = f" (needed by {needed_by})" if needed_by else ""
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.checkpoint.directory}{by}") from None

    def read(self, name: str, needed_by: str = "") -> torch.Tensor:
        info = self.info(name, needed_by)
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"cannot open {info.file}: {exc}") from None
            self._handles[info.file] = handle
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read tensor {name!r} from {info.file}: {exc}") from None
        self.bytes_read += info.nbytes
        self.tensors_read += 1
        self.names_read.append(name)
        return tensor

    def close(self) -> None:
        self._handles.clear()


def check_compatible(name: str, tensor: torch.Tensor, target: torch.Tensor, source: Path | str) -> None:
    """Shape must match exactly; dtype may change only within floating point (a cast on load)."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"tensor {name!r} in {source} has shape {list(tensor.shape)} but the model expects {list(target.shape)}: "
            "the checkpoint does not match its config.json"
        )
    if tensor.dtype != target.dtype and not (tensor.dtype.is_floating_point and target.dtype.is_floating_point):
        raise CheckpointError(
            f"tensor {name!r} in {source} has dtype {tensor.dtype} but the model expects {target.dtype}: "
            "only floating-point tensors can be cast on load"
        )


@dataclass
class LoadReport:
    """What ``materialize`` did, for the per-stage log line and the tests."""

    loaded: list[str] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)


def _direct_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor, bool]]:
    """(local name, tensor, persistent?) for a module's own parameters and buffers (not children's)."""
    for name, p in module.named_parameters(recurse=False):
        yield name, p, True
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    for name, b in module.named_buffers(recurse=False):
        if b is not None:
            yield name, b, name not in non_persistent


def materialize(
    root: nn.Module,
    keep_module: Callable[[str], bool],
    checkpoint_name: Callable[[str], str | None],
    reader: TensorReader,
    device: torch.device,
    init_buffers: Callable[[nn.Module], None] | None = None,
    needed_by: str = "",
) -> LoadReport:
    """Give real storage to the kept modules of a meta-built ``root`` and load their tensors.

    ``keep_module(qualified_name)`` says whether a module belongs to this stage;
    ``checkpoint_name(state_dict_name)`` maps a parameter/persistent buffer to its checkpoint key
    (``None``: not loaded from the checkpoint, e.g. a tied weight set afterwards). Non-persistent
    buffers (rotary ``inv_freq``) are not in checkpoints: ``init_buffers(module)`` recomputes them.
    """
    report = LoadReport()
    with torch.no_grad():
        for mod_name, module in root.named_modules():
            own = list(_direct_tensors(module))
            if not own or not keep_module(mod_name):
                continue
            if not any(t.is_meta for _, t, _ in own):
                continue
            module.to_empty(device=device, recurse=False)
            needs_init = False
            for local, tensor, persistent in _direct_tensors(module):
                full = f"{mod_name}.{local}" if mod_name else local
                key = checkpoint_name(full) if persistent else None
                if key is None:
                    needs_init = needs_init or not persistent
                    continue
                loaded = reader.read(key, needed_by)
                check_compatible(key, loaded, tensor, reader.checkpoint.directory)
                tensor.copy_(loaded.to(device=device, dtype=tensor.dtype))
                report.loaded.append(key)
            if needs_init:
                if init_buffers is None:
                    raise CheckpointError(f"module {mod_name!r} has non-persistent buffers and no way to compute them")
                init_buffers(module)
                report.initialized.append(mod_name)
    return report


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"``/``"bf16"`` → ``torch.bfloat16`` (for ``--dtype``)."""
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    value = getattr(torch, aliases.get(name, name), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise UsageError(f"dtype {name!r} is not a floating-point torch dtype: use float32, bfloat16 or float16")
    return value
