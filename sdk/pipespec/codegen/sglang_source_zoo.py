"""The SGLang source zoo: the sglang dialect of the codemod over every model file of an SGLang tree.

``run_sglang_source_zoo(tree)`` reads every ``.py`` under ``sglang/srt/models/`` of a tree (a release
fetched by ``pipespec.integrations.sglang.sources``, or a checkout) and gives one row per decoder with a
pipeline layer loop in its ``forward`` (``adapt_sglang_module``'s decoders), plus one row for

* a file without such a decoder whose ``*ForCausalLM`` setters the codemod adapted (the decoder's forward
  comes from another file, e.g. qwen3_moe over qwen2_moe's): one row per class with adapted setters;
* a file with a loop over its stage's layers outside any ``forward`` and no decoder (a structural decline
  naming the method and line), so every file with a PP layer loop is accounted for.

Statuses (``Status``): **adapted** (the output compiles, the decoder sets the flag on itself, seeds from the
hand-off and adds its keys to it, imports nothing from pipespec, and the codemod on its own output changes
nothing and calls it unchanged), **unchanged**, **declined** (construct and line), **crashed** (the codemod
raised, or an adapted output failed a check). SGLang 0.5.23 relays aux states over PP for no model, so
nothing is **supported**. Rows, statuses, report and the run over files are ``pipespec.codegen.source_zoo``'s,
shared with the vLLM source zoo. Nothing here imports SGLang, torch, or the code it reads.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from pathlib import Path

from pipespec.codegen.source_zoo import CodemodStatus, SourceRow, SourceZoo, Status, one_line, survey_tree
from pipespec.codemods.adapt_sglang import SglangAdaptResult, SglangStatus, adapt_sglang_module
from pipespec.codemods.sglang_forward import IDS_VAR
from pipespec.contract.names import AUX_KEY_PREFIX, AUX_OVER_PP_FLAG
from pipespec.errors import UsageError
from pipespec.integrations.sglang.sources import MODELS, source_tree

STATUS = {SglangStatus.ADAPTED: Status.ADAPTED, SglangStatus.UNCHANGED: Status.UNCHANGED,
          SglangStatus.DECLINED: Status.DECLINED}
LOOP_BOUND = re.compile(r"\b\w*(start_layer|end_layer)\b")


def release_of(tree: Path) -> str:
    """The version an sglang package directory states in ``_version.py`` or ``version.py`` (read), else its path."""
    for name in ("_version.py", "version.py"):
        try:
            text = (tree / name).read_text(encoding="utf-8")
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return found.group(1)
    return str(tree)


def model_files(tree: Path) -> list[Path]:
    """Every ``.py`` under the tree's ``srt/models/``, sorted by relative path."""
    found = [p for p in (tree / MODELS).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(found, key=lambda p: p.relative_to(tree).as_posix())


def select_files(tree: Path, wanted: Sequence[str] | None) -> list[Path]:
    """``model_files``, or those named by path under the package or by base name (else a ``UsageError``)."""
    every = model_files(tree)
    if wanted is None:
        return every
    names = [w.strip() for w in wanted if w.strip()]
    if not names:
        raise UsageError("--files is empty: give comma-separated SGLang model files such as llama.py,qwen2.py")
    rel = {p: p.relative_to(tree).as_posix() for p in every}
    unknown = [w for w in names if w not in set(rel.values()) | {p.name for p in every}]
    if unknown:
        raise UsageError(f"--files {unknown[0]!r}: not a model file of the SGLang tree {tree} (give a path under the "
                         "sglang package such as srt/models/llama.py, or a base name such as llama.py)")
    return [p for p in every if rel[p] in names or p.name in names]


def survey_file(path: Path, tree: Path) -> list[SourceRow]:
    """The rows of one model file (none when it has no pipeline layer loop and no adapted setter)."""
    code = path.read_text(encoding="utf-8")
    rel = path.relative_to(tree).as_posix()
    if not LOOP_BOUND.search(code) and "layers_to_capture" not in code:
        return []
    try:
        module = ast.parse(code)
    except SyntaxError as exc:
        return [SourceRow(rel, "", Status.CRASHED, f"line {exc.lineno}: not valid Python: {exc.msg}",
                          CodemodStatus.CRASHED)]
    try:
        result = adapt_sglang_module(code, label=rel)
    except Exception as exc:  # one line, and the run goes on
        return [SourceRow(rel, "", Status.CRASHED, f"the codemod raised {one_line(exc)}", CodemodStatus.CRASHED)]
    problems = output_problems(result) if result.changed else {}
    rows = []
    for o in result.decoders:
        problem = problems.get(o.cls)
        convention = f"; ids: {o.id_convention}" if o.id_convention else ""
        if problem:
            rows.append(SourceRow(rel, o.cls, Status.CRASHED, f"the adapted output fails its check: {problem}",
                                  CodemodStatus(o.status.value), line=o.line))
        else:
            reason = o.reason if o.status is SglangStatus.DECLINED else f"{o.capture_form.value}{convention}"
            rows.append(SourceRow(rel, o.cls, STATUS[o.status], reason, CodemodStatus(o.status.value),
                                  line=o.line))
    if not result.decoders:
        rows += _setter_rows(rel, result, problems) or _loop_rows(rel, module)
    return rows


def _setter_rows(rel: str, result: SglangAdaptResult, problems: dict[str, str]) -> list[SourceRow]:
    """One row per class whose setters were adapted in a file without a decoder of its own."""
    by_class: dict[str, list[str]] = {}
    for setter in result.setters:
        cls, _, method = setter.partition(".")
        by_class.setdefault(cls, []).append(method)
    rows = []
    for cls, methods in by_class.items():
        problem = problems.get("")
        if problem:
            rows.append(SourceRow(rel, cls, Status.CRASHED, f"the adapted output fails its check: {problem}",
                                  CodemodStatus.ADAPTED))
        else:
            rows.append(SourceRow(rel, cls, Status.ADAPTED, f"{' and '.join(methods)}: every rank learns its ids; no "
                                  "decoder with a layer loop in this file (the one it holds is judged in its own file)",
                                  CodemodStatus.ADAPTED))
    return rows


def _loop_rows(rel: str, module: ast.Module) -> list[SourceRow]:
    """A loop over the stage's layers outside any ``forward`` (weight loading, expert maps): no decoder to adapt."""
    for cls in (n for n in module.body if isinstance(n, ast.ClassDef)):
        for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name != "forward"):
            for node in ast.walk(fn):
                if isinstance(node, ast.For | ast.comprehension) and _bounded_range(node.iter):
                    return [SourceRow(rel, cls.name, Status.DECLINED,
                                      f"`{cls.name}.{fn.name}` (line {node.iter.lineno}) loops over the stage's layers, "
                                      "but no class of this file has a forward with such a loop (no decoder here)",
                                      CodemodStatus.UNSEEN, line=cls.lineno)]
    return []


def _bounded_range(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
            and bool(LOOP_BOUND.search(ast.unparse(node))))


def output_problems(result: SglangAdaptResult) -> dict[str, str]:
    """For each adapted decoder (key ``""`` for the file's setters), the first check the output fails."""
    adapted = [o.cls for o in result.decoders if o.status is SglangStatus.ADAPTED] or [""]
    try:
        module = ast.parse(result.code)
        compile(module, result.label, "exec")
    except SyntaxError as exc:
        return dict.fromkeys(adapted, f"it does not compile: line {exc.lineno}: {exc.msg}")
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "pipespec" or n.startswith("pipespec.") for n in names):
                return dict.fromkeys(adapted, f"line {node.lineno} imports pipespec (generated SGLang code must not)")
    try:
        again = adapt_sglang_module(result.code, label=result.label)
    except Exception as exc:
        return dict.fromkeys(adapted, f"the codemod on its own output raised {one_line(exc)}")
    if again.code != result.code or any(o.status is not SglangStatus.UNCHANGED for o in again.decoders):
        return dict.fromkeys(adapted, "not idempotent: the codemod on its own output changes it or does not call it unchanged")
    classes = {c.name: c for c in module.body if isinstance(c, ast.ClassDef)}
    problems = {}
    for name in adapted:
        problem = _contract_problem(classes.get(name), name) if name else ""
        if problem:
            problems[name] = problem
    return problems


def _contract_problem(cls: ast.ClassDef | None, name: str) -> str:
    if cls is None:
        return f"class {name} is missing from the output"
    if not any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == AUX_OVER_PP_FLAG for t in s.targets)
               and isinstance(s.value, ast.Constant) and s.value.value is True for s in cls.body):
        return f"{name} does not set {AUX_OVER_PP_FLAG} = True in its own body"
    forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
    text = ast.unparse(forward) if forward else ""
    if f"{IDS_VAR} = sorted(set(self.layers_to_capture))" not in text:
        return f"{name}.forward does not sort and deduplicate its ids"
    if "pp_proxy_tensors[aux_key]" not in text or f"{AUX_KEY_PREFIX}{{aux_slot}}" not in text:
        return f"{name}.forward does not read {AUX_KEY_PREFIX}<slot> from the hand-off or write them to it"
    return ""


def _survey_job(job: tuple[str, str]) -> list[SourceRow]:
    return survey_file(Path(job[0]), Path(job[1]))


def run_sglang_source_zoo(tree_or_version: str | Path, files: Sequence[str] | None = None, jobs: int = 1) -> SourceZoo:
    """Every decoder of an SGLang tree (a path, or a release number fetched once): see the module docstring.

    Example::

        zoo = run_sglang_source_zoo("0.5.23")
        zoo.counts[Status.CRASHED], len(zoo.ready_files()), len(zoo.files())
    """
    tree = source_tree(str(tree_or_version))
    paths = select_files(tree, files)
    return survey_tree(tree, release_of(tree), paths, _survey_job, jobs)


__all__ = ["model_files", "output_problems", "release_of", "run_sglang_source_zoo", "select_files", "survey_file"]
