"""Names that CUDA-only modules export, importable on CPU, failing when used.

SGLang 0.5.23 imports a few modules at load time whose PyPI builds need CUDA (``sgl_kernel``) or
a torch other than the CPU one (``torchvision``: ``libc10_cuda.so``), on code paths the CPU engine
with ``attention_backend="torch_native"`` never runs. A stand-in makes the import succeed; every
name it hands out raises when called, so a path that does run such code fails loudly instead of
computing something made up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any, NoReturn


class StandInUsed(RuntimeError):
    """A stand-in for a CUDA-only module was called: the CPU path reached code it was said not to run."""


class Unavailable:
    """Any attribute of a stand-in module: a further ``Unavailable``; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise StandInUsed(
            f"{self._name} was called, but it is a test stand-in (tests/sglang/standins): the CPU path "
            "was expected never to call it"
        )

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        # `class X(T.Compose)` at import time: the class is defined, using it raises.
        return (_UnavailableBase,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _UnavailableBase:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInUsed(f"{type(self).__name__} subclasses a test stand-in (tests/sglang/standins)")


def module_getattr(module_name: str) -> Callable[[str], Unavailable]:
    """A module ``__getattr__`` that answers every missing name with an ``Unavailable``."""

    def __getattr__(attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{module_name}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``<package>.<sub>`` import of a stand-in package as a stand-in module."""

    def __init__(self, package: str) -> None:
        self._prefix = package + "."

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self._prefix):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"Stand-in for `{spec.name}` (tests/sglang/standins).")
        module.__path__ = []  # a package, so that deeper submodules import too
        module.__getattr__ = module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def stand_in_submodules(package: str) -> None:
    """Make ``import <package>.anything`` give a stand-in module (once per process)."""
    if not any(isinstance(f, _SubmoduleFinder) and f._prefix == package + "." for f in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleFinder(package))
