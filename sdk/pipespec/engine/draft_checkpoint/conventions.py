"""Aux-id conventions: ``input`` (input-index, vLLM/speculators) and ``output`` (output-of-layer, SpecForge).

The convention is never guessed: an explicit setting, else the format's documented default, and the value
and its source travel with the result. Pure Python over ``pipespec.contract.layout``; must not import torch,
the draft model or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pipespec.contract.layout import eagle3_default_aux_ids
from pipespec.errors import CheckpointError, UsageError

AuxConvention = Literal["input", "output"]

DEFAULT_CONVENTION: dict[str, AuxConvention] = {"A": "output", "B": "input"}
CONVENTIONS = ("input", "output")


def to_input_index(ids: Sequence[int], convention: AuxConvention) -> tuple[int, ...]:
    """Convert ids to the input-index convention (``output`` id j is the output of layer j = input id j+1).

    >>> to_input_index([1, 15, 28], "output")
    (2, 16, 29)
    """
    if convention not in CONVENTIONS:
        raise UsageError(f"aux convention {convention!r} is unknown: use 'input' or 'output'")
    shift = 1 if convention == "output" else 0
    return tuple(sorted({int(i) + shift for i in ids}))


def resolve_aux_ids(
    ids_raw: Any, ids_field: str, fmt: str, aux_convention: AuxConvention | None, n: int, where: str,
    warnings: list[str],
) -> tuple[AuxConvention, str, tuple[int, ...] | None, tuple[int, ...]]:
    """The draft config's aux ids read in their convention, for a target of ``n`` layers: (convention, its
    source, the ids as the config wrote them or None, the input-index ids)."""
    if aux_convention is not None and aux_convention not in CONVENTIONS:
        raise UsageError(f"--aux-convention {aux_convention!r} is unknown: use 'input' or 'output'")
    convention: AuxConvention = aux_convention or DEFAULT_CONVENTION[fmt]
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
    return convention, source, config_ids, aux_layers
