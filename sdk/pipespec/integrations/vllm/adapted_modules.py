"""Adapted vLLM model modules: their names, their source (the vLLM-native codemod) and their import.

An adapted module is the model's own module rewritten by ``pipespec.codemods.adapt_vllm_native``. It is
imported under a name that says everything needed to rebuild it in any process, so vLLM's lazy
``"module:Class"`` registry entries (and ``model_class_overrides``) reach the spawned engine core and
workers with no state of ours travelling along::

    vllm.model_executor.models.mixtral__pipespec__MixtralForCausalLM      (architecture == class name)
    my_pkg.modeling__pipespec__MyForCausalLM__MyArch                       (architecture != class name)

It lives in the original module's package, so package-relative imports of an in-tree file keep working;
an out-of-tree module (outside ``vllm``) is rewritten with absolute imports. ``AdaptedModuleFinder`` (a
``sys.meta_path`` finder the plugin installs in every process) builds the module on first import: from
the cache file (``PIPESPEC_VLLM_CACHE``, default ``~/.cache/pipespec/vllm``) keyed by the source's hash,
pipespec's version, the codemod's own files and the spec, when an earlier process wrote it; else by
running the codemod in memory (a few seconds) and writing that file (``PIPESPEC_VLLM_CACHE=`` (empty):
memory only). The cache directory is trusted like vLLM's own compile cache: its files are executed.
Imports vLLM only through the original module it adapts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import linecache
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pipespec
from pipespec.atomic_write import write_atomic
from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.contract.registry import default_registry
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import PipespecError, SpecError, UnsupportedModelError, UsageError

logger = logging.getLogger("pipespec.vllm")

MARK = "__pipespec__"
CACHE_ENV = "PIPESPEC_VLLM_CACHE"


@dataclass(frozen=True)
class SpecChoice:
    """The adapter spec behind an adaptation (None: the codemod infers it) and how logs name it."""

    spec: AdapterSpec | None
    label: str  # "built-in gemma2", "PIPESPEC_ADAPTERS_PATH my.toml", "@pipespec.adapter foo", "inferred"


@dataclass(frozen=True, kw_only=True)
class AdaptedSource:
    """One adapted module's source and what the codemod said about the requested class."""

    module_name: str
    original_module: str
    class_name: str
    architecture: str
    code: str
    source_file: str
    spec: SpecChoice
    status: DecoderStatus  # what the codemod did with the class's decoder (only ADAPTED code is imported)
    reason: str
    cache_file: Path | None
    key: str  # hash of everything the code depends on (``_build_key``)


def adapted_module_name(original_module: str, class_name: str, architecture: str) -> str:
    """The importable name of ``original_module`` adapted for ``class_name`` registered as ``architecture``."""
    tail = class_name if architecture == class_name else f"{class_name}__{architecture}"
    return f"{original_module}{MARK}{tail}"


def parse_adapted_module_name(name: str) -> tuple[str, str, str] | None:
    """``(original module, class name, architecture)`` of an adapted module's name, else None."""
    original, mark, tail = name.rpartition(MARK)
    if not mark or not original or not tail:
        return None
    class_name, _, architecture = tail.partition("__")
    if not class_name.isidentifier() or (architecture and not architecture.isidentifier()):
        return None
    return original, class_name, architecture or class_name


def choose_spec(architecture: str, cls: type) -> SpecChoice:
    """The registry's spec for the architecture or class (built-in, PIPESPEC_ADAPTERS_PATH, decorator).

    A vLLM-dialect spec that says ``supported = false`` refuses; a spec of the ``hf`` dialect describes
    the transformers class (its verdict and shape are about that code), so for the vLLM file the codemod
    infers the shape itself and the spec is only named.
    """
    registry = default_registry()
    entry = registry.lookup_entry(architecture) or registry.lookup_entry(cls)
    if entry is None:
        return SpecChoice(None, "inferred")
    spec = entry.spec
    where = {"builtin": "built-in", "path": "PIPESPEC_ADAPTERS_PATH", "decorator": "@pipespec.adapter"}[entry.origin]
    label = f"{where} {spec.name}" if entry.origin != "path" else f"{where} {Path(spec.source).name}"
    if spec.dialect != "vllm":
        return SpecChoice(None, f"inferred; {label} describes the transformers class")
    if not spec.supported:
        raise UnsupportedModelError(
            f"{architecture} does not support EAGLE3 hidden-state capture: {spec.reason.rstrip('.')} "
            f"({spec.source} says supported = false). Remove or fix that spec to let pipespec adapt the class"
        )
    _check_decoder_class(spec, cls)
    return SpecChoice(spec, label)


def _check_decoder_class(spec: AdapterSpec, cls: type) -> None:
    """A vLLM-dialect spec must name a class that exists (in the model's module or where it says)."""
    try:
        module = importlib.import_module(spec.decoder_module)
    except ImportError as exc:
        found = None
        why = f"module {spec.decoder_module!r} cannot be imported ({exc})"
    else:
        found = getattr(module, spec.decoder_class_name, None)
        why = f"module {spec.decoder_module} has no class {spec.decoder_class_name!r}"
    if not isinstance(found, type):
        raise SpecError(
            f"{spec.source}: adapter.decoder_class = {spec.decoder_class!r}: {why}; name the decoder class "
            f"{cls.__name__} builds (in {cls.__module__}), as `module:Class`"
        )


def _cache_dir() -> Path | None:
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value) if value.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pipespec" / "vllm"


@functools.lru_cache(maxsize=1)
def _codemod_fingerprint() -> str:
    """Hash of the codemod package's own files: a changed codemod never reuses an old cache entry."""
    import pipespec.codemods

    digest = hashlib.sha256()
    for path in sorted(Path(pipespec.codemods.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _build_key(module_name: str, source: str, spec: SpecChoice, source_file: str | None = None) -> str:
    """What the adapted code depends on: the source, pipespec, the codemod's files, the name, the spec,
    and for a module outside vLLM its directory's other ``*.py`` (where its layer classes may live)."""
    key = hashlib.sha256()
    siblings = ""
    if source_file is not None and not module_name.startswith("vllm."):
        siblings = "".join(p.name + p.read_text(encoding="utf-8", errors="replace")
                           for p in sorted(Path(source_file).parent.glob("*.py")) if str(p) != source_file)
    for part in (source, pipespec.__version__, _codemod_fingerprint(), module_name, repr(spec.spec), siblings):
        key.update(part.encode())
        key.update(b"\0")
    return key.hexdigest()


def _cache_path(module_name: str, key: str) -> Path | None:
    directory = _cache_dir()
    if directory is None:
        return None
    return directory / f"{module_name.rpartition('.')[2]}-{key[:16]}.py"


def _write_atomically(path: Path, text: str) -> bool:
    """Write ``path`` whole or not at all (processes starting together may write the same entry); False
    when it cannot be written (a read-only home: the module still builds in memory)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
        return True
    except (OSError, PipespecError) as exc:
        logger.debug("pipespec: cannot write the adapted-module cache %s (%s)", path, exc)
        return False


def build_adapted_source(module_name: str) -> AdaptedSource:
    """Run (or read from the cache) the vLLM-native codemod for the adapted module ``module_name``."""
    parsed = parse_adapted_module_name(module_name)
    if parsed is None:
        raise UsageError(f"{module_name!r} is not an adapted module name (module{MARK}Class[__Architecture])")
    original, class_name, architecture = parsed
    module = importlib.import_module(original)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UsageError(f"{original} has no class {class_name!r} to adapt for {architecture}")
    source_file = inspect.getsourcefile(module)
    if source_file is None or not Path(source_file).is_file():
        raise UnsupportedModelError(f"{architecture}: the source of {original} is not readable, so pipespec cannot adapt it")
    source = Path(source_file).read_text(encoding="utf-8")
    spec = choose_spec(architecture, cls)
    key = _build_key(module_name, source, spec, source_file)
    if key in _MEMO:
        return _MEMO[key]
    cache_file = _cache_path(module_name, key)
    if cache_file is not None and cache_file.is_file():  # written by an earlier process: only adapted code is
        built = AdaptedSource(module_name=module_name, original_module=original, class_name=class_name,
                              architecture=architecture, code=cache_file.read_text(encoding="utf-8"),
                              source_file=source_file, spec=spec, status=DecoderStatus.ADAPTED, reason="", cache_file=cache_file,
                              key=key)
    else:
        built = _run_codemod(module_name, original, class_name, architecture, source, source_file, spec, key, cache_file)
    _MEMO[key] = built
    return built


def _run_codemod(module_name: str, original: str, class_name: str, architecture: str, source: str, source_file: str,
                 spec: SpecChoice, key: str, cache_file: Path | None) -> AdaptedSource:
    from pipespec.codemods.adapt_vllm_native import adapt_vllm_module
    from pipespec.codemods.vllm_native_modules import ModuleSources, imported_modules

    in_tree = original.startswith("vllm.")
    # The layer classes are read where this process imported them from (ModuleSources: the same rule as
    # adapter-gen FILE, plus the modules already imported here).
    adaptation = adapt_vllm_module(source, label=source_file, classes=[class_name], spec=spec.spec,
                                   absolute_imports=not in_tree,
                                   read_module=ModuleSources(Path(source_file), loaded=imported_modules))
    outcome = next((d for d in adaptation.decoders if class_name in d.causal_lm or d.class_name == class_name), None)
    if outcome is None:
        raise UnsupportedModelError(
            f"{architecture}: the codemod found no PP decoder behind {class_name} in {source_file}"
        )
    code = adaptation.code
    if cache_file is not None and outcome.status is DecoderStatus.ADAPTED:
        cache_file = cache_file if _write_atomically(cache_file, code) else None
    else:
        cache_file = None
    return AdaptedSource(module_name=module_name, original_module=original, class_name=class_name,
                         architecture=architecture, code=code, source_file=source_file, spec=spec,
                         status=outcome.status, reason=outcome.reason, cache_file=cache_file, key=key)


class AdaptedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``<module>__pipespec__<Class>[__<Arch>]`` as the adapted source of ``<module>``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def built(self, module_name: str) -> AdaptedSource:
        """The adapted source for ``module_name`` (the codemod runs once per process and input)."""
        with self._lock:
            return build_adapted_source(module_name)

    def import_adapted(self, module_name: str) -> ModuleType:
        """Import ``module_name``, re-executing it if an earlier import was built from other inputs."""
        built = self.built(module_name)
        loaded = sys.modules.get(module_name)
        if loaded is not None and getattr(loaded, "__pipespec_key__", None) != built.key:
            del sys.modules[module_name]
        return importlib.import_module(module_name)

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if parse_adapted_module_name(fullname) is None:
            return None
        built = self.built(fullname)
        if built.status is not DecoderStatus.ADAPTED:
            raise ImportError(f"pipespec: {built.class_name} was not adapted ({built.status}: {built.reason})", name=fullname)
        spec = importlib.util.spec_from_loader(fullname, self, origin=str(built.cache_file) if built.cache_file else None)
        if spec is not None and built.cache_file is not None:
            spec.has_location = True
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        built = self.built(module.__name__)
        filename = str(built.cache_file) if built.cache_file else f"<pipespec-adapted {built.source_file}>"
        module.__file__ = filename
        if built.cache_file is None:  # let inspect (vLLM's compile decorator, the verifier) read the source
            linecache.cache[filename] = (len(built.code), None, built.code.splitlines(True), filename)
        # dont_inherit: this file's `from __future__ import annotations` must not turn the model's
        # annotations into strings (vLLM's @support_torch_compile reads them as types).
        module.__dict__["__pipespec_key__"] = built.key
        exec(compile(built.code, filename, "exec", dont_inherit=True), module.__dict__)  # noqa: S102


_FINDER: AdaptedModuleFinder | None = None
_MEMO: dict[str, AdaptedSource] = {}


def install_finder() -> AdaptedModuleFinder:
    """Put the (one) adapted-module finder first on ``sys.meta_path``; idempotent."""
    global _FINDER
    if _FINDER is None:
        _FINDER = AdaptedModuleFinder()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return _FINDER
