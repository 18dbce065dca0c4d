"""EAGLE3 draft checkpoints: detect the format, read the aux ids in the right convention, validate, load, save.

Two on-disk formats exist in the wild (docs/draft-formats.md has the full field tables):

* **Format A** — EAGLE reference, SpecForge, ModelOpt: ``architectures`` ``LlamaForCausalLMEagle3``
  (vLLM also accepts ``Eagle3LlamaForCausalLM``), a flat Llama config, tensors ``fc``, ``midlayer.*``,
  ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``; aux ids in
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, which SpecForge and ModelOpt write in the
  *output-of-layer* convention (id j = output of layer j = input-index j + 1).
* **Format B** — speculators: ``architectures`` ``Eagle3Speculator``, ``layers.0.*`` instead of
  ``midlayer.*``, the layer's config under ``transformer_layer_config``, top-level
  ``eagle_aux_hidden_state_layer_ids`` in the *input-index* convention, ``speculators_config``.

The convention is never guessed silently: ``aux_convention`` is an explicit setting whose default is
documented per format (A → ``output``, B → ``input``) and whose value and source are returned so the
engine prints them in every run. With no ids in the config the EAGLE3 default ``(2, N//2, N-3)``
(input-index, as the EAGLE reference hard-codes them) is used, with a warning.

Two entry points, because under PP every stage needs the aux ids but only the last one needs weights:
``inspect_draft_checkpoint`` reads config.json and tensor *headers* only; ``load_draft_checkpoint``
materialises the draft on the last stage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig

from pipespec.contract.embed import maybe_share_target_embed
from pipespec.contract.layout import eagle3_default_aux_ids
from pipespec.engine.draft import Eagle3Draft, Eagle3DraftConfig
from pipespec.errors import CheckpointError, UsageError

__all__ = [
    "ARCHITECTURES_A",
    "ARCHITECTURES_B",
    "DEFAULT_CONVENTION",
    "DraftCheckpointInfo",
    "LoadedDraft",
    "TargetInfo",
    "detect_draft_format",
    "inspect_draft_checkpoint",
    "load_draft_checkpoint",
    "save_draft_checkpoint",
    "to_input_index",
]

DraftFormat = Literal["A", "B"]
AuxConvention = Literal["input", "output"]

ARCHITECTURES_A = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ARCHITECTURES_B = ("Eagle3Speculator",)
DEFAULT_CONVENTION: dict[str, AuxConvention] = {"A": "output", "B": "input"}
FORMAT_NAMES = {"A": "Format A (EAGLE/SpecForge/ModelOpt, midlayer.*)", "B": "Format B (speculators, layers.0.*)"}
CONVENTIONS = ("input", "output")

# Keys of a Llama config that shape the draft's decoder layer; everything else in a draft config is
# metadata (architectures, eagle_config, speculators_config, dtype ...).
_LAYER_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "mlp_bias", "vocab_size",
)
_LAYER_PREFIX = {"A": "midlayer.", "B": "layers.0."}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class TargetInfo:
    """What the draft is checked against: the target's N, hidden size and vocabulary size."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> TargetInfo:
        """From a transformers config (or its dict); multimodal configs contribute their text config."""
        if isinstance(config, Mapping):
            config = dict(config.get("text_config") or config)
            get = config.get
        else:
            if hasattr(config, "get_text_config"):
                config = config.get_text_config()
            def get(key: str) -> Any:
                return getattr(config, key, None)
        values = {"num_layers": get("num_hidden_layers"), "hidden_size": get("hidden_size"), "vocab_size": get("vocab_size")}
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise CheckpointError(f"the target config lacks {missing}: cannot check a draft against it")
        return cls(**{k: int(v) for k, v in values.items()})


@dataclass(frozen=True)
class DraftCheckpointInfo:
    """Everything about a draft checkpoint that is known without reading its weights."""

    path: Path
    format: DraftFormat
    config: Eagle3DraftConfig
    aux_convention: AuxConvention
    aux_convention_source: str
    config_aux_layers: tuple[int, ...] | None
    aux_layers: tuple[int, ...]
    has_embedding: bool
    shapes: Mapping[str, tuple[int, ...]]
    warnings: tuple[str, ...] = ()

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.format]

    def to_json_dict(self) -> dict[str, Any]:
        """The fields an engine prints in every run (``aux_convention`` and ``aux_layers`` included)."""
        return {
            "draft_format": self.format,
            "aux_convention": self.aux_convention,
            "aux_convention_source": self.aux_convention_source,
            "draft_config_aux_layers": list(self.config_aux_layers) if self.config_aux_layers is not None else None,
            "aux_layers": list(self.aux_layers),
            "draft_vocab_size": self.config.draft_vocab_size,
            "draft_has_embedding": self.has_embedding,
            "warnings": list(self.warnings),
        }


@dataclass
class LoadedDraft:
    """A materialised draft plus how it was read. ``embedding`` is ``"own"`` or ``"shared"``."""

    model: Eagle3Draft
    info: DraftCheckpointInfo
    embedding: str
    bytes_read: int = 0
    warnings: list[str] = field(default_factory=list)


def to_input_index(ids: Sequence[int], convention: AuxConvention) -> tuple[int, ...]:
    """Convert ids to the input-index convention (``output`` id j is the output of layer j = input id j+1).

    >>> to_input_index([1, 15, 28], "output")
    (2, 16, 29)
    """
    if convention not in CONVENTIONS:
        raise UsageError(f"aux convention {convention!r} is unknown: use 'input' or 'output'")
    shift = 1 if convention == "output" else 0
    return tuple(sorted({int(i) + shift for i in ids}))


def detect_draft_format(config: Mapping[str, Any], where: str = "config.json") -> DraftFormat:
    """Format A or B from ``architectures`` (speculators' ``speculators_model_type`` also counts)."""
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if any(a in ARCHITECTURES_A for a in archs):
        return "A"
    if any(a in ARCHITECTURES_B for a in archs) or config.get("speculators_model_type") == "eagle3":
        return "B"
    raise CheckpointError(
        f"{where}: unknown draft checkpoint format (architectures {list(archs)}): pipespec reads EAGLE3 drafts in "
        f"Format A (architectures {list(ARCHITECTURES_A)}) or Format B (architectures {list(ARCHITECTURES_B)}); "
        "see docs/draft-formats.md"
    )


# ---------------------------------------------------------------------------------------- reading
def _read_config(path: Path) -> dict[str, Any]:
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


def _weight_files(path: Path) -> list[Path]:
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


def _tensor_shapes(files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: weight file listed in the index is missing")
        if file.suffix == ".bin":
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            shapes.update({k: tuple(v.shape) for k, v in state.items()})
            continue
        with _open_safetensors(file) as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _open_safetensors(file: Path) -> Any:
    """``safe_open``, with a truncated or corrupt file reported as a ``CheckpointError`` naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc}): re-download or re-export the draft") from None


def _read_tensors(files: Sequence[Path]) -> tuple[dict[str, torch.Tensor], int]:
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    for file in files:
        if file.suffix == ".bin":
            part = dict(torch.load(file, map_location="cpu", weights_only=True))
        else:
            with _open_safetensors(file) as handle:
                part = {key: handle.get_tensor(key) for key in handle.keys()}
        nbytes += sum(t.numel() * t.element_size() for t in part.values())
        tensors.update(part)
    return tensors, nbytes


def _canonical_name(name: str, fmt: DraftFormat) -> str:
    prefix = _LAYER_PREFIX[fmt]
    return "midlayer." + name[len(prefix):] if name.startswith(prefix) else name


def _disk_name(name: str, fmt: DraftFormat) -> str:
    """The name a canonical (``midlayer.*``) tensor has in a ``fmt`` checkpoint, for error messages."""
    return _LAYER_PREFIX[fmt] + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _layer_config(raw: Mapping[str, Any], where: str) -> LlamaConfig:
    values = {k: raw[k] for k in _LAYER_KEYS if k in raw and raw[k] is not None}
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in values]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}: cannot size the draft's decoder layer")
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    return LlamaConfig(num_hidden_layers=1, **values)


def inspect_draft_checkpoint(
    path: str | Path, target: TargetInfo, aux_convention: AuxConvention | None = None
) -> DraftCheckpointInfo:
    """Read a draft's config and tensor headers, resolve its aux ids, and validate it against ``target``.

    Reads no tensor data (safetensors headers only), so every pipeline stage can call it before loading
    target weights. Raises ``CheckpointError`` naming the field and the fix for anything inconsistent.
    """
    path = Path(path)
    raw = _read_config(path)
    where = str(path / "config.json")
    fmt = detect_draft_format(raw, where)
    warnings: list[str] = []

    if fmt == "A":
        layer_raw: Mapping[str, Any] = raw
        eagle_config = raw.get("eagle_config") or {}
        ids_raw = eagle_config.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        ids_field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        layer_raw = raw.get("transformer_layer_config") or {}
        if not layer_raw:
            raise CheckpointError(f"{where}: Format B (speculators) config has no transformer_layer_config")
        ids_raw = raw.get("eagle_aux_hidden_state_layer_ids")
        ids_field = "eagle_aux_hidden_state_layer_ids"
        if "speculators_config" not in raw:
            warnings.append(f"{where}: Format B config has no speculators_config (read anyway)")
    layer = _layer_config(layer_raw, where if fmt == "A" else f"{where} transformer_layer_config")
    hidden = int(layer.hidden_size)
    draft_vocab = int(raw.get("draft_vocab_size") or layer_raw.get("draft_vocab_size") or layer.vocab_size)
    norm_before_residual = bool(raw.get("norm_before_residual", False))

    # ---- aux ids and their convention
    if aux_convention is not None and aux_convention not in CONVENTIONS:
        raise UsageError(f"--aux-convention {aux_convention!r} is unknown: use 'input' or 'output'")
    convention: AuxConvention = aux_convention or DEFAULT_CONVENTION[fmt]
    n = target.num_layers
    if ids_raw is None or (isinstance(ids_raw, list) and not ids_raw):
        config_ids = None
        aux_layers = eagle3_default_aux_ids(n)
        source = "default ids (none in the checkpoint)"
        warnings.append(
            f"{where} has no {ids_field}: using the EAGLE3 default (2, N//2, N-3) = {list(aux_layers)} "
            f"(input-index) for N={n}; the aux convention does not apply"
        )
    else:
        if not isinstance(ids_raw, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids_raw):
            raise CheckpointError(f"{where}: {ids_field} must be a list of integers, got {ids_raw!r}")
        config_ids = tuple(ids_raw)
        negative = [i for i in config_ids if i < 0]
        if negative:
            raise CheckpointError(f"{where}: {ids_field} contains negative id {negative[0]}: layer ids are >= 0")
        aux_layers = to_input_index(config_ids, convention)
        source = "--aux-convention" if aux_convention is not None else f"format {fmt} default"
        too_big = [i for i in aux_layers if i > n]
        if too_big:
            hint = " (written in the output convention, the largest valid id is N-1)" if convention == "output" else ""
            raise CheckpointError(
                f"{where}: aux id {too_big[0]} (input-index, from {list(config_ids)} read as '{convention}') exceeds the "
                f"target's N={n} layers{hint}; check --aux-convention or the draft's target"
            )

    # ---- tensors
    shapes_raw = _tensor_shapes(_weight_files(path))
    shapes = {_canonical_name(k, fmt): v for k, v in shapes_raw.items()}
    fc = shapes.get("fc.weight")
    if fc is None:
        raise CheckpointError(f"{path}: missing tensor fc.weight (the k*H_t -> H projection of aux states)")
    if len(fc) != 2 or fc[0] != hidden:
        raise CheckpointError(f"{path}: fc.weight has shape {list(fc)}, expected [{hidden}, k*H_t] for hidden_size {hidden}")
    target_hidden = raw.get("target_hidden_size") or layer_raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != target.hidden_size:
        raise CheckpointError(
            f"{where}: target_hidden_size {target_hidden} does not match the target's hidden_size {target.hidden_size}: "
            "this draft was trained for another target"
        )
    if fc[1] % target.hidden_size:
        raise CheckpointError(
            f"{path}: fc.weight takes {fc[1]} inputs, not a multiple of the target's hidden_size {target.hidden_size}: "
            "this draft was trained for another target"
        )
    num_aux = fc[1] // target.hidden_size
    if num_aux != len(aux_layers):
        raise CheckpointError(
            f"{path}: fc.weight takes {num_aux} aux states ({fc[1]} = {num_aux} x {target.hidden_size}) but the aux ids "
            f"resolve to {len(aux_layers)}: {list(aux_layers)} (input-index, deduplicated); fix {ids_field}"
        )
    if int(layer.vocab_size) != target.vocab_size:
        raise CheckpointError(
            f"{where}: vocab_size {layer.vocab_size} does not match the target's vocabulary ({target.vocab_size}): "
            "the draft must embed and map to the target's token ids"
        )

    config = Eagle3DraftConfig(
        layer=layer, target_hidden_size=target.hidden_size, num_aux=num_aux, draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual,
    )
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Eagle3Draft(config, with_embedding=True).state_dict().items()}

    head = shapes.get("lm_head.weight")
    if head is not None and head[0] != draft_vocab:
        raise CheckpointError(
            f"{path}: lm_head.weight has {head[0]} rows but draft_vocab_size is {draft_vocab}: the draft vocabulary "
            "and its head disagree"
        )
    has_embedding = "embed_tokens.weight" in shapes
    if has_embedding and shapes["embed_tokens.weight"] != expected["embed_tokens.weight"]:
        raise CheckpointError(
            f"{path}: embed_tokens.weight has shape {list(shapes['embed_tokens.weight'])}, expected "
            f"{list(expected['embed_tokens.weight'])} (target vocab x draft hidden)"
        )
    if not has_embedding and hidden != target.hidden_size:
        raise CheckpointError(
            f"{path}: the draft ships no embed_tokens and its hidden_size {hidden} differs from the target's "
            f"{target.hidden_size}: it cannot share the target's input embedding"
        )
    if "d2t" not in shapes and draft_vocab != target.vocab_size:
        raise CheckpointError(
            f"{path}: missing tensor d2t: the draft vocabulary ({draft_vocab}) is smaller than the target's "
            f"({target.vocab_size}), so d2t offsets are needed to map draft ids to target ids"
        )
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing = [k for k in expected if k not in optional and k not in shapes]
    if missing:
        shown = [_disk_name(k, fmt) for k in missing]
        raise CheckpointError(f"{path}: missing tensors {shown} for a {FORMAT_NAMES[fmt]} draft")
    for key, shape in shapes.items():
        if key in expected and shape != expected[key]:
            raise CheckpointError(
                f"{path}: tensor {_disk_name(key, fmt)} has shape {list(shape)}, expected {list(expected[key])} "
                "from the config (hidden_size, heads, head_dim, intermediate_size, vocab sizes)"
            )
    unexpected = sorted(k for k in shapes if k not in expected)
    if unexpected:
        warnings.append(f"{path}: ignoring tensors not part of an EAGLE3 draft: {unexpected}")

    return DraftCheckpointInfo(
        path=path, format=fmt, config=config, aux_convention=convention, aux_convention_source=source,
        config_aux_layers=config_ids, aux_layers=aux_layers, has_embedding=has_embedding, shapes=shapes,
        warnings=tuple(warnings),
    )


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor | None, target_vocab: int, path: Path) -> None:
    target_ids = torch.arange(d2t.numel(), dtype=torch.long) + d2t
    bad = ((target_ids < 0) | (target_ids >= target_vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise CheckpointError(
            f"{path}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the target vocabulary "
            f"[0, {target_vocab}) ({bad.numel()} such ids): d2t holds offsets, target id = draft id + d2t[id]"
        )
    if t2d is not None:
        if t2d.numel() != target_vocab:
            raise CheckpointError(f"{path}: t2d has {t2d.numel()} entries but the target vocabulary has {target_vocab}")
        mapped = torch.zeros(target_vocab, dtype=torch.bool)
        mapped[target_ids] = True
        if not torch.equal(mapped, t2d.bool()):
            raise CheckpointError(f"{path}: t2d disagrees with d2t: they mark different target ids as in the draft vocabulary")


def load_draft_checkpoint(
    path: str | Path,
    target: TargetInfo,
    *,
    aux_convention: AuxConvention | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    target_embed: nn.Module | None = None,
) -> LoadedDraft:
    """Materialise a draft (last stage only): validate, read its tensors, share the target embedding.

    A draft without ``embed_tokens`` takes ``target_embed`` (shared, not copied); with neither, a
    ``CheckpointError``.
    """
    info = inspect_draft_checkpoint(path, target, aux_convention)
    tensors_raw, nbytes = _read_tensors(_weight_files(info.path))
    tensors = {_canonical_name(k, info.format): v for k, v in tensors_raw.items()}
    config = info.config
    d2t = tensors.get("d2t")
    if d2t is None:
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{info.path}: d2t has dtype {d2t.dtype}, expected an integer tensor of offsets")
    d2t = d2t.long()
    t2d = tensors.get("t2d")
    _check_vocab_maps(d2t, t2d, target.vocab_size, info.path)
    if t2d is None:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True

    with torch.device("meta"):
        model = Eagle3Draft(config, with_embedding=info.has_embedding)
    state: dict[str, torch.Tensor] = {}
    for key in model.state_dict():
        if key == "d2t":
            state[key] = d2t.to(device)
        elif key == "t2d":
            state[key] = t2d.bool().to(device)
        else:
            value = tensors[key]
            if not value.dtype.is_floating_point:
                # A cast would turn integer (e.g. quantised) weights into garbage without a word.
                raise CheckpointError(
                    f"{info.path}: tensor {_disk_name(key, info.format)} has dtype {value.dtype}, expected floating point: "
                    "only floating-point weights can be cast on load"
                )
            state[key] = value.to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True)
    model.reset_rotary()
    model.to(device)
    model.eval()
    embedding = maybe_share_target_embed(model, target_embed)
    return LoadedDraft(model=model, info=info, embedding=embedding, bytes_read=nbytes, warnings=list(info.warnings))


# ---------------------------------------------------------------------------------------- writing
def _layer_config_dict(config: Eagle3DraftConfig) -> dict[str, Any]:
    layer = config.layer
    rope = dict(layer.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": int(layer.intermediate_size),
        "num_attention_heads": int(layer.num_attention_heads),
        "num_key_value_heads": int(layer.num_key_value_heads),
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(layer.rms_norm_eps),
        "hidden_act": layer.hidden_act,
        "max_position_embeddings": int(layer.max_position_embeddings),
        "rope_theta": float(rope.pop("rope_theta", 10000.0)),
        "attention_bias": bool(getattr(layer, "attention_bias", False)),
        "mlp_bias": bool(getattr(layer, "mlp_bias", False)),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def save_draft_checkpoint(
    draft: Eagle3Draft,
    path: str | Path,
    *,
    format: DraftFormat = "B",
    aux_layers: Sequence[int] | None,
    write_convention: AuxConvention | None = None,
    include_embedding: bool = True,
    dtype: torch.dtype | None = None,
    verifier: str | None = None,
    num_speculative_tokens: int = 3,
) -> Path:
    """Write ``draft`` as a Format A or B checkpoint (config.json + model.safetensors).

    ``aux_layers`` are input-index ids; they are written in ``write_convention`` (default: the format's
    documented convention, A → output, B → input) or omitted when ``None``.
    """
    if format not in ("A", "B"):
        raise UsageError(f"draft format {format!r} is unknown: use 'A' or 'B'")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = draft.config
    convention = write_convention or DEFAULT_CONVENTION[format]
    ids = None
    if aux_layers is not None:
        ids = [int(i) - (1 if convention == "output" else 0) for i in sorted(set(aux_layers))]
        if any(i < 0 for i in ids):
            raise UsageError(f"aux ids {list(aux_layers)} cannot be written in the output convention: id 0 has no layer")
    layer = _layer_config_dict(config)
    if format == "A":
        cfg: dict[str, Any] = {"architectures": [ARCHITECTURES_A[0]], **layer}
        cfg["draft_vocab_size"] = config.draft_vocab_size
        cfg["target_hidden_size"] = config.target_hidden_size
        cfg["eagle_config"] = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                               "use_last_layernorm": True}
        if ids is not None:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        cfg = {
            "architectures": [ARCHITECTURES_B[0]],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": config.draft_vocab_size,
            "norm_before_residual": config.norm_before_residual,
            "target_hidden_size": config.target_hidden_size,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
                "verifier": {"name_or_path": verifier, "architectures": []},
            },
        }
        if ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
    if config.norm_before_residual and format == "A":
        cfg["norm_before_residual"] = True
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    prefix = _LAYER_PREFIX[format]
    tensors: dict[str, torch.Tensor] = {}
    for key, value in draft.state_dict().items():
        if key.startswith("embed_tokens.") and not include_embedding:
            continue
        if key in ("d2t", "t2d"):
            tensors[key] = value.detach().cpu().contiguous()
            continue
        name = prefix + key[len("midlayer."):] if key.startswith("midlayer.") else key
        t = value.detach().cpu()
        tensors[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
