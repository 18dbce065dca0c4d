"""The adapter registry: which spec covers which architecture or class.

Sources, from lowest to highest precedence:

1. ``builtin``   — the specs shipped in ``pipespec.adapters`` (the repo's ``adapters/``);
2. ``path``      — ``*.toml`` in each directory of ``PIPESPEC_ADAPTERS_PATH`` (``os.pathsep``-separated);
3. ``decorator`` — ``@pipespec.adapter(...)`` on a model class.

A higher source overrides a lower one for the same architecture or class (so a user can fix a shipped
spec without forking pipespec); the overridden spec then answers for none of its keys. Two specs of the
*same* source claiming one architecture or class is an error naming both, because nothing says which one
the user meant.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pipespec.contract.spec import AdapterSpec, load_spec
from pipespec.errors import SpecError

ORIGINS = ("builtin", "path", "decorator")
ENV_VAR = "PIPESPEC_ADAPTERS_PATH"


@dataclass(frozen=True)
class RegistryEntry:
    spec: AdapterSpec
    origin: str
    cls: type | None = None


def class_path(cls: type) -> str:
    """``module:Name`` of a class, the form specs use in ``decoder_class``."""
    return f"{cls.__module__}:{cls.__name__}"


def builtin_adapters_dir() -> Path:
    return Path(str(resources.files("pipespec.adapters")))


class Registry:
    """Specs by architecture name, model type and decoder class."""

    def __init__(self, dirs: Iterable[tuple[str, Path]] | None = None) -> None:
        self._entries: list[RegistryEntry] = []
        self._by_key: dict[tuple[str, str], RegistryEntry] = {}
        for origin, directory in dirs if dirs is not None else _default_dirs():
            self.load_dir(directory, origin)

    # ------------------------------------------------------------------ building
    def load_dir(self, directory: str | Path, origin: str = "path") -> list[AdapterSpec]:
        directory = Path(directory)
        if not directory.is_dir():
            raise SpecError(f"{ENV_VAR}: {directory} is not a directory: list directories holding adapter *.toml files")
        specs = [load_spec(p) for p in sorted(directory.glob("*.toml"))]
        for spec in specs:
            self.add(spec, origin)
        return specs

    def add(self, spec: AdapterSpec, origin: str, cls: type | None = None) -> None:
        if origin not in ORIGINS:
            raise ValueError(f"unknown registry origin {origin!r}")
        entry = RegistryEntry(spec, origin, cls)
        keys = [("arch", a) for a in spec.architectures] + [("type", t) for t in spec.model_types]
        keys.append(("class", spec.decoder_class))
        for key in keys:
            old = self._by_key.get(key)
            if old is None or ORIGINS.index(origin) > ORIGINS.index(old.origin):
                continue
            if old.origin == origin and old.spec.source != spec.source:
                raise SpecError(
                    f"{spec.source} and {old.spec.source} both claim {key[0]} {key[1]!r} ({origin} specs): "
                    "keep one of them, or move the override to a higher-precedence source (PIPESPEC_ADAPTERS_PATH or the decorator)"
                )
        # An override supersedes the overridden spec as a whole: none of its keys keep answering.
        rank = ORIGINS.index(origin)
        higher = {k for k in keys if k in self._by_key and ORIGINS.index(self._by_key[k].origin) > rank}
        superseded = {id(self._by_key[k]) for k in keys if k in self._by_key and k not in higher}
        self._by_key = {k: e for k, e in self._by_key.items() if id(e) not in superseded}
        for key in keys:
            if key not in higher:
                self._by_key[key] = entry
        self._entries.append(entry)

    # ------------------------------------------------------------------ queries
    def entries(self) -> list[RegistryEntry]:
        """Entries that are the effective answer for at least one key, in load order."""
        live = {id(e) for e in self._by_key.values()}
        return [e for e in self._entries if id(e) in live]

    def lookup(self, what: str | type) -> AdapterSpec | None:
        """The spec for an architecture name (``"LlamaForCausalLM"``), a model type, ``module:Class``, or a class."""
        entry = self.lookup_entry(what)
        return entry.spec if entry else None

    def lookup_entry(self, what: str | type) -> RegistryEntry | None:
        if isinstance(what, type):
            return self.entry_for_class(what)
        for kind in ("arch", "class", "type"):
            entry = self._by_key.get((kind, what))
            if entry is not None:
                return entry
        return None

    def entry_for_class(self, cls: type) -> RegistryEntry | None:
        """The entry that names exactly ``cls`` (not a parent): by decorator identity or ``module:Name``."""
        for entry in reversed(self._entries):
            if entry.cls is cls:
                return self._by_key.get(("class", entry.spec.decoder_class), entry)
        entry = self._by_key.get(("class", class_path(cls)))
        if entry is not None and (entry.cls is None or entry.cls is cls):
            return entry
        return None


def _default_dirs() -> list[tuple[str, Path]]:
    dirs = [("builtin", builtin_adapters_dir())]
    for part in os.environ.get(ENV_VAR, "").split(os.pathsep):
        if part.strip():
            dirs.append(("path", Path(part.strip())))
    return dirs


_DEFAULT: Registry | None = None
_DEFAULT_ENV: str | None = None
_DECORATED: list[tuple[AdapterSpec, type]] = []


def default_registry() -> Registry:
    """The process registry: built-in specs + ``PIPESPEC_ADAPTERS_PATH`` + decorated classes.

    Rebuilt when ``PIPESPEC_ADAPTERS_PATH`` changes, so tests and tools can point it elsewhere.
    """
    global _DEFAULT, _DEFAULT_ENV
    env = os.environ.get(ENV_VAR, "")
    if _DEFAULT is None or env != _DEFAULT_ENV:
        registry = Registry()
        for spec, cls in _DECORATED:
            registry.add(spec, "decorator", cls)
        _DEFAULT, _DEFAULT_ENV = registry, env
    return _DEFAULT


def register_decorated(spec: AdapterSpec, cls: type) -> None:
    """Record a decorator registration (kept across registry rebuilds)."""
    _DECORATED[:] = [(s, c) for s, c in _DECORATED if c is not cls]
    _DECORATED.append((spec, cls))
    if _DEFAULT is not None:
        _DEFAULT.add(spec, "decorator", cls)


def lookup(what: str | type) -> AdapterSpec | None:
    """``default_registry().lookup(what)``."""
    return default_registry().lookup(what)
