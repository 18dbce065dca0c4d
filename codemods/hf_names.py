"""Names in libcst nodes, for the HF forward-shape analysis: dotted names, what a statement reads and
binds, and the memoised walk they share.

Pure libcst over source text; nothing here knows what a decoder is. Must not import the other ``hf_*``
modules (they import this) or anything that runs the analysed code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import libcst as cst
import libcst.matchers as m


def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base is not None else None
    return None


def self_attr(node: cst.BaseExpression) -> str | None:
    """``x.y`` for ``self.x.y``, else None."""
    name = dotted(node)
    if name is not None and name.startswith("self.") and name != "self.":
        return name[len("self.") :]
    return None


def code(node: cst.CSTNode) -> str:
    """The source text of ``node`` (for messages)."""
    return cst.Module(body=[]).code_for_node(node)


def names_in(node: cst.CSTNode) -> set[str]:
    """Every variable name used (read or bound) in ``node``; not attribute or keyword-argument names."""
    return {n.value for n in _variable_names(node)}


def _variable_names(node: cst.CSTNode) -> list[cst.Name]:
    out: list[cst.Name] = []

    def visit(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Name):
            out.append(n)
            return
        for child in children(n):
            if isinstance(n, cst.Attribute) and child is n.attr:
                continue
            if isinstance(n, cst.Arg) and child is n.keyword:
                continue
            if isinstance(n, (cst.FunctionDef, cst.ClassDef)) and child is n.name:
                continue
            visit(child)

    visit(node)
    return out


def read_names(node: cst.CSTNode) -> set[str]:
    """Names ``node`` reads (binding targets of ``=``, ``for``, ``:=`` and ``as`` excluded; ``+=`` reads)."""
    targets: set[int] = set()
    for n in walk(node):
        bound: list[cst.CSTNode] = []
        if isinstance(n, cst.Assign):
            bound = [t.target for t in n.targets]
        elif isinstance(n, cst.AnnAssign):
            bound = [n.target]
        elif isinstance(n, (cst.For, cst.CompFor)):
            bound = [n.target]
        elif isinstance(n, cst.NamedExpr):
            bound = [n.target]
        elif isinstance(n, cst.AsName):
            bound = [n.name]
        for b in bound:
            for t in walk(b):
                if isinstance(t, cst.Name) and not _is_attr_or_subscript_base(b, t):
                    targets.add(id(t))
    return {n.value for n in _variable_names(node) if id(n) not in targets}


def _is_attr_or_subscript_base(target: cst.CSTNode, name: cst.Name) -> bool:
    """In ``x.a = ...`` or ``x[i] = ...`` the target reads ``x`` (and ``i``) rather than binding it."""
    return not isinstance(target, (cst.Name, cst.Tuple, cst.List, cst.StarredElement)) or any(
        isinstance(n, (cst.Attribute, cst.Subscript)) and name in set(walk(n)) for n in walk(target)
    )


#: id(node) -> (node, its children). Holding the node keeps its id from being reused; bounded below.
_CHILDREN: dict[int, tuple[cst.CSTNode, tuple[cst.CSTNode, ...]]] = {}
_CHILDREN_MAX = 200_000


def children(node: cst.CSTNode) -> Sequence[cst.CSTNode]:
    """``node.children``, memoised: libcst recomputes it on every access, and the analysis walks the
    same forward a dozen times (most of ``pipespec.adapt``'s time before this cache)."""
    hit = _CHILDREN.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    if len(_CHILDREN) >= _CHILDREN_MAX:
        _CHILDREN.clear()
    found = tuple(node.children)
    _CHILDREN[id(node)] = (node, found)
    return found


def walk(node: cst.CSTNode, *, into_functions: bool = False) -> Iterator[cst.CSTNode]:
    """Pre-order walk; by default does not enter nested defs, lambdas or classes."""
    yield node
    for child in children(node):
        if not into_functions and isinstance(child, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            continue
        yield from walk(child, into_functions=into_functions)


def assigned_names(node: cst.CSTNode) -> set[str]:
    """Names bound (``=``, ``+=``, annotated, walrus, ``for`` targets, ``with ... as``) inside ``node``."""
    out: set[str] = set()

    def targets(t: cst.BaseExpression) -> None:
        if isinstance(t, cst.Name):
            out.add(t.value)
        elif isinstance(t, (cst.Tuple, cst.List)):
            for el in t.elements:
                targets(el.value)
        elif isinstance(t, cst.StarredElement):
            targets(t.value)

    for n in walk(node):
        if isinstance(n, cst.Assign):
            for t in n.targets:
                targets(t.target)
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            targets(n.target)
        elif isinstance(n, cst.NamedExpr):
            targets(n.target)
        elif isinstance(n, cst.For):
            targets(n.target)
        elif isinstance(n, cst.AsName):
            targets(n.name)  # type: ignore[arg-type]
    return out


def is_docstring(stmt: cst.BaseStatement) -> bool:
    """A string statement (the first one of a body is its docstring); concatenated strings count."""
    return m.matches(
        stmt, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])
    )


def is_alias(stmt: cst.BaseStatement, target: str, source: str) -> bool:
    """``target = source`` (optionally annotated)."""
    return m.matches(
        stmt,
        m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(target))], value=m.Name(source))]),
    ) or m.matches(stmt, m.SimpleStatementLine(body=[m.AnnAssign(target=m.Name(target), value=m.Name(source))]))


def param_names(func: cst.FunctionDef) -> tuple[str, ...]:
    """Every parameter name of ``func`` in order, ``*args`` and ``**kwargs`` included."""
    p = func.params
    names = [x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)]
    if isinstance(p.star_arg, cst.Param):
        names.append(p.star_arg.name.value)
    if p.star_kwarg is not None:
        names.append(p.star_kwarg.name.value)
    return tuple(names)

