"""The zoo's comparison: what the last stage returned against the unadapted model's reference.

Relative error (max |a - b| / max |b|) of the final hidden state and of every aux state, at most
``REL_TOL``. Pure tensor arithmetic over ``reference.Reference``; imports no model code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec.integrations.transformers.zoo.reference import Reference

__all__ = ["REL_TOL", "Mismatch", "compare_stage_outputs"]

REL_TOL = 1e-5


class Mismatch(Exception):
    """The stages' output cannot be compared at all (a shape, a key or a return type is wrong)."""


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative error = max abs error / max |expected|)."""
    if actual.shape != expected.shape:
        raise Mismatch(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    diff = (actual.detach().float() - expected.detach().float()).abs().max().item()
    scale = expected.detach().float().abs().max().item()
    return diff, diff / max(scale, 1e-12)



def compare_stage_outputs(
    final_hidden: torch.Tensor,
    aux_list: Sequence[torch.Tensor],
    aux_ids: Sequence[int],
    reference: Reference,
    rel_tol: float = REL_TOL,
) -> tuple[list[str], float, float]:
    """Compare what the last stage returned with the reference.

    Returns (problems, max abs error, max relative error); no problems means the stages agree.
    ``aux_list[i]`` must be the state of ``aux_ids[i]``.
    """
    problems: list[str] = []
    worst_abs = worst_rel = 0.0

    def check(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        nonlocal worst_abs, worst_rel
        try:
            abs_err, rel = _rel_err(actual, expected)
        except Mismatch as exc:
            problems.append(f"{what}: {exc}")
            worst_abs = worst_rel = float("inf")
            return
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
        if not rel <= rel_tol:  # also catches NaN
            problems.append(f"{what}: relative error {rel:.3g} > {rel_tol:g} (max abs {abs_err:.3g})")

    check("final hidden state", final_hidden, reference.last_hidden_state)
    if len(aux_list) != len(aux_ids):
        problems.append(f"{len(aux_list)} aux states returned for ids {list(aux_ids)}")
    for layer_id, actual in zip(aux_ids, aux_list):
        expected = reference.aux.get(layer_id)
        if expected is None:
            problems.append(f"aux id {layer_id}: no reference value captured")
            continue
        check(f"aux id {layer_id}", actual, expected)
    return problems, worst_abs, worst_rel
