"""Adapter specs: the declarative description of how aux capture works for one model family.

A spec is a TOML file in ``adapters/`` (or a directory on ``PIPESPEC_ADAPTERS_PATH``, or the
``@pipespec.adapter`` decorator). Schema and examples: docs/spec-reference.md. Every field that can
reach generated code is validated here (identifiers, dotted module paths, ints), so a spec can never
inject code into what ``adapter-gen`` writes.
"""

from __future__ import annotations

import keyword
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipespec.contract.layout import BOUNDARY_RULES, eagle3_default_aux_ids
from pipespec.errors import SpecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DIALECTS = ("hf", "vllm", "pipespec")  # pipespec: vLLM-style source run by pipespec's own runtime
CAPTURES = ("hidden", "hidden + residual")
RESIDUAL_RULES = ("reads", "rebinds")  # does a vLLM layer read the residual it is given, or rebind it first?
DEFAULT_ID_RULES = ("eagle3",)

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLASS_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")

# table -> {key: (type, required)}; what the reference documents, nothing more is accepted.
_SCHEMA: dict[str, dict[str, tuple[type | tuple[type, ...], bool]]] = {
    "adapter": {
        "name": (str, True),
        "architectures": (list, False),
        "model_types": (list, False),
        "decoder_class": (str, True),
        "dialect": (str, False),
        "supported": (bool, False),
        "reason": (str, False),
    },
    "model": {
        "layers_attr": (str, False),
        "norm_attr": (str, False),
        "embed_attr": (str, False),
        "residual": (bool, False),
        "capture": (str, False),
        "num_layers_key": (str, False),
        "residual_rule": (str, False),
    },
    "aux": {
        "default_ids": ((str, list), False),
        "boundary_rule": (str, False),
    },
    "embed": {
        "share_target_embed": (bool, False),
        "decoder_attr": (str, False),
        "embed_attr": (str, False),
    },
}
# [table] key -> AdapterSpec field, where the two differ. [embed] embed_attr is the same field as
# [model] embed_attr (the embedding the drafter shares is the decoder's input embedding); giving both
# with different values is an error.
_FIELDS = {("embed", "decoder_attr"): "embed_decoder_attr"}


@dataclass(frozen=True)
class AdapterSpec:
    """One model family's adapter spec (see docs/spec-reference.md)."""

    name: str
    decoder_class: str
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    dialect: str = "hf"
    supported: bool = True
    reason: str = ""
    layers_attr: str = "layers"
    norm_attr: str = "norm"
    embed_attr: str = "embed_tokens"
    residual: bool = False
    capture: str = "hidden"
    num_layers_key: str = "num_hidden_layers"
    residual_rule: str | None = None  # vllm dialect: "reads" | "rebinds", where the layer classes cannot be read
    default_ids: str | tuple[int, ...] = "eagle3"
    boundary_rule: str = "allow"
    share_target_embed: bool = True
    embed_decoder_attr: str | None = None  # attribute of the *ForCausalLM holding the decoder (vLLM: "model")
    source: str = field(default="<code>", compare=False)

    def __post_init__(self) -> None:
        validate_spec(self)

    @property
    def decoder_module(self) -> str:
        return self.decoder_class.split(":", 1)[0]

    @property
    def decoder_class_name(self) -> str:
        return self.decoder_class.split(":", 1)[1]

    def default_aux_ids(self, num_layers: int) -> tuple[int, ...]:
        """The aux ids to use when the draft names none."""
        if isinstance(self.default_ids, tuple):
            return tuple(sorted(set(self.default_ids)))
        return eagle3_default_aux_ids(num_layers)


def _err(source: str, key: str, value: Any, allowed: str) -> SpecError:
    return SpecError(f"{source}: {key} = {value!r} is invalid: {allowed}")


def _check_ident(source: str, key: str, value: str, dotted: bool = False) -> None:
    parts = value.split(".") if dotted else [value]
    for part in parts:
        if not _IDENT.fullmatch(part) or keyword.iskeyword(part):
            what = "a dotted path of Python identifiers" if dotted else "a Python identifier"
            raise _err(source, key, value, f"must be {what} (letters, digits, underscores; not a keyword)")


def validate_spec(spec: AdapterSpec) -> None:
    """Check every field; raise ``SpecError`` naming source, key, value and what is allowed."""
    src = spec.source
    _check_ident(src, "adapter.name", spec.name)
    if not _CLASS_PATH.fullmatch(spec.decoder_class):
        raise _err(src, "adapter.decoder_class", spec.decoder_class, "must be 'package.module:ClassName'")
    _check_ident(src, "adapter.decoder_class", spec.decoder_module, dotted=True)
    _check_ident(src, "adapter.decoder_class", spec.decoder_class_name)
    for arch in spec.architectures:
        if not isinstance(arch, str):
            raise _err(src, "adapter.architectures", arch, "must be a list of class-name strings")
        _check_ident(src, "adapter.architectures", arch)
    for mt in spec.model_types:
        if not isinstance(mt, str) or not re.fullmatch(r"[a-z0-9_\-]+", mt):
            raise _err(src, "adapter.model_types", mt, "must be HF model_type strings (lowercase letters, digits, _ or -)")
    if spec.dialect not in DIALECTS:
        raise _err(src, "adapter.dialect", spec.dialect, f"use one of {', '.join(DIALECTS)}")
    if not spec.supported and not spec.reason.strip():
        raise SpecError(f"{src}: adapter.supported = false needs adapter.reason saying why the class is unsupported")
    for key in ("layers_attr", "norm_attr", "embed_attr", "num_layers_key"):
        _check_ident(src, f"model.{key}", getattr(spec, key), dotted=key != "num_layers_key")
    if spec.embed_decoder_attr is not None:
        _check_ident(src, "embed.decoder_attr", spec.embed_decoder_attr)
    if spec.capture not in CAPTURES:
        raise _err(src, "model.capture", spec.capture, f"use one of {', '.join(repr(c) for c in CAPTURES)}")
    if spec.residual_rule is not None:
        if spec.residual_rule not in RESIDUAL_RULES:
            raise _err(src, "model.residual_rule", spec.residual_rule, f"use one of {', '.join(RESIDUAL_RULES)}")
        if spec.dialect != "vllm":
            raise SpecError(f"{src}: model.residual_rule = {spec.residual_rule!r} applies to vLLM model files only "
                            f"(adapter.dialect = \"vllm\"), not to this {spec.dialect}-dialect spec of "
                            f"{spec.decoder_class}: remove it, or set adapter.dialect = \"vllm\"")
    if spec.capture == "hidden + residual" and not spec.residual:
        raise SpecError(f"{src}: model.capture = 'hidden + residual' needs model.residual = true")
    if isinstance(spec.default_ids, str):
        if spec.default_ids not in DEFAULT_ID_RULES:
            raise _err(src, "aux.default_ids", spec.default_ids, f"use {', '.join(DEFAULT_ID_RULES)} or a list of ints")
    else:
        for i in spec.default_ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise _err(src, "aux.default_ids", i, "every id must be a non-negative integer (a layer index)")
    if spec.boundary_rule not in BOUNDARY_RULES:
        raise _err(src, "aux.boundary_rule", spec.boundary_rule, f"use one of {', '.join(BOUNDARY_RULES)}")


def spec_from_mapping(data: Mapping[str, Any], source: str) -> AdapterSpec:
    """Build a spec from parsed TOML tables, rejecting unknown tables/keys and wrong types."""
    kwargs: dict[str, Any] = {}
    for table, body in data.items():
        if table not in _SCHEMA:
            raise SpecError(f"{source}: unknown table [{table}]: allowed tables are {', '.join('[' + t + ']' for t in _SCHEMA)}")
        if not isinstance(body, Mapping):
            raise SpecError(f"{source}: {table} must be a table ([{table}]), got {type(body).__name__}")
        for key, value in body.items():
            if key not in _SCHEMA[table]:
                raise SpecError(f"{source}: unknown key {table}.{key}: allowed keys in [{table}] are {', '.join(_SCHEMA[table])}")
            typ, _ = _SCHEMA[table][key]
            if isinstance(value, bool) and typ is not bool:
                raise _err(source, f"{table}.{key}", value, f"expected {_type_name(typ)}, got a boolean")
            if not isinstance(value, typ):
                raise _err(source, f"{table}.{key}", value, f"expected {_type_name(typ)}, got {type(value).__name__}")
            name = _FIELDS.get((table, key), key)
            value = tuple(value) if isinstance(value, list) else value
            if name in kwargs and kwargs[name] != value:
                raise SpecError(f"{source}: {table}.{key} = {value!r} contradicts the other {key} = {kwargs[name]!r} "
                                "([model] and [embed] name the same embedding): keep one")
            kwargs[name] = value
    for table, keys in _SCHEMA.items():
        for key, (_, required) in keys.items():
            if required and key not in kwargs:
                raise SpecError(f"{source}: missing required key {table}.{key}")
    return AdapterSpec(source=source, **kwargs)


def _type_name(typ: type | tuple[type, ...]) -> str:
    names = {str: "a string", list: "a list", bool: "true or false", int: "an integer"}
    if isinstance(typ, tuple):
        return " or ".join(names.get(t, t.__name__) for t in typ)
    return names.get(typ, typ.__name__)


def load_spec(path: str | Path) -> AdapterSpec:
    """Read and validate one ``adapters/*.toml`` file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read adapter spec: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: TOML syntax error: {exc}") from None
    return spec_from_mapping(data, str(path))
