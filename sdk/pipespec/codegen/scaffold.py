"""``adapter-gen new MODEL_TYPE``: scaffold a new adapter — its spec TOML and its test — from jinja2 templates.

Everything is detected from the installed transformers (the decoder class and its forward's shape through
``pipespec.integrations.transformers.infer``, the config class and its field names); every value is
validated before it reaches a template (``_validated_template_values``), and the rendered spec must read
back as exactly the spec detected. Independent of the adapt runner (``source``/``decide``/``transform``):
it shares only ``spec_label`` and ``write_atomic``; torch and transformers are imported when it runs.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipespec import __version__
from pipespec.atomic_write import write_atomic
from pipespec.codegen.decide import spec_label
from pipespec.contract.registry import Registry, default_registry
from pipespec.contract.spec import AdapterSpec, spec_from_mapping
from pipespec.errors import PipespecError, UsageError
from pipespec.integrations.transformers.zoo import sizes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["TINY", "Scaffold", "scaffold_adapter", "tiny_config_kwargs"]

#: The generic tiny-model recipe (canonical HF names; mapped to each config's own field names): the zoo's sizes.
TINY = {"vocab_size": sizes.VOCAB, "hidden_size": sizes.HIDDEN, "intermediate_size": sizes.FFN,
        "num_hidden_layers": sizes.LAYERS, "num_attention_heads": sizes.HEADS, "num_key_value_heads": sizes.KV_HEADS}
_TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass
class Scaffold:
    """What ``adapter-gen new`` wrote and what to run next."""

    spec: AdapterSpec
    spec_path: Path
    test_path: Path
    verify_command: str
    written: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _py_mapping(mapping: dict[str, int | None]) -> str:
    """A dict literal with one entry per line, so a generated file keeps within the project's line length."""
    return "{" + "".join(f"\n    {key!r}: {value!r}," for key, value in mapping.items()) + "\n}"


def tiny_config_kwargs(config_cls: type, num_layers_key: str) -> dict[str, int | None]:
    """Constructor arguments of a tiny ``config_cls``: the generic recipe under the config's own field
    names (``attribute_map``: GPT-2's ``n_embd`` for ``hidden_size``), and token ids that fit its vocab."""
    import dataclasses
    import inspect

    params = inspect.signature(config_cls.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else {
        name: p.default for name, p in params.items()}
    mapping = dict(getattr(config_cls, "attribute_map", {}) or {})
    kwargs: dict[str, int | None] = {}
    for canonical, value in TINY.items():
        name = mapping.get(canonical, canonical)
        if name in params:
            kwargs[name] = value
    key = mapping.get(num_layers_key, num_layers_key)
    if key in params:
        kwargs[key] = TINY["num_hidden_layers"]
    vocab = TINY["vocab_size"]
    for name in _TOKEN_ID_FIELDS:
        default = defaults.get(name)
        if name in params and (isinstance(default, list) or (isinstance(default, int) and default >= vocab)):
            kwargs[name] = None
    return kwargs


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        import json

        return json.dumps(value)  # a JSON string (ASCII, escaped) is a valid TOML basic string
    raise UsageError(f"cannot write {value!r} into a TOML spec")


def _template_env():  # type: ignore[no-untyped-def]
    from importlib import resources

    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.files("pipespec.templates"))),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # the outputs are TOML and Python, not HTML; every value is validated instead
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["toml"] = _toml_value
    env.filters["py"] = repr
    env.filters["py_mapping"] = _py_mapping
    return env


def _validated_template_values(values: dict[str, object]) -> dict[str, object]:
    """Refuse anything that is not what its template slot expects, so no value can inject code."""
    for key in ("name", "config_name", "decoder_name", "vocab_key"):
        value = values[key]
        if not isinstance(value, str) or not value.isidentifier():
            raise UsageError(f"adapter-gen new: detected {key} {value!r} is not a Python identifier")
    for key in ("config_module", "decoder_module", "layers_attr"):
        if not isinstance(values[key], str) or not _MODULE_PATH.fullmatch(values[key]):  # type: ignore[arg-type]
            raise UsageError(f"adapter-gen new: detected {key} {values[key]!r} is not a dotted module path")
    if not re.fullmatch(r"[a-z0-9_\-]+", str(values["model_type"])):
        raise UsageError(f"adapter-gen new: model type {values['model_type']!r} is not lowercase letters, digits, _ or -")
    if not re.fullmatch(r"[a-z0-9_\-]+\.toml", str(values["spec_file"])):
        raise UsageError(f"adapter-gen new: spec file name {values['spec_file']!r} is invalid")
    tiny = values["tiny_config"]
    assert isinstance(tiny, dict)
    for k, v in tiny.items():
        if not (isinstance(k, str) and k.isidentifier() and (v is None or (isinstance(v, int) and not isinstance(v, bool)))):
            raise UsageError(f"adapter-gen new: tiny config entry {k!r} = {v!r} is not identifier = int or None")
    if not isinstance(values["num_layers"], int):
        raise UsageError(f"adapter-gen new: layer count {values['num_layers']!r} is not an integer")
    for key in ("transformers_version", "pipespec_version"):
        if not re.fullmatch(r"[0-9A-Za-z.+\-]+", str(values[key])):
            raise UsageError(f"adapter-gen new: {key} {values[key]!r} is not a version string")
    return values



@dataclass
class _Detected:
    """What the installed transformers says about a model type: its spec, classes and tiny test config."""

    spec: AdapterSpec
    decoder: type
    config_cls: type
    tiny: dict[str, int | None]
    num_layers: int  # of the tiny test model
    full_depth: int  # of the real model (the config's default): what the verify hint uses
    warnings: list[str]


def scaffold_adapter(model_type: str, out_dir: Path, force: bool = False, registry: Registry | None = None) -> Scaffold:
    """Write ``<out_dir>/adapters/<type>.toml`` and ``<out_dir>/tests/test_adapter_<name>.py`` for ``model_type``.

    Everything is detected: the decoder class and its forward's shape (``pipespec.integrations.transformers.infer``), the config
    class and its field names (tiny-model recipe). Refuses (``UsageError``) a type, architecture or
    decoder class that a spec already covers, or existing output files, unless ``force``.
    """
    if not re.fullmatch(r"[a-z0-9_\-]+", model_type):
        raise UsageError(f"model type {model_type!r} is invalid: HF model types are lowercase letters, digits, _ or -")
    found = _detect(model_type, force, registry or default_registry())
    spec = found.spec
    verify = f"pipespec verify --architecture {spec.architectures[0]} --num-layers {found.full_depth} --pp 2"
    spec_path = out_dir / "adapters" / f"{model_type}.toml"
    test_path = out_dir / "tests" / f"test_adapter_{spec.name}.py"
    written = _render_and_write(_template_values(model_type, found), spec, spec_path, test_path, force)
    from pipespec.contract.registry import builtin_adapters_dir

    on_path = spec_path.parent.resolve() == builtin_adapters_dir().resolve()
    prefix = "" if on_path else f"PIPESPEC_ADAPTERS_PATH={shlex.quote(str(spec_path.parent))} "
    verify = prefix + verify + ("" if spec.supported else "   # exits 1: the spec says unsupported")
    return Scaffold(spec, spec_path, test_path, verify, written, found.warnings)


def _detect(model_type: str, force: bool, registry: Registry) -> _Detected:
    """The spec inferred for ``model_type``'s decoder and its tiny test config; refuses a type a spec covers."""
    import transformers
    from transformers import CONFIG_MAPPING

    from pipespec.integrations.transformers.infer import (
        causal_lm_class_for_model_type,
        decoder_class_for_model_type,
        infer_spec,
    )

    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"model type {model_type!r} is unknown to the installed transformers {transformers.__version__}; "
                         "see transformers.CONFIG_MAPPING for the known types")
    lm_cls = causal_lm_class_for_model_type(model_type)
    decoder = decoder_class_for_model_type(model_type)
    inferred = infer_spec(decoder, model_type)
    for key in (model_type, lm_cls.__name__, f"{decoder.__module__}:{decoder.__name__}"):
        existing = registry.lookup(key)
        if existing is not None and not force:
            raise UsageError(f"{key} already has an adapter spec ({spec_label(existing)}); pass --force to write "
                             f"adapters/{model_type}.toml anyway")
    config_cls = CONFIG_MAPPING[model_type]
    tiny = tiny_config_kwargs(config_cls, inferred.num_layers_key)
    warnings = []
    try:
        config = config_cls(**tiny)
        num_layers = int(getattr(config, inferred.num_layers_key))
    except Exception as exc:  # the config class rejects the recipe: report it, the test will show it too
        warnings.append(f"{config_cls.__name__}(**{tiny}) fails ({type(exc).__name__}: {exc}); "
                        "adjust TINY_CONFIG in the generated test")
        num_layers = TINY["num_hidden_layers"]
    spec = AdapterSpec(
        name=inferred.name, decoder_class=inferred.decoder_class, architectures=(lm_cls.__name__,),
        model_types=(model_type,), dialect="hf", supported=inferred.supported, reason=inferred.reason,
        layers_attr=inferred.layers_attr, norm_attr=inferred.norm_attr, embed_attr=inferred.embed_attr,
        residual=inferred.residual, capture=inferred.capture, num_layers_key=inferred.num_layers_key,
        source=f"adapter-gen new {model_type}",
    )
    if not spec.supported:
        warnings.append(f"{decoder.__name__} cannot be adapted ({spec.reason}); the spec records supported = false")
    try:  # the verify hint uses the real model's depth (the config's default), not the tiny test model's
        full_depth = int(getattr(config_cls(), spec.num_layers_key))
    except Exception:
        full_depth = num_layers
    return _Detected(spec, decoder, config_cls, tiny, num_layers, full_depth, warnings)


def _template_values(model_type: str, found: _Detected) -> dict[str, object]:
    """The templates' values, validated (``_validated_template_values``)."""
    import transformers

    spec, decoder, config_cls = found.spec, found.decoder, found.config_cls
    mapping: dict[str, Any] = dict(getattr(config_cls, "attribute_map", {}) or {})
    return _validated_template_values({
        "model_type": model_type, "name": spec.name, "spec_file": f"{model_type}.toml",
        "decoder_class": spec.decoder_class, "decoder_module": decoder.__module__, "decoder_name": decoder.__name__,
        "config_class": f"{config_cls.__module__}:{config_cls.__name__}", "config_module": config_cls.__module__,
        "config_name": config_cls.__name__, "architectures": list(spec.architectures), "supported": spec.supported,
        "reason": spec.reason, "layers_attr": spec.layers_attr, "norm_attr": spec.norm_attr,
        "embed_attr": spec.embed_attr, "residual": spec.residual, "capture": spec.capture,
        "num_layers_key": spec.num_layers_key, "tiny_config": found.tiny, "num_layers": found.num_layers,
        "vocab_key": mapping.get("vocab_size", "vocab_size"),
        "transformers_version": transformers.__version__, "pipespec_version": __version__,
    })


def _render_and_write(
    values: dict[str, object], spec: AdapterSpec, spec_path: Path, test_path: Path, force: bool
) -> list[Path]:
    """Render both templates, check the spec reads back as ``spec``, refuse existing files, write them."""
    env = _template_env()
    rendered = {spec_path: env.get_template("adapter_spec.toml.j2").render(**values),
                test_path: env.get_template("test_adapter.py.j2").render(**values)}
    loaded = spec_from_mapping(tomllib.loads(rendered[spec_path]), str(spec_path))
    if loaded != spec:  # the contract: what we write loads, and says exactly what we detected
        raise PipespecError(f"{spec_path}: the rendered spec reads back as {loaded}, not {spec} (a pipespec bug)")
    for path in rendered:
        if path.exists() and not force:
            raise UsageError(f"{path} exists; pass --force to overwrite it")
    written = []
    for path, text in rendered.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
        written.append(path)
    return written
