"""What only the first stage of an HF ``forward`` runs: the embedding lookup and the statements after
it that change the embeddings before the layer loop (scaling, position embeddings, dropout). A later
stage receives the stream instead, so these get an ``if self.is_first_stage:`` guard; ones it cannot
skip safely (they also compute something the rest uses, or reshape the stream) are declined.

Part of the HF forward-shape analysis (``hf_forward_shape.analyze_forward`` is the entry point). Pure
libcst; must not import ``hf_forward_shape`` (it imports this) or anything that runs the analysed code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.hf_decline import ShapeError
from pipespec.codemods.hf_layer_loop import LoopShape
from pipespec.codemods.hf_names import assigned_names, dotted, is_alias, names_in, self_attr, walk


def find_embedding(
    prologue: Sequence[cst.BaseStatement], embed_attr: str | None, stream: str
) -> tuple[int | None, str | None, bool]:
    """(index in prologue, attr, under ``if inputs_embeds is None``) of the embedding lookup.

    With ``embed_attr`` (from a spec): the first call ``self.<embed_attr>(...)``. Without: the first
    ``inputs_embeds = self.<x>(... input_ids ...)``, else the first ``<stream> = self.<x>(... input_ids ...)``
    (a method such as ``self.warn_if_padding_and_no_attention_mask(input_ids, ...)`` is neither).
    """
    if embed_attr is not None:
        for i, stmt in enumerate(prologue):
            for n in walk(stmt):
                if isinstance(n, cst.Call) and self_attr(n.func) == embed_attr:
                    return i, embed_attr, _under_inputs_embeds_none(stmt)
        return None, None, False
    for target in ("inputs_embeds", stream):
        for i, stmt in enumerate(prologue):
            for n in walk(stmt):
                if not isinstance(n, (cst.Assign, cst.AnnAssign)):
                    continue
                targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
                if not any(m.matches(t, m.Name(target)) for t in targets) or n.value is None:
                    continue
                for call in walk(n.value):
                    if isinstance(call, cst.Call) and self_attr(call.func) is not None and any(
                        "input_ids" in names_in(a.value) for a in call.args
                    ):
                        return i, self_attr(call.func), _under_inputs_embeds_none(stmt)
    return None, None, False


def _under_inputs_embeds_none(stmt: cst.BaseStatement) -> bool:
    return m.matches(
        stmt, m.If(test=m.Comparison(left=m.Name("inputs_embeds"), comparisons=[m.ComparisonTarget(m.Is(), m.Name("None"))]))
    )


#: Tensor functions/methods that change a tensor's shape (concatenating streams, adding dimensions).
RESHAPES = frozenset(
    ("cat", "concat", "concatenate", "stack", "expand", "unsqueeze", "view", "reshape", "repeat", "flatten", "permute", "transpose")
)


def _reshaping_call(stmt: cst.BaseStatement, tensors: set[str]) -> str | None:
    """The reshaping function applied to the stream/embeddings in an assignment back to them, if any."""
    for n in walk(stmt):
        if not isinstance(n, (cst.Assign, cst.AugAssign, cst.AnnAssign)) or n.value is None:
            continue
        targets = [t.target for t in n.targets] if isinstance(n, cst.Assign) else [n.target]
        if not any(isinstance(t, cst.Name) and t.value in tensors for t in targets):
            continue
        for call in walk(n.value):
            if not isinstance(call, cst.Call):
                continue
            func = call.func
            name = func.attr.value if isinstance(func, cst.Attribute) else (dotted(func) or "")
            if name in RESHAPES and names_in(call) & tensors:
                return name
    return None


def first_stage_statements(
    stmts: Sequence[cst.BaseStatement],
    embed_index: int,
    embed_conditional: bool,
    loop: LoopShape,
    line_of: Callable[[cst.CSTNode], int | None],
) -> tuple[list[int], int | None]:
    """The top-level statements (indices into ``stmts``) only the first stage runs: the embedding lookup
    (unless it sits under ``if inputs_embeds is None:``, which a later stage skips by itself) and the
    statements after it that change the stream; and which of them first binds the stream, if one does."""
    first_stage_only: list[int] = []
    stream_first_assigned: int | None = None
    stream = loop.stream
    watched = {stream, "inputs_embeds"}
    defined = stream == "inputs_embeds"
    if not embed_conditional:
        first_stage_only.append(embed_index)
        bound = assigned_names(stmts[embed_index])
        if stream in bound and stream != "inputs_embeds":
            stream_first_assigned = embed_index
            defined = True
    elif stream != "inputs_embeds" and stream in assigned_names(stmts[embed_index]):
        raise ShapeError(
            f"`{stream}` is bound inside the embedding branch: a later stage would have no stream",
            line_of(stmts[embed_index]),
        )
    later_uses: list[set[str]] = [names_in(s) for s in stmts]
    for i in range(embed_index + 1, loop.index):
        stmt = stmts[i]
        bound = assigned_names(stmt)
        if not bound & watched:
            continue
        if is_alias(stmt, stream, "inputs_embeds"):
            defined = True
            continue
        others = bound - watched
        used_later = sorted(x for x in others if any(x in later_uses[j] for j in range(i + 1, len(stmts))))
        if used_later:
            raise ShapeError(
                f"this statement changes the embeddings and also computes {', '.join('`' + x + '`' for x in used_later)}, "
                "which the rest of forward uses: a later stage cannot skip it and cannot run it",
                line_of(stmt),
            )
        reshape = _reshaping_call(stmt, watched)
        if reshape is not None:
            raise ShapeError(
                f"the first stage reshapes the stream with {reshape}(...): what it sends is not shaped like the "
                "embeddings [batch, seq, hidden], so a later stage cannot derive masks and positions from it",
                line_of(stmt),
            )
        first_stage_only.append(i)
        if not defined and stream in bound:
            stream_first_assigned = i
            defined = True
    if not defined:
        raise ShapeError(f"`{stream}` is never bound before the layer loop", line_of(loop.node))
    return first_stage_only, stream_first_assigned
