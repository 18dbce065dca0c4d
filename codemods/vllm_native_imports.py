"""Module-level edits of the vLLM-native codemod: the imports the generated code needs (relative
inside vllm/model_executor/models/, absolute for out-of-tree modules, merged into the file's own
import lines) and the generated-file header. Imports no vLLM."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from pipespec.codemods.import_edits import add_first_party_import
from pipespec.codemods.vllm_native_names import (
    GENERATOR,
    GENERATOR_VERSION,
    HEADER_FIRST,
    IMPORTS,
    MODELS_PKG,
    source_of,
)


def _relative_models_style(module: cst.Module) -> bool:
    """The file sits in vllm/model_executor/models/ and says so by importing its siblings relatively."""
    for stmt in module.body:
        for node in m.findall(stmt, m.ImportFrom()) if isinstance(stmt, cst.SimpleStatementLine) else ():
            imp = cst.ensure_type(node, cst.ImportFrom)
            if len(imp.relative) == 1 and imp.module is not None and source_of(imp.module).split(".")[0] in (
                    "interfaces", "utils", "interfaces_base"):
                return True
    return False


def add_imports(module: cst.Module, names: set[str], absolute: bool | None) -> cst.Module:
    relative = _relative_models_style(module) if absolute is None else not absolute
    for name in sorted(names):
        if name == "get_pp_group":
            module = add_first_party_import(module, "vllm.distributed", name)
            continue
        sub = IMPORTS[name]
        module = _add_to_existing(module, sub, name) or _new_import(module, sub, name, relative)
    return module


def _add_to_existing(module: cst.Module, sub: str, name: str) -> cst.Module | None:
    """Add ``name`` to the file's own ``from .<sub> import`` / ``from vllm.model_executor.models.<sub> import``."""
    for stmt in module.body:
        if not m.matches(stmt, m.SimpleStatementLine(body=[m.ImportFrom()])):
            continue
        imp = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.ImportFrom)
        target = source_of(imp.module) if imp.module is not None else ""
        if not ((len(imp.relative) == 1 and target == sub) or (not imp.relative and target == f"{MODELS_PKG}.{sub}")):
            continue
        if isinstance(imp.names, cst.ImportStar):
            return module
        aliases = list(imp.names)
        if any(a.evaluated_name == name for a in aliases):
            return module
        names = sorted([*(a.evaluated_name for a in aliases), name])
        at = names.index(name)
        new = cst.ImportAlias(cst.Name(name))
        if at == len(aliases):  # last: take the old last's comma, give it a separator
            prev = aliases[-1]
            sep = aliases[-2].comma if len(aliases) > 1 else None
            if not isinstance(sep, cst.Comma):
                sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            aliases[-1] = prev.with_changes(comma=sep)
            aliases.append(new.with_changes(comma=prev.comma))
        else:
            nxt = aliases[at]
            sep = nxt.comma if isinstance(nxt.comma, cst.Comma) and at < len(aliases) - 1 else (
                aliases[at - 1].comma if at > 0 and isinstance(aliases[at - 1].comma, cst.Comma)
                else cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            aliases.insert(at, new.with_changes(comma=sep))
        new_imp = imp.with_changes(names=aliases)
        if len(source_of(stmt.with_changes(body=[new_imp]))) > 88 and imp.lpar is None:
            new_imp = new_imp.with_changes(
                lpar=cst.LeftParen(whitespace_after=cst.ParenthesizedWhitespace(
                    indent=True, last_line=cst.SimpleWhitespace("    "))),
                rpar=cst.RightParen(),
                names=[a.with_changes(comma=cst.Comma(whitespace_after=cst.ParenthesizedWhitespace(
                    indent=True, last_line=cst.SimpleWhitespace("    " if i < len(aliases) - 1 else ""))))
                       for i, a in enumerate(aliases)])
        new_stmt = stmt.with_changes(body=[new_imp])  # a top-level line: replace it there, no walk of the tree
        return module.with_changes(body=[new_stmt if s is stmt else s for s in module.body])
    return None


def _new_import(module: cst.Module, sub: str, name: str, relative: bool) -> cst.Module:
    if not relative:
        return add_first_party_import(module, f"{MODELS_PKG}.{sub}", name)
    body = list(module.body)
    rel = [i for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom(relative=[m.Dot()])]))]
    line = cst.parse_statement(f"from .{sub} import {name}\n")
    after = [i for i in rel if source_of(cst.ensure_type(cst.ensure_type(body[i], cst.SimpleStatementLine).body[0],
                                                             cst.ImportFrom).module or cst.Name("_")) > sub]
    at = after[0] if after else rel[-1] + 1
    if after:
        line = line.with_changes(leading_lines=body[at].leading_lines)
        body[at] = body[at].with_changes(leading_lines=())
    body.insert(at, line)
    return module.with_changes(body=body)


def stamp(module: cst.Module, label: str, classes: list[str]) -> cst.Module:
    """Header comments after the file's own leading comments (licence lines stay first)."""
    header = list(module.header)
    if any(line.comment is not None and line.comment.value.startswith(HEADER_FIRST) for line in header):
        return module
    text = [f"{HEADER_FIRST} ({GENERATOR} v{GENERATOR_VERSION}) from {label}.",
            "# Adapted to vLLM's EAGLE3-over-PP contract (EagleModelMixin, SupportsEagle3):",
            f"# {', '.join(dict.fromkeys(classes))}.",
            "# Do not edit those classes by hand; regenerate them with",
            f"#     adapter-gen {label.split(' ')[0]} --dialect vllm"]
    while header and header[-1].comment is None:
        header.pop()
    lines = [cst.EmptyLine(comment=cst.Comment(t)) for t in text]
    gap = [cst.EmptyLine()] if header else []
    return module.with_changes(header=[*header, *gap, *lines, cst.EmptyLine()])
