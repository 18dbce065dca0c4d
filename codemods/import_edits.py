"""Import edits for codemods that keep a module's isort layout (what ``ruff check --select I`` accepts).

libcst's ``AddImportsVisitor`` appends after the last import and ``RemoveImportsVisitor`` drops the blank
line that separated two import blocks; both leave generated code that a project's import linter
rejects. These two functions place and remove imports the way isort would.

Pure libcst on a parsed module; imports nothing from pipespec (every codemod may import it).
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.helpers import get_full_name_for_node


def drop_unused_import(module: cst.Module, name: str) -> cst.Module:
    """Remove ``name`` from top-level ``from X import ...`` lines when nothing else in the module uses it;
    a line left empty goes, its leading blank lines and comments move to the next statement."""
    imported = m.ImportAlias(name=m.Name(name), asname=None)
    imports = [s for s in module.body if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom()]))
               and m.findall(s, imported)]
    uses = len(m.findall(module, m.Name(name))) - sum(len(m.findall(s, imported)) for s in imports)
    if not imports or uses:
        return module
    body: list[cst.BaseStatement] = []
    carry: Sequence[cst.EmptyLine] = ()
    for stmt in module.body:
        if any(stmt is s for s in imports):
            node = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.ImportFrom)
            aliases = list(cst.ensure_type(node.names, Sequence))
            names = [a for a in aliases if not m.matches(a, imported)]
            if not names:
                carry = stmt.leading_lines
                continue
            if m.matches(aliases[-1], imported):  # the new last name takes over the removed one's comma
                names[-1] = names[-1].with_changes(comma=aliases[-1].comma)
            stmt = stmt.with_changes(body=[node.with_changes(names=names)])
        if carry:
            lines = [*carry, *stmt.leading_lines]
            lines = [x for i, x in enumerate(lines) if x.comment or i == 0 or lines[i - 1].comment]
            stmt = stmt.with_changes(leading_lines=lines)
            carry = ()
        body.append(stmt)
    return module.with_changes(body=body)


def add_first_party_import(module: cst.Module, from_module: str, name: str) -> cst.Module:
    """Add ``from <from_module> import <name>`` unless ``name`` is imported already.

    Placed where isort puts a first-party import: next to other imports of the same top-level package
    (in sorted position), else as its own block after the last top-level import (before relative ones).
    """
    body = list(module.body)
    header = []
    for i, stmt in enumerate(body):
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()])):
            header.append(i)
        elif not (i == 0 and m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))):
            break
    for i in header:
        node = cst.ensure_type(body[i], cst.SimpleStatementLine).body[0]
        if isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
            if any(a.evaluated_name == name and a.evaluated_alias in (None, name) for a in node.names):
                return module
    new = cst.parse_statement(f"from {from_module} import {name}\n")

    def module_of(i: int) -> tuple[str, bool]:
        node = cst.ensure_type(body[i], cst.SimpleStatementLine).body[0]
        if isinstance(node, cst.ImportFrom):
            return (get_full_name_for_node(node.module) or "" if node.module else ""), bool(node.relative)
        return get_full_name_for_node(cst.ensure_type(node, cst.Import).names[0].name) or "", False

    package = from_module.split(".")[0]
    ours = [i for i in header if module_of(i)[0].split(".")[0] == package and not module_of(i)[1]]
    relative = [i for i in header if module_of(i)[1]]
    if ours:
        after = [i for i in ours if module_of(i)[0] > from_module]
        at = after[0] if after else ours[-1] + 1
        if after:
            new = new.with_changes(leading_lines=body[at].leading_lines)
            body[at] = body[at].with_changes(leading_lines=())
    elif relative:
        at = relative[0]
        new = new.with_changes(leading_lines=body[at].leading_lines or [cst.EmptyLine()])
        body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine()])
    elif header:
        at = header[-1] + 1
        new = new.with_changes(leading_lines=[cst.EmptyLine()])
    else:
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else 0
        new = new.with_changes(leading_lines=[cst.EmptyLine()] if at else [])
    body.insert(at, new)
    return module.with_changes(body=body)
