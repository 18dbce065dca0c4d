"""What must not cross a pipeline-stage boundary unseen in an HF ``forward``: a tensor computed before the
layer loop from the embeddings' values or from ``input_ids`` and fed to the layers (a later stage would
compute it from the received hidden states, or have no ``input_ids``), and state the loop carries from
layer to layer besides the stream (a boundary would drop it). Both are declined with the name and line.

Part of the HF forward-shape analysis (``hf_forward_shape.analyze_forward`` is the entry point). Pure
libcst; must not import ``hf_forward_shape`` (it imports this) or anything that runs the analysed code.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.hf_decline import ShapeError
from pipespec.codemods.hf_layer_loop import LoopShape
from pipespec.codemods.hf_names import assigned_names, children, dotted, read_names, self_attr, walk


def _is_none_test(node: cst.CSTNode, name: str, op: type[cst.BaseCompOp]) -> bool:
    return m.matches(node, m.Comparison(left=m.Name(name), comparisons=[m.ComparisonTarget(m.TypeOf(op)(), m.Name("None"))]))  # type: ignore[operator]


def _unreachable_on_later_stages(test: cst.BaseExpression) -> bool:
    """A branch test that is false on a later stage (there ``input_ids is None`` and ``inputs_embeds`` is set)."""
    parts: list[cst.BaseExpression] = [test]
    while parts:
        node = parts.pop()
        if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
            parts += [node.left, node.right]
        elif _is_none_test(node, "input_ids", cst.IsNot) or _is_none_test(node, "inputs_embeds", cst.Is):
            return True
    return False


def _reachable_reads(stmt: cst.CSTNode) -> list[cst.Name]:
    """Names ``stmt`` reads on a later stage: skips branches that cannot run there and ``x is None`` tests."""
    out: list[cst.Name] = []

    def visit(node: cst.CSTNode) -> None:
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return
        if isinstance(node, cst.If):
            visit(node.test)
            if not _unreachable_on_later_stages(node.test):
                visit(node.body)
            if node.orelse is not None:
                visit(node.orelse)
            return
        if isinstance(node, cst.Comparison) and (
            _is_none_test(node, "input_ids", cst.Is) or _is_none_test(node, "input_ids", cst.IsNot)
        ):
            return
        if isinstance(node, cst.Name):
            out.append(node)
        elif isinstance(node, cst.Attribute):
            visit(node.value)
            return
        elif isinstance(node, cst.Arg):
            visit(node.value)
            return
        for child in children(node):
            visit(child)

    visit(stmt)
    return out


def _shape_only_ids(stmt: cst.CSTNode, shape_only_attrs: set[str]) -> set[int]:
    """ids of Name nodes in ``stmt`` read only for shape, dtype or device.

    Those are: ``x.shape``/``x.dtype``/``x.device``/``x.size``/``x.ndim``; every argument of a mask
    builder (any callee whose name contains "mask") or of a rotary embedding (``self.rotary_emb`` or an
    attribute ``__init__`` builds from a ``*Rotary*`` class: it reads the input's dtype and device); the
    ``"inputs_embeds": inputs_embeds`` entry of a ``mask_kwargs`` dict.
    """
    allowed: set[int] = set()
    for n in walk(stmt):
        if isinstance(n, cst.Attribute) and n.attr.value in ("shape", "dtype", "device", "size", "ndim") and isinstance(n.value, cst.Name):
            allowed.add(id(n.value))
        elif isinstance(n, cst.Call):
            fname = dotted(n.func) or ""
            short = fname.rsplit(".", 1)[-1]
            if "mask" in short.lower() or "rotary" in short.lower() or self_attr(n.func) in shape_only_attrs:
                allowed.update(id(sub) for sub in walk(n) if isinstance(sub, cst.Name))
        elif isinstance(n, cst.DictElement) and m.matches(
            n, m.DictElement(key=m.SimpleString('"inputs_embeds"') | m.SimpleString("'inputs_embeds'"), value=m.Name())
        ):
            allowed.add(id(n.value))
    return allowed


def check_stage_inputs(
    stmts: Sequence[cst.BaseStatement],
    body_start: int,
    loop: LoopShape,
    guarded: Collection[int],
    line_of: Callable[[cst.CSTNode], int | None],
    shape_only_attrs: set[str],
) -> None:
    """Refuse forwards that feed the layers a tensor computed from the embeddings' values or ``input_ids``.

    On a later stage such a tensor would be computed from the received hidden states (or from no
    ``input_ids`` at all) instead of from the embedding: silently wrong, so decline. Tracks derivation
    through the prologue (``a = f(inputs_embeds)``, ``b = g(a)``, layer reads ``b``); the ``guarded``
    statements (first stage only) are not run by a later stage and are not tracked.
    """
    stream = loop.stream
    tensors = {stream, "inputs_embeds"}
    taint: dict[str, tuple[str, int | None]] = {}
    for i in range(body_start, loop.index):
        if i in guarded:
            continue
        stmt = stmts[i]
        allowed = _shape_only_ids(stmt, shape_only_attrs)
        reads = {n.value for n in _reachable_reads(stmt) if id(n) not in allowed}
        why: str | None = None
        if "input_ids" in reads:
            why = "input_ids"
        elif reads & tensors:
            why = "the embeddings"
        else:
            for name in sorted(reads & taint.keys()):
                why = taint[name][0]
                break
        if why is None:
            continue
        for name in assigned_names(stmt) - tensors - {"input_ids"}:
            taint.setdefault(name, (why, line_of(stmt)))
    loop_names = read_names(loop.node.body) - {loop.layer_var, loop.index_var}
    for name in sorted(loop_names & taint.keys()):
        why, line = taint[name]
        if why == "input_ids":
            raise ShapeError(f"`{name}` is computed from input_ids and used by the layers: a later stage has no input_ids", line)
        raise ShapeError(
            f"`{name}` is computed from the embeddings and passed to the layers: a later stage would compute it "
            "from the received hidden states instead",
            line,
        )


def check_loop_carried(loop: LoopShape, stmts: Sequence[cst.BaseStatement], line_of: Callable[[cst.CSTNode], int | None]) -> None:
    """Refuse loops that carry state from layer to layer besides the stream (it would not cross a stage).

    A name is carried when a statement of the loop body reads it before any earlier statement of the
    body binds it, while the body does bind it (``x = f(x)``, ``state = layer(h, state)``), or when the
    body binds it and the code after the loop reads it. ``all_*`` accumulators (HF's old
    ``output_hidden_states``/``output_attentions`` tuples) are allowed: they only feed optional outputs,
    which an adapted stage does not promise.
    """
    own = {loop.stream, loop.layer_var, loop.index_var}
    body = list(_body_statements(loop.node.body))
    body_assigned = assigned_names(loop.node.body) - own
    after: set[str] = set()
    for stmt in stmts[loop.index + 1 :]:
        after |= read_names(stmt)
    carried = _reads_before_binding(body, set(), body_assigned)
    carried += sorted(body_assigned & after)
    for name in carried:
        if name.startswith("all_"):
            continue
        raise ShapeError(
            f"the layer loop carries `{name}` from layer to layer besides `{loop.stream}`: a stage boundary "
            "would drop it",
            line_of(loop.node),
        )


def _reads_before_binding(stmts: Sequence[cst.BaseStatement], bound: set[str], watched: set[str]) -> list[str]:
    """Names in ``watched`` that ``stmts`` read before binding them, statement by statement, into branches."""
    found: list[str] = []
    bound = set(bound)
    for stmt in stmts:
        if isinstance(stmt, (cst.If, cst.While)):
            found += sorted((read_names(stmt.test) & watched) - bound)
            found += _reads_before_binding(_body_statements(stmt.body), bound, watched)
            orelse = stmt.orelse
            while orelse is not None:
                if isinstance(orelse, cst.If):
                    found += sorted((read_names(orelse.test) & watched) - bound)
                    found += _reads_before_binding(_body_statements(orelse.body), bound, watched)
                    orelse = orelse.orelse
                else:
                    found += _reads_before_binding(_body_statements(orelse.body), bound, watched)
                    orelse = None
        elif isinstance(stmt, cst.With):
            found += sorted((set().union(*(read_names(i.item) for i in stmt.items)) & watched) - bound)
            bound_here = bound | set().union(*(assigned_names(i) for i in stmt.items))
            found += _reads_before_binding(_body_statements(stmt.body), bound_here, watched)
        else:
            found += sorted((read_names(stmt) & watched) - bound)
        bound |= assigned_names(stmt)
    return found


def _body_statements(body: cst.BaseSuite) -> Sequence[cst.BaseStatement]:
    if isinstance(body, cst.IndentedBlock):
        return body.body
    assert isinstance(body, cst.SimpleStatementSuite)
    return [cst.SimpleStatementLine(body=body.body)]
