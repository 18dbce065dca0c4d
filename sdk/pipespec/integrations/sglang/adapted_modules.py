"""SGLang model modules rewritten by pipespec's SGLang codemod, built in memory in each process that needs them.

``adapt_model_class(cls)`` takes the class SGLang's registry resolved (``LlamaForCausalLM``), finds the decoder
it builds (``self.model = LlamaModel(...)``) and the module whose ``forward`` that decoder runs (Qwen3-MoE's
decoder inherits Qwen2-MoE's), runs ``adapt_sglang_module`` over that module and over the class's own one
(its ``set_eagle3_layers_to_capture``), and executes the adapted sources as modules named
``pipespec_sglang_adapted.<file>``; the class's module imports the adapted decoder module instead of
SGLang's. SGLang's own modules are left as they are: only the registry's answer changes.

Imports SGLang's model code (through ``cls``); used by ``adapt_at_load`` only.
"""

from __future__ import annotations

import inspect
import linecache
import re
import sys
import types
from dataclasses import dataclass
from functools import cache

from pipespec.codemods.adapt_sglang import SglangAdaptResult, adapt_sglang_module
from pipespec.codemods.sglang_outcome import SglangStatus
from pipespec.contract.names import AUX_OVER_PP_FLAG

#: The package adapted modules live under (in ``sys.modules`` only; nothing is written to disk).
PACKAGE = "pipespec_sglang_adapted"
_DECODER = re.compile(r"self\.model\s*=\s*([A-Za-z_]\w*)\s*\(")
_FACTORY = re.compile(r"self\.model\s*=\s*self\.([A-Za-z_]\w*)\s*\(")
_RETURNS = re.compile(r"return\s+([A-Za-z_]\w*)\s*\(")


@dataclass(frozen=True)
class Adaptation:
    """What the codemod made of one model class: the adapted class, or why there is none."""

    status: SglangStatus
    reason: str
    #: The SGLang files the adaptation rewrote, decoder module first.
    files: tuple[str, ...] = ()
    adapted: type | None = None

    @property
    def label(self) -> str:
        return "sglang dialect (adapt_sglang): " + " + ".join(self.files) if self.files else "sglang dialect (adapt_sglang)"


def decoder_class(cls: type) -> type | None:
    """The decoder ``cls`` builds as ``self.model``, read from its ``__init__`` (``self.model = Decoder(...)``)
    or from the factory method it calls there (Llama's ``self.model = self._init_model(...)``), or None."""
    found = _called_in(cls.__init__, _DECODER)
    if found is None:
        factory = _called_in(cls.__init__, _FACTORY)
        method = getattr(cls, factory[1], None) if factory is not None else None
        found = _called_in(method, _RETURNS) if method is not None else None
    if found is None:
        return None
    decoder = getattr(sys.modules[found[0]], found[1], None)
    return decoder if isinstance(decoder, type) else None


def _called_in(function: object, pattern: re.Pattern[str]) -> tuple[str, str] | None:
    """(module of ``function``, the name ``pattern`` captures in its source), or None."""
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    found = pattern.search(source)
    return (function.__module__, found.group(1)) if found else None  # type: ignore[attr-defined]


def forward_owner(decoder: type) -> type:
    """The class in ``decoder``'s MRO whose ``forward`` it runs."""
    return next(k for k in decoder.__mro__ if "forward" in k.__dict__)


@cache
def adapt_model_class(cls: type) -> Adaptation:
    """Adapt ``cls`` (a ``*ForCausalLM`` SGLang resolved) once per process; see the module docstring."""
    decoder = decoder_class(cls)
    if decoder is None:
        return Adaptation(SglangStatus.DECLINED, f"{cls.__name__} builds no decoder as `self.model = Decoder(...)` "
                                                 "in its __init__, so pipespec cannot find the layer loop to adapt")
    owner = forward_owner(decoder)
    owner_file = _file_name(owner.__module__)
    owner_result = adapt_sglang_module(_source(owner.__module__), label=owner_file, classes=[owner.__name__])
    try:
        outcome = owner_result.outcome(owner.__name__)
    except KeyError:
        return Adaptation(SglangStatus.DECLINED, f"{decoder.__name__}'s forward ({owner.__name__} in {owner_file}) "
                                                 "has no pipeline layer loop the codemod recognises")
    if outcome.status is not SglangStatus.ADAPTED:
        return Adaptation(outcome.status, f"{owner.__name__} in {owner_file}: {outcome.reason}", (owner_file,))
    own_file = _file_name(cls.__module__)
    own_result = owner_result if cls.__module__ == owner.__module__ else adapt_sglang_module(
        _source(cls.__module__), label=own_file, classes=[])
    setter = f"{cls.__name__}.set_eagle3_layers_to_capture"
    if "set_eagle3_layers_to_capture" in cls.__dict__ and setter not in own_result.setters:
        left = [s for s in own_result.setters_left if s.startswith(setter)]
        why = left[0] if left else f"{setter} was not rewritten"
        return Adaptation(SglangStatus.DECLINED, f"{own_file}: {why}", (owner_file, own_file))
    files = (owner_file,) if own_result is owner_result else (owner_file, own_file)
    owner_module = _execute(owner.__module__, owner_result)
    module = owner_module if own_result is owner_result else _execute(
        cls.__module__, own_result, {owner.__module__: owner_module.__name__})
    adapted = getattr(module, cls.__name__)
    adapted_decoder = decoder_class(adapted)
    if adapted_decoder is None or not getattr(adapted_decoder, AUX_OVER_PP_FLAG, False) or not \
            forward_owner(adapted_decoder).__module__.startswith(PACKAGE + "."):
        return Adaptation(SglangStatus.DECLINED, f"the adapted {cls.__name__} does not build an adapted decoder "
                                                 f"({decoder.__name__} keeps SGLang's forward)", files)
    return Adaptation(SglangStatus.ADAPTED, f"adapted from {' and '.join(files)}", files, adapted)


def _file_name(module: str) -> str:
    return module.rpartition(".")[2] + ".py"


def _source(module: str) -> str:
    return inspect.getsource(sys.modules[module])


def _execute(original: str, result: SglangAdaptResult, renames: dict[str, str] | None = None) -> types.ModuleType:
    """Run the adapted source as ``pipespec_sglang_adapted.<file>``, its imports of ``renames`` redirected."""
    code = result.code
    for old, new in (renames or {}).items():
        code = re.sub(rf"^(\s*from\s+){re.escape(old)}(\s+import\b)", rf"\g<1>{new}\g<2>", code, flags=re.M)
    name = f"{PACKAGE}.{original.rpartition('.')[2]}"
    if name in sys.modules:
        return sys.modules[name]
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE, "SGLang model modules adapted by pipespec (in memory).")
        package.__path__ = []
        sys.modules[PACKAGE] = package
    filename = f"<pipespec-adapted {sys.modules[original].__file__}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks, inspect.getsource
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        exec(compile(code, filename, "exec"), module.__dict__)  # noqa: S102 - the codemod's output of SGLang's own file
    except BaseException:
        del sys.modules[name]
        raise
    return module
