"""``adapter-gen``'s decisions before any rewrite: the dialect, the vLLM the code targets, the spec.

``detect_dialect`` tells vLLM-style from HF-style code by the decoder's ``forward`` signature;
``vllm_contract_source`` finds the vLLM a file is adapted for (the tree it sits in, else the importable
one, read as text and never imported) and refuses one older than 0.32 (no
``EagleModelMixin.pack_local_aux_hidden_states``); ``resolve_spec`` picks the adapter spec: ``--spec FILE``,
else the registry, else inferred. Reads source trees only; imports no torch and no vLLM.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from pipespec.codegen.source import Target, project_label
from pipespec.contract.names import AUX_OVER_PP_FLAG
from pipespec.contract.registry import Registry, default_registry
from pipespec.contract.spec import AdapterSpec, load_spec
from pipespec.errors import UsageError

__all__ = [
    "VLLM_CONTRACT",
    "detect_dialect",
    "detect_module_dialect",
    "is_adapted",
    "resolve_spec",
    "spec_label",
    "vllm_contract_source",
    "vllm_root_of",
]

_MARKED = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(AUX_OVER_PP_FLAG))], value=m.Name("True"))])


def is_adapted(node: cst.ClassDef) -> bool:
    """The class carries ``supports_aux_hidden_states_over_pp = True`` in its own body (generated code)."""
    return isinstance(node.body, cst.IndentedBlock) and any(m.matches(s, _MARKED) for s in node.body.body)


def detect_dialect(node: cst.ClassDef) -> str:
    """``vllm`` when the class's forward takes ``positions`` and ``intermediate_tensors`` (vLLM's model
    signature), else ``hf`` (transformers' forwards take ``position_ids`` and no stage tensors)."""
    for stmt in node.body.body if isinstance(node.body, cst.IndentedBlock) else ():
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            p = stmt.params
            names = {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}
            return "vllm" if {"positions", "intermediate_tensors"} <= names else "hf"
    return "hf"


def detect_module_dialect(module: cst.Module) -> str:
    """``vllm`` when any top-level class has vLLM's forward signature, else ``hf``."""
    tops = [s for s in module.body if isinstance(s, cst.ClassDef)]
    return "vllm" if any(detect_dialect(c) == "vllm" for c in tops) else "hf"


VLLM_CONTRACT = ("class EagleModelMixin", "def pack_local_aux_hidden_states")


def vllm_root_of(path: Path) -> Path | None:
    for parent in path.resolve().parents:
        if parent.name == "vllm" and (parent / "model_executor" / "models" / "interfaces.py").is_file():
            return parent
    return None


def vllm_contract_source(path: Path | None) -> tuple[Path | None, str]:
    """The vLLM the adapted code targets: the tree ``path`` sits in, else the importable ``vllm`` (found by
    ``importlib.util.find_spec``, which does not run it). Returns (package dir or None, version text).

    Raises ``UsageError`` when that vLLM predates 0.32's contract (its ``interfaces.py`` has no
    ``EagleModelMixin.pack_local_aux_hidden_states``)."""
    root = vllm_root_of(path) if path is not None else None
    if root is None:
        found = importlib.util.find_spec("vllm")
        places = [Path(p) for p in (found.submodule_search_locations or [])] if found is not None else []
        real = [p for p in places if (p / "model_executor" / "models").is_dir()]  # not a namespace dir named vllm
        if not real:
            return None, ""
        root = real[0]
    interfaces = root / "model_executor" / "models" / "interfaces.py"
    version_file = root / "_version.py"
    version = ""
    if version_file.is_file():
        hit = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", version_file.read_text(encoding="utf-8"))
        version = hit.group(1) if hit else ""
    text = interfaces.read_text(encoding="utf-8") if interfaces.is_file() else ""
    if not all(piece in text for piece in VLLM_CONTRACT):
        shown = f"vLLM {version}" if version else "the vLLM"
        raise UsageError(f"{shown} at {root} has no EagleModelMixin.pack_local_aux_hidden_states in "
                         f"{interfaces.name}: the vllm dialect emits vLLM >= 0.32's EAGLE3-over-PP contract; "
                         "upgrade vLLM to 0.32 or later (or use --dialect pipespec for pipespec's own runtime)")
    return root, version


def spec_label(spec: AdapterSpec | None) -> str:
    """How headers and messages name a spec: ``name (project-relative source)``."""
    if spec is None:
        return "none, shape detected from the source"
    source = spec.source
    if source and Path(source).is_absolute() and Path(source).exists():
        source = project_label(Path(source))
    return f"{spec.name} ({source})"


def resolve_spec(
    target: Target, dialect: str, spec_file: str | None = None, registry: Registry | None = None
) -> AdapterSpec | None:
    """``--spec FILE``; else the registry entry naming this class (same dialect, module matching the file
    when several do); else for HF code the spec inferred from the source; else ``None`` (the vLLM
    codemod reads everything it needs from the source)."""
    if spec_file is not None:
        return load_spec(spec_file)
    if target.class_name is None:
        return None
    registry = registry or default_registry()
    if target.module_name is not None:
        spec = registry.lookup(f"{target.module_name}:{target.class_name}")
        if spec is not None:
            return spec
    named = [e.spec for e in registry.entries() if e.spec.decoder_class_name == target.class_name and e.spec.dialect == dialect]
    same_module = [s for s in named if s.decoder_module.rsplit(".", 1)[-1] == target.path.stem]
    if len(same_module) == 1 or len(named) == 1:
        return (same_module or named)[0]
    if len(named) > 1:
        raise UsageError(
            f"{target.label}: several {dialect} specs name class {target.class_name} "
            f"({', '.join(s.source for s in named)}); pick one with --spec FILE"
        )
    if dialect == "hf":
        from pipespec.integrations.transformers.infer import infer_spec

        return infer_spec(target.code, class_name=target.class_name, module=target.module_name or target.path.stem)
    return None
