"""``pipespec.contract.names``: each name is the one the classes that carry it define, and reading it costs no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

from pipespec.contract import names


def test_the_mixin_named_for_generated_imports_is_pipespecs() -> None:
    """Generated code imports ``AUX_MIXIN`` from ``AUX_MIXIN_MODULE``: that import must resolve to the mixin."""
    from pipespec.contract.mixin import AuxHiddenStatesMixin

    assert getattr(importlib.import_module(names.AUX_MIXIN_MODULE), names.AUX_MIXIN) is AuxHiddenStatesMixin


def test_the_mixin_reads_the_attributes_generated_code_sets() -> None:
    """The codemods write these class attributes; the mixin declares (and reads) them under the same names."""
    from pipespec.contract.mixin import AuxHiddenStatesMixin

    declared = AuxHiddenStatesMixin.__annotations__
    assert {names.HAS_RESIDUAL_ATTR, names.NUM_LAYERS_KEY_ATTR} <= set(declared)


def test_reading_the_names_imports_nothing_heavy() -> None:
    """Codemods and the CLI's pure commands read the names: no torch, transformers or libcst behind them."""
    code = ("import sys, pipespec.contract.names; "
            "print(sorted(m for m in ('torch', 'transformers', 'libcst') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
