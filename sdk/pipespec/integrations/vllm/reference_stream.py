"""The reference residual stream at EAGLE3 aux ids, and the check of aux states against it.

The vLLM zoo harness (``pipespec.integrations.vllm.harness``) runs an unadapted reference model with
forward hooks on its decoder layers: id L < N is what enters layer L (``hidden_states + residual``, or
``hidden_states`` alone where the layer starts with ``residual = hidden_states`` and so ignores the
residual it is given: decided from the layer's source), id N the last layer's output before the norm.
The adapted model's aux states must equal it within ``ATOL`` (float32, same kernels).

Imports torch only (the layers are vLLM's, but nothing here imports vLLM).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ATOL", "AuxCheckError", "aux_of", "compare_aux", "layers_of", "record_stream", "uses_residual_input"]

#: Max abs error between the aux states and the reference residual stream (float32, same kernels).
ATOL = 1e-5


_LAYER_LISTS = ("layers", "h", "blocks", "layer", "decoder_layers")


def layers_of(decoder: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layer list: the usual names first, else the ModuleList spanning ``end_layer``."""
    for name in _LAYER_LISTS:
        layers = getattr(decoder, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    end = getattr(decoder, "end_layer", None)
    for child in decoder.children():
        if isinstance(child, torch.nn.ModuleList) and isinstance(end, int) and len(child) >= end > 0:
            return child
    raise RuntimeError(f"{type(decoder).__name__} has no layer ModuleList ({', '.join(_LAYER_LISTS)}) to read the reference from")


_RESIDUAL_USE: dict[type, bool] = {}


def uses_residual_input(layer_cls: type) -> bool:
    """Whether ``layer_cls.forward`` reads the ``residual`` it is given.

    Layers written like PhiMoE's, EXAONE-4's or Cohere's start with ``residual = hidden_states``: the
    residual passed in (and the one they return) is stale, the hidden states already include it, so the
    stream at such a layer is ``hidden_states`` alone, not ``hidden_states + residual``; StableLM's takes
    no residual at all. Decided from the source: the first use of the name ``residual`` in ``forward``
    is a read (True) or an assignment (False); no ``residual`` parameter is False.
    """
    if layer_cls in _RESIDUAL_USE:
        return _RESIDUAL_USE[layer_cls]
    answer = False  # a layer that takes no residual passes the whole stream as hidden_states
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(layer_cls.forward)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    func = tree.body[0] if tree is not None and tree.body else None
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and "residual" in [a.arg for a in func.args.args]:
        answer = _first_use(func.body, "residual") == "load"
    _RESIDUAL_USE[layer_cls] = answer
    return answer


def _names(node: ast.AST | None, name: str, ctx: type) -> bool:
    return node is not None and any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ctx)
                                    for n in ast.walk(node))


def _first_use(body: list[ast.stmt], name: str) -> str | None:
    """"load" or "store": how ``name`` is first used when ``body`` runs (values before targets)."""
    for stmt in body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if isinstance(stmt, ast.AugAssign) and _names(stmt.target, name, ast.Store):
                return "load"
            if _names(stmt.value, name, ast.Load):
                return "load"
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(_names(t, name, ast.Store) for t in targets):
                return "store"
        elif isinstance(stmt, (ast.If, ast.While)):
            if _names(stmt.test, name, ast.Load):
                return "load"
            found = _first_use(stmt.body, name) or _first_use(stmt.orelse, name)
            if found:
                return found
        elif isinstance(stmt, (ast.For, ast.With)):
            head = stmt.iter if isinstance(stmt, ast.For) else ast.Tuple([i.context_expr for i in stmt.items], ast.Load())
            if _names(head, name, ast.Load):
                return "load"
            found = _first_use(stmt.body, name)
            if found:
                return found
        elif _names(stmt, name, ast.Load):
            return "load"
        elif _names(stmt, name, ast.Store):
            return "store"
    return None


def _stream(hidden: Any, residual: Any) -> torch.Tensor:
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError(f"decoder layer hidden states are {type(hidden).__name__}, not a tensor")
    value = hidden + residual if isinstance(residual, torch.Tensor) else hidden
    return value.detach().clone()


@contextlib.contextmanager
def record_stream(decoder: torch.nn.Module, ids: tuple[int, ...]) -> Iterator[dict[int, torch.Tensor]]:
    """Hooks recording the residual stream at ``ids`` while the reference runs (cloned: vLLM's fused
    add-norms update their inputs in place): id L < N is layer L's input, id N the last layer's output;
    the residual is added only where the layers read the residual they are given."""
    layers = layers_of(decoder)
    n = len(layers)
    seen: dict[int, torch.Tensor] = {}
    handles = []

    def before(layer_id: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            hidden = bound.get("hidden_states", bound.get("x"))
            if hidden is None:
                raise RuntimeError(f"{type(module).__name__}.forward has no `hidden_states` argument")
            residual = bound.get("residual") if uses_residual_input(type(module)) else None
            seen[layer_id] = _stream(hidden, residual)

        return hook

    def after(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        hidden, residual = (out[0], out[1] if len(out) > 1 else None) if isinstance(out, tuple) else (out, None)
        seen[n] = _stream(hidden, residual if uses_residual_input(type(module)) else None)

    for layer_id in ids:
        if layer_id < n:
            handles.append(layers[layer_id].register_forward_pre_hook(before(layer_id), with_kwargs=True))
    if n in ids:
        handles.append(layers[n - 1].register_forward_hook(after))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def aux_of(out: Any, what: str) -> list[torch.Tensor]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple)):
        return [t.detach().clone() for t in out[1]]
    raise AuxCheckError(f"no aux states returned by {what} (forward returned {type(out).__name__})")


class AuxCheckError(Exception):
    """A numerical or contract check failed; the message says which and by how much."""


def compare_aux(got: list[torch.Tensor], want: dict[int, torch.Tensor], ids: tuple[int, ...], where: str) -> float:
    if len(got) != len(ids):
        raise AuxCheckError(f"{where}: {len(got)} aux states returned for ids {list(ids)}")
    errs: dict[int, float] = {}
    for layer_id, tensor in zip(ids, got):
        ref = want[layer_id]
        if tuple(tensor.shape) != tuple(ref.shape):
            raise AuxCheckError(f"{where}: aux id {layer_id} has shape {tuple(tensor.shape)}, reference {tuple(ref.shape)}")
        err = float((tensor.float() - ref.float()).abs().max())
        errs[layer_id] = err if err == err else float("inf")  # NaN counts as the worst
    worst_id = max(errs, key=lambda i: errs[i])
    worst = errs[worst_id]
    if not worst <= ATOL:
        bad = [i for i in ids if not errs[i] <= ATOL]
        raise AuxCheckError(
            f"{where}: aux id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} differ{'' if len(bad) > 1 else 's'} "
            f"from the residual stream (worst: id {worst_id} by {worst:.3g}; ids {list(ids)})"
        )
    return worst
