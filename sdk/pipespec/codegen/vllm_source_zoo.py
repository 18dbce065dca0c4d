"""The source zoo: the vLLM-native codemod and the support verdict over the model files of any vLLM tree.

``run_source_zoo(tree)`` reads every ``.py`` under ``vllm/model_executor/models/`` and ``vllm/models/``
of a tree (a release fetched by ``pipespec.integrations.vllm.sources``, or a checkout) and gives one row
per decoder: every top-level class the codemod takes for a PP decoder, and every class whose ``forward``
takes ``intermediate_tensors`` and hands ``IntermediateTensors(...)`` to the next stage (a PP hand-off),
except a drafter's MTP block (its forward takes ``spec_step_idx``). Each row has a ``Status``:

* ``unchanged`` — the codemod leaves the decoder byte-identical: the class sets
  ``supports_aux_hidden_states_over_pp = True`` itself and its forward collects and packs aux states;
* ``supported`` — vLLM's released source already relays aux states over PP by pipespec's verdict
  (``pipespec.integrations.vllm.readiness.judge_decoder_source``: the flag is True through a parent and every
  forward in between delegates to ``super()`` or does the aux handling), though the codemod does not
  leave it as it is (it rewrites it, declines it, or finds no layer loop in it). Nothing to do for a user:
  pipespec's plugin leaves such a class alone, as vLLM does;
* ``adapted`` — the codemod rewrote it, and the output passed every check below;
* ``declined`` — the codemod's construct and line, or why a hand-off class it does not see is not ready;
* ``crashed`` — the codemod or the verdict raised (the exception in one line), or an adapted output
  failed a check: it must compile, carry the contract (the decoder inherits ``EagleModelMixin``, sets the
  flag True on itself, calls ``collect_remote_aux_hidden_states`` and ``pack_local_aux_hidden_states``;
  each ``*ForCausalLM`` holding it has ``SupportsEagle3``), import nothing from pipespec, and be idempotent
  (the codemod on its own output changes nothing and calls the decoder ``unchanged``).

Sibling modules are read from the tree itself (the codemod's reader gets each file's real path), never
from an installed vLLM. The rows, statuses and the run over files are the source zoos' shared ones
(``pipespec.codegen.source_zoo``). Nothing here imports vLLM, torch, or the code it reads.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipespec.codegen.source_zoo import (
    READY,
    CodemodStatus,
    SourceRow,
    SourceZoo,
    Status,
    one_line,
    survey_tree,
)
from pipespec.codemods.adapt_vllm_native import DecoderOutcome, adapt_vllm_module
from pipespec.codemods.vllm_native_index import default_reader
from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.contract.names import AUX_OVER_PP_FLAG, VLLM_AUX_CALLS, VLLM_EAGLE3_INTERFACE, VLLM_EAGLE_MIXIN
from pipespec.errors import UsageError
from pipespec.integrations.vllm.readiness import judge_decoder_source
from pipespec.integrations.vllm.sources import MODELS, source_tree

MODEL_DIRS = (MODELS, Path("models"))


# ----------------------------------------------------------------------------------------- the tree
def release_of(tree: Path) -> str:
    """The version a vllm package directory states in ``_version.py`` (read, not imported), else its path."""
    try:
        text = (tree / "_version.py").read_text(encoding="utf-8")
    except OSError:
        return str(tree)
    found = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else str(tree)


def model_files(tree: Path) -> list[Path]:
    """Every ``.py`` under the tree's ``model_executor/models/`` and ``models/``, sorted by relative path."""
    found = [p for d in MODEL_DIRS for p in (tree / d).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(found, key=lambda p: p.relative_to(tree).as_posix())


def select_files(tree: Path, wanted: Sequence[str] | None) -> list[Path]:
    """``model_files`` or, for ``--files``, those named by path under the package or by base name; a name
    that is not a model file of the tree is a ``UsageError``."""
    every = model_files(tree)
    if wanted is None:
        return every
    names = [w.strip() for w in wanted if w.strip()]
    if not names:
        raise UsageError("--files is empty: give comma-separated vLLM model files such as llama.py,qwen2.py")
    rel = {p: p.relative_to(tree).as_posix() for p in every}
    known = set(rel.values()) | {p.name for p in every} | {"vllm/" + r for r in rel.values()}
    unknown = [w for w in names if w not in known]
    if unknown:
        raise UsageError(f"--files {unknown[0]!r}: not a model file of the vLLM tree {tree} (give a path under the "
                         "vllm package such as model_executor/models/llama.py, or a base name such as llama.py)")
    chosen = set(names)
    return [p for p in every if rel[p] in chosen or p.name in chosen or "vllm/" + rel[p] in chosen]


# ------------------------------------------------------------------------------------- one file
def handoff_classes(module: ast.Module) -> list[ast.ClassDef]:
    """Top-level classes whose ``forward`` takes ``intermediate_tensors`` and returns ``IntermediateTensors(...)``,
    except a drafter's MTP block (its forward takes ``spec_step_idx``)."""
    found = []
    for cls in module.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name == "forward"), None)
        if forward is None:
            continue
        params = {a.arg for a in (*forward.args.posonlyargs, *forward.args.args, *forward.args.kwonlyargs)}
        if "intermediate_tensors" not in params or "spec_step_idx" in params:
            continue
        if any(isinstance(n, ast.Return) and isinstance(n.value, ast.Call) and _called_name(n.value) == "IntermediateTensors"
               for n in ast.walk(forward)):
            found.append(cls)
    return found


def survey_file(path: Path, tree: Path) -> list[SourceRow]:
    """The rows of one model file (none when it has no decoder)."""
    code = path.read_text(encoding="utf-8")
    if "intermediate_tensors" not in code:
        return []
    label, rel = path.relative_to(tree.parent).as_posix(), path.relative_to(tree).as_posix()
    try:
        module = ast.parse(code)
    except SyntaxError as exc:
        return [SourceRow(rel, "", Status.CRASHED, f"line {exc.lineno}: not valid Python: {exc.msg}",
                          CodemodStatus.CRASHED)]
    classes = {c.name: c for c in module.body if isinstance(c, ast.ClassDef)}
    handoff = handoff_classes(module)
    reader = default_reader(str(path))
    try:
        adaptation = adapt_vllm_module(code, label=label, read_module=reader)
        outcomes: tuple[DecoderOutcome, ...] = adaptation.decoders
        adapted_code = adaptation.code
    except UsageError:  # the codemod sees no PP decoder in this file
        outcomes, adapted_code = (), code
    except Exception as exc:  # one line, and the run goes on
        names = [c.name for c in handoff] or [""]
        return [SourceRow(rel, n, Status.CRASHED, f"the codemod raised {one_line(exc)}", CodemodStatus.CRASHED,
                          line=classes[n].lineno if n in classes else 0) for n in names]
    problems = output_problems(adapted_code, outcomes, label, reader) if adapted_code != code else {}
    rows = []
    for outcome in outcomes:
        cls = classes.get(outcome.class_name)
        rows.append(_row(path, tree, rel, outcome, problems.get(outcome.class_name), cls.lineno if cls else 0))
    seen = {o.class_name for o in outcomes}
    for cls in handoff:
        if cls.name not in seen:
            rows.append(_unseen_row(path, tree, rel, cls))
    return rows


def _row(path: Path, tree: Path, rel: str, outcome: DecoderOutcome, problem: str | None, line: int) -> SourceRow:
    name, causal, said = outcome.class_name, outcome.causal_lm, CodemodStatus(outcome.status)
    if problem is not None:
        return SourceRow(rel, name, Status.CRASHED, f"the adapted output fails its check: {problem}", said, causal, line)
    if outcome.status is DecoderStatus.UNCHANGED:
        return SourceRow(rel, name, Status.UNCHANGED, outcome.reason, said, causal, line)
    verdict = _verdict(path, tree, name)
    if isinstance(verdict, str):
        return SourceRow(rel, name, Status.CRASHED, verdict, said, causal, line)
    supported, why = verdict
    if supported:
        codemod = ("the codemod would rewrite it all the same (its output passes the checks)"
                   if outcome.status is DecoderStatus.ADAPTED else f"the codemod declines it ({outcome.reason})")
        return SourceRow(rel, name, Status.SUPPORTED, f"as released: {why}; {codemod}", said, causal, line)
    if outcome.status is DecoderStatus.ADAPTED:
        return SourceRow(rel, name, Status.ADAPTED, "", said, causal, line)
    return SourceRow(rel, name, Status.DECLINED, outcome.reason, said, causal, line)


def _unseen_row(path: Path, tree: Path, rel: str, cls: ast.ClassDef) -> SourceRow:
    verdict = _verdict(path, tree, cls.name)
    if isinstance(verdict, str):
        return SourceRow(rel, cls.name, Status.CRASHED, verdict, CodemodStatus.UNSEEN, line=cls.lineno)
    supported, why = verdict
    forward = next(f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name == "forward")
    unseen = (f"line {forward.lineno}: `{cls.name}.forward` hands IntermediateTensors to the next stage, but the codemod "
              "finds no loop over this stage's layers in it")
    if supported:
        return SourceRow(rel, cls.name, Status.SUPPORTED, f"as released: {why}; {unseen}", CodemodStatus.UNSEEN,
                         line=cls.lineno)
    return SourceRow(rel, cls.name, Status.DECLINED, f"{unseen}; {why}", CodemodStatus.UNSEEN, line=cls.lineno)


def _verdict(path: Path, tree: Path, name: str) -> tuple[bool, str] | str:
    """(supported, reason) by pipespec's support verdict on the released source, or the crash in one line."""
    try:
        judgement = judge_decoder_source(path, name, package_root=tree)
    except Exception as exc:  # one line, and the run goes on
        return f"the support verdict raised {one_line(exc)}"
    return judgement.supported, judgement.reason.replace(str(tree.parent) + "/", "")


# ------------------------------------------------------------------------------- output checks
def output_problems(code: str, outcomes: Sequence[DecoderOutcome], label: str, reader: Any) -> dict[str, str]:
    """For each adapted decoder, the first check its file's output fails (absent when it passes them all)."""
    adapted = [o for o in outcomes if o.status is DecoderStatus.ADAPTED]
    try:
        compile(code, label, "exec")
        module = ast.parse(code)
    except SyntaxError as exc:
        return {o.class_name: f"it does not compile: line {exc.lineno}: {exc.msg}" for o in adapted}
    shared = _pipespec_import(module) or _not_idempotent(code, adapted, label, reader)
    if shared:
        return {o.class_name: shared for o in adapted}
    classes = {c.name: c for c in module.body if isinstance(c, ast.ClassDef)}
    problems = {}
    for o in adapted:
        problem = _contract_problem(classes, o)
        if problem:
            problems[o.class_name] = problem
    return problems


def _pipespec_import(module: ast.Module) -> str:
    for node in ast.walk(module):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        for name in names:
            if name == "pipespec" or name.startswith("pipespec."):
                return f"line {node.lineno} imports {name} (generated vLLM code must import nothing from pipespec)"
    return ""


def _not_idempotent(code: str, adapted: Sequence[DecoderOutcome], label: str, reader: Any) -> str:
    try:
        again = adapt_vllm_module(code, label=label, read_module=reader)
    except Exception as exc:
        return f"the codemod on its own output raised {one_line(exc)}"
    if again.code != code:
        return "not idempotent: the codemod on its own output changes it again"
    status = {d.class_name: d.status for d in again.decoders}
    moved = [f"{o.class_name}: {status.get(o.class_name, 'not found')}" for o in adapted
             if status.get(o.class_name) is not DecoderStatus.UNCHANGED]
    return f"not idempotent: on its own output the codemod does not call it unchanged ({'; '.join(moved)})" if moved else ""


def _contract_problem(classes: dict[str, ast.ClassDef], outcome: DecoderOutcome) -> str:
    name = outcome.class_name
    cls = classes.get(name)
    if cls is None:
        return f"class {name} is missing from the output"
    if VLLM_EAGLE_MIXIN not in _base_names(cls):
        return f"{name} does not inherit {VLLM_EAGLE_MIXIN}"
    if not any(_sets_true(stmt) for stmt in cls.body):
        return f"{name} does not set {AUX_OVER_PP_FLAG} = True in its own body"
    called = {_called_name(n) for n in ast.walk(cls) if isinstance(n, ast.Call)}
    missing = [c for c in VLLM_AUX_CALLS if c not in called]
    if missing:
        return f"{name} never calls {' / '.join(missing)}"
    for holder in outcome.causal_lm:
        if not _has_eagle3(classes, holder, set()):
            return f"{holder} (holding {name}) does not implement {VLLM_EAGLE3_INTERFACE}"
    return ""


def _has_eagle3(classes: dict[str, ast.ClassDef], name: str, seen: set[str]) -> bool:
    """The class, or a base defined in the same file, lists ``SupportsEagle3`` among its bases."""
    cls = classes.get(name)
    if cls is None or name in seen:
        return False
    seen.add(name)
    bases = _base_names(cls)
    return VLLM_EAGLE3_INTERFACE in bases or any(_has_eagle3(classes, b, seen) for b in bases)


def _base_names(cls: ast.ClassDef) -> list[str]:
    out = []
    for base in cls.bases:
        node = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(node, ast.Name):
            out.append(node.id)
        elif isinstance(node, ast.Attribute):
            out.append(node.attr)
    return out


def _sets_true(stmt: ast.stmt) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    value = getattr(stmt, "value", None)
    return (any(isinstance(t, ast.Name) and t.id == AUX_OVER_PP_FLAG for t in targets)
            and isinstance(value, ast.Constant) and value.value is True)


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


# ------------------------------------------------------------------------------------- the run
def _survey_job(job: tuple[str, str]) -> list[SourceRow]:
    return survey_file(Path(job[0]), Path(job[1]))


def run_source_zoo(tree_or_version: str | Path, files: Sequence[str] | None = None, jobs: int = 1) -> SourceZoo:
    """Every decoder of a vLLM tree (a path, or a release number fetched once): see the module docstring.

    ``files`` limits it to those model files (paths under the package or base names). ``jobs`` > 1 surveys
    files in that many processes; the rows come back in file order either way.
    Example::

        zoo = run_source_zoo("0.34.0")
        zoo.counts[Status.CRASHED], len(zoo.ready_files()), len(zoo.files())
    """
    tree = source_tree(str(tree_or_version))
    paths = select_files(tree, files)
    return survey_tree(tree, release_of(tree), paths, _survey_job, jobs)


__all__ = ["READY", "SourceRow", "SourceZoo", "Status", "handoff_classes", "model_files", "output_problems", "release_of",
           "run_source_zoo", "select_files", "survey_file"]
