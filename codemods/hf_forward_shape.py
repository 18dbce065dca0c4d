"""Read the shape of an HF transformers decoder ``forward`` without running it: the entry point of the
HF forward-shape analysis (``analyze_forward``) and what it returns (``ForwardShape``).

Shared by the codemod (``AdaptHFStageForwardCommand``, which rewrites what this finds) and by
``pipespec.integrations.transformers.infer`` (which turns it into an adapter spec). Pure libcst: the
analysed code is never imported or executed, and nothing here imports torch, transformers or vllm.

A forward we can adapt has three parts around ONE top-level loop over the decoder layers::

    <prologue>   argument checks, the embedding lookup, cache, positions, masks, rotary embeddings
    for ... in self.layers[: self.config.num_hidden_layers]:     # or enumerate(...) / range(...)
        hidden_states = decoder_layer(hidden_states, ...)         # the residual stream
    <epilogue>   final norm, return the model output

Everything else (several loops over the stack, ``break`` in the loop, layers that read
``input_ids``, tensors derived from the embedding and fed to every layer) is a ``ShapeError`` whose
message is the specific, true reason a stage forward cannot be generated. The analysis, one concept a
module:

============================  ==========================================================================
``hf_decline``                ``ShapeError`` (the reason and line) and ``AlreadyStageAware``
``hf_names``                  dotted names, what a statement reads and binds, the memoised walk
``hf_layer_loop``             the one top-level loop over the layers, its stream, a separate residual
``hf_first_stage``            the embedding lookup and what only the first stage runs before the loop
``hf_stage_boundary``         what must not cross a stage boundary: derived inputs, loop-carried state
``hf_forward_shape`` (here)   ``analyze_forward`` putting them together, the epilogue and final norm
============================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import libcst as cst

from pipespec.codemods.hf_decline import AlreadyStageAware, ShapeError
from pipespec.codemods.hf_first_stage import find_embedding, first_stage_statements
from pipespec.codemods.hf_layer_loop import LoopShape, find_layer_loop, separate_residual
from pipespec.codemods.hf_names import dotted, is_docstring, names_in, param_names, self_attr, walk
from pipespec.codemods.hf_stage_boundary import check_loop_carried, check_stage_inputs

__all__ = [
    "LAYER_COUNT_KEYS",
    "AlreadyStageAware",
    "ForwardShape",
    "LoopShape",
    "ShapeError",
    "analyze_forward",
    "find_forward",
    "rotary_attrs",
]

#: Config keys that hold the number of decoder layers in HF configs we have seen.
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_blocks")


@dataclass
class ForwardShape:
    """What the codemod and spec inference need to know about one forward."""

    func: cst.FunctionDef
    body_start: int  # index of the first statement after the docstring
    cache_kwarg: str | None
    loop: LoopShape
    embed_attr: str
    first_stage_only: list[int]  # prologue statements to guard
    stream_first_assigned: int | None  # guarded statement that first binds the stream
    norm_attr: str | None
    residual: bool


def rotary_attrs(cls: cst.ClassDef) -> set[str]:
    """``self`` attributes that ``__init__`` builds from a rotary-embedding class (``*Rotary*``/``*Rope*``)."""
    out: set[str] = set()
    for stmt in cls.body.body:
        if not (isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__"):
            continue
        for n in walk(stmt):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                attr = self_attr(n.targets[0].target)
                callee = (dotted(n.value.func) or "").rsplit(".", 1)[-1].lower()
                if attr is not None and ("rotary" in callee or "rope" in callee):
                    out.add(attr)
    return out


def find_forward(cls: cst.ClassDef) -> cst.FunctionDef | None:
    """The class's own ``forward`` (the first one its body defines), else None."""
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            return stmt
    return None


def analyze_forward(
    func: cst.FunctionDef,
    *,
    layers_attr: str | None = None,
    embed_attr: str | None = None,
    norm_attr: str | None = None,
    shape_only_attrs: Iterable[str] = (),
    line_of: Callable[[cst.CSTNode], int | None] = lambda node: None,
) -> ForwardShape:
    """Analyse ``func``; attributes left ``None`` are detected. Raises ``ShapeError``/``AlreadyStageAware``.

    ``shape_only_attrs``: ``self`` attributes whose call reads tensors only for shape/dtype/device
    (rotary embeddings; see ``rotary_attrs``).
    """
    params = param_names(func)
    if "intermediate_tensors" in params:
        raise AlreadyStageAware()
    stmts = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    body_start = 1 if stmts and is_docstring(stmts[0]) else 0
    for needed in ("input_ids", "inputs_embeds"):
        if needed not in params:
            raise ShapeError(
                f"forward has no `{needed}` parameter: a later stage feeds the received hidden states in as "
                "`inputs_embeds` in place of the `input_ids` lookup",
                line_of(func),
            )
    cache_kwarg = "cache" if "cache" in params else ("past_key_values" if "past_key_values" in params else None)
    loop = find_layer_loop(func, stmts, layers_attr, line_of)

    prologue = stmts[body_start : loop.index]
    embed_index, found_attr, conditional = find_embedding(prologue, embed_attr, loop.stream)
    if embed_index is None:
        what = f"self.{embed_attr}(...)" if embed_attr else "self.<embedding>(input_ids)"
        raise ShapeError(f"no embedding lookup {what} before the layer loop", line_of(func))
    embed_index += body_start
    assert found_attr is not None
    first_stage_only, stream_first_assigned = first_stage_statements(stmts, embed_index, conditional, loop, line_of)
    check_loop_carried(loop, stmts, line_of)
    guarded = set(first_stage_only) | {embed_index}
    check_stage_inputs(stmts, body_start, loop, guarded, line_of, set(shape_only_attrs))

    epilogue = stmts[loop.index + 1 :]
    _check_returns(epilogue, loop, line_of)
    return ForwardShape(
        func=func,
        body_start=body_start,
        cache_kwarg=cache_kwarg,
        loop=loop,
        embed_attr=found_attr,
        first_stage_only=first_stage_only,
        stream_first_assigned=stream_first_assigned,
        norm_attr=_find_norm(epilogue, loop.stream, norm_attr),
        residual=separate_residual(loop),
    )


def _check_returns(
    epilogue: Sequence[cst.BaseStatement], loop: LoopShape, line_of: Callable[[cst.CSTNode], int | None]
) -> None:
    """Forward returns after the loop, each return on a line of its own (the codemod rewrites them)."""
    returns = [n for s in epilogue for n in walk(s) if isinstance(n, cst.Return)]
    if not returns:
        raise ShapeError("forward does not return after the layer loop", line_of(loop.node))
    for s in epilogue:
        for n in walk(s):
            if isinstance(n, cst.SimpleStatementLine) and any(isinstance(x, cst.Return) for x in n.body) and len(n.body) > 1:
                raise ShapeError("a return after the loop shares its line with other statements", line_of(n))


def _find_norm(epilogue: Sequence[cst.BaseStatement], stream: str, norm_attr: str | None) -> str | None:
    """The final norm: the first ``self.<attr>(...)`` called on the stream after the loop."""
    for stmt in epilogue:
        for n in walk(stmt):
            if not isinstance(n, cst.Call):
                continue
            attr = self_attr(n.func)
            if attr is None:
                continue
            if norm_attr is not None:
                if attr == norm_attr:
                    return attr
                continue
            if n.args and stream in names_in(n.args[0].value):
                return attr
    return None
