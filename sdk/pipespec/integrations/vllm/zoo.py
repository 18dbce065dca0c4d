"""``pipespec zoo --engine vllm``: every PP decoder of the installed vLLM, adapted and checked inside vLLM.

1. Enumerate: every ``.py`` under the installed ``vllm/model_executor/models/`` and ``vllm/models/``
   goes through ``adapt_vllm_module`` (the codemod finds the PP decoders; files without one are not
   decoders). Each decoder is ``adapted``, ``unchanged`` (already PP-correct) or ``declined``.
2. Map each decoder's ``*ForCausalLM`` to an architecture name through vLLM's registry.
3. Check: a PP=1 worker, a PP=2 pair and a PP=3 trio of processes (vLLM's own process groups over gloo
   on 127.0.0.1; ``pipespec.integrations.vllm.zoo_workers``) stay alive and every model streams through
   them, each request with a timeout; a group with a worker that dies or hangs is restarted. PP=1
   (``harness.check_pp1``): aux states == the unadapted model's residual stream. PP=2 (vLLM's default
   partition) and PP=3 (an uneven partition, ids on both stage boundaries; ``pp_ranks.pp3_partition``,
   ``pp3_ids``): every rank driven as vLLM's V2 runner drives it (``pp_ranks.run_pipeline``: receive slots
   reserved by vLLM, the middle rank's relay merged by vLLM's ``PPHandler``) receives, packs and sends
   exactly the aux keys ``pipespec.contract.layout.plan_layout`` plans for its stage, and the last rank's
   aux states equal the PP=1 reference.
4. Classify: ``verified`` (adapted, every check passes), ``supported`` (unchanged and every check
   passes), ``declined`` (the codemod's reason), ``failed`` (the exception or the mismatch, never hidden).

Imports vLLM (lives in ``pipespec.integrations.vllm``); nothing outside that package may import it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.contract.names import AUX_KEY_PREFIX
from pipespec.integrations.vllm.harness import Job
from pipespec.integrations.vllm.pp_ranks import (
    PipelineError,
    PipelineRun,
    max_error,
    pp3_ids,
    pp3_partition,
    run_pipeline,
)
from pipespec.integrations.vllm.reference_stream import ATOL
from pipespec.integrations.vllm.zoo_workers import WorkerPool
from pipespec.str_enum import StrEnum

__all__ = ["ENVIRONMENT_ERRORS", "FLAG_CLASSES", "STATUSES", "VllmZooStatus", "ZooResult", "decoder_files",
           "inherited_flag_verdicts", "run_vllm_zoo"]


class VllmZooStatus(StrEnum):
    """A decoder's outcome in ``pipespec zoo --engine vllm`` (its JSON ``"status"``), from best to worst."""

    VERIFIED = "verified"  # adapted by the codemod and checked numerically at PP=1, 2 and 3
    SUPPORTED = "supported"  # right in vLLM as released (the codemod leaves it unchanged), checked the same way
    DECLINED = "declined"  # the codemod declines its forward (the reason names the construct)
    FAILED = "failed"  # built or adapted, but wrong, crashed or not checkable here (the reason says which)


STATUSES = tuple(VllmZooStatus)
#: The inherited-flag classes of issue 14, judged by ``pipespec.integrations.vllm.readiness``.
FLAG_CLASSES = (
    ("vllm.model_executor.models.qwen3_vl", "Qwen3LLMModel"),
    ("vllm.model_executor.models.moss_audio", "MossQwen3Model"),
    ("vllm.model_executor.models.mistral", "MistralModel"),
    ("vllm.model_executor.models.mimo", "MiMoModel"),
)


@dataclasses.dataclass
class ZooResult:
    """One decoder's row: DESIGN.md's ``{"file", "class", "status", "reason"}`` plus the measurements."""

    file: str
    class_name: str
    status: VllmZooStatus
    reason: str
    codemod: DecoderStatus | None = None  # what the codemod did (None: not run through it; JSON "")
    causal_lm: str = ""
    architecture: str = ""
    aux_layers: tuple[int, ...] = ()
    num_layers: int | None = None
    max_abs_err_pp1: float | None = None
    max_abs_err_pp2: float | None = None
    sends_stage0: tuple[str, ...] = ()  # PP=2 rank 0
    partition_pp3: tuple[int, ...] = ()
    aux_layers_pp3: tuple[int, ...] = ()
    max_abs_err_pp3: float | None = None
    sends_pp3_stage0: tuple[str, ...] = ()
    sends_pp3_stage1: tuple[str, ...] = ()  # the relaying middle rank: relayed keys, then its own

    def __post_init__(self) -> None:
        self.status = VllmZooStatus(self.status)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file, "class": self.class_name, "status": self.status, "reason": self.reason,
            "codemod": self.codemod or "", "causal_lm": self.causal_lm, "architecture": self.architecture,
            "aux_layers": list(self.aux_layers), "num_layers": self.num_layers,
            "max_abs_err_pp1": self.max_abs_err_pp1, "max_abs_err_pp2": self.max_abs_err_pp2,
            "sends_stage0": list(self.sends_stage0), "partition_pp3": list(self.partition_pp3),
            "aux_layers_pp3": list(self.aux_layers_pp3), "max_abs_err_pp3": self.max_abs_err_pp3,
            "sends_pp3_stage0": list(self.sends_pp3_stage0), "sends_pp3_stage1": list(self.sends_pp3_stage1),
        }


def vllm_root() -> str:
    """The installed vllm package directory, found without importing vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
    return os.path.abspath(list(spec.submodule_search_locations)[0])


def decoder_files(only: Sequence[str] | None = None) -> list[str]:
    """Model files (relative to the vllm package) that may hold a PP decoder, sorted.

    ``only`` keeps the files whose relative path or base name is listed.
    """
    root = vllm_root()
    found = []
    for sub in ("model_executor/models", "models"):
        for path in glob.glob(os.path.join(root, sub, "**", "*.py"), recursive=True):
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if "intermediate_tensors" in text and "class " in text:
                found.append(rel)
    found.sort()
    if only is not None:
        wanted = set(only)
        found = [f for f in found if f in wanted or os.path.basename(f) in wanted]
    return found


def module_of(rel: str) -> str:
    return "vllm." + rel.removesuffix(".py").replace("/", ".")


def _architecture(module: str, class_name: str) -> str | None:
    """The registry name that builds ``module.class_name``; the registry may name the package that
    re-exports the class (``vllm.models.hy_v4`` for ``vllm.models.hy_v4.nvidia.model``)."""
    from pipespec.integrations.vllm.tiny import _registry

    exact = _registry().get((module, class_name))
    if exact:
        return exact[0]
    for (mod, cls), archs in _registry().items():
        if cls == class_name and module.startswith(mod + "."):
            return archs[0]
    return None


def _registered_classes(module: str, source: str) -> list[str]:
    """Registered classes defined in ``source`` (the file of ``module``), read from the text so that the
    parent never imports model code: the exact module, or a package that re-exports the file's class."""
    from pipespec.integrations.vllm.tiny import _registry

    return sorted({cls for (mod, cls) in _registry()
                   if (mod == module or module.startswith(mod + ".")) and f"class {cls}(" in source})


# --------------------------------------------------------------------------------------- checks
#: Build errors that come from this machine's vLLM build, not from the model or its adaptation: (text in
#: the error, what it means). A row with one stays "failed"; its reason says the decoder was not checked.
ENVIRONMENT_ERRORS = (
    ("No module named 'torchvision'", "the model module imports torchvision (its image processor) at import; this "
     "venv has none, as PyPI's torchvision for torch 2.13 breaks `import vllm` (torchvision::nms)"),
    ("Torch not compiled with CUDA enabled", "this variant builds CUDA tensors or kernels at construction"),
    ("module 'triton' has no attribute", "a layer sets up Triton at construction; this CPU build has no Triton backend"),
    ("'_moe_C'", "its MoE router calls a CUDA fused-MoE op (torch.ops._moe_C) that the CPU build does not have"),
    ("No module named 'cutlass'", "this variant imports NVIDIA CUTLASS"),
    ("not supported by backend CPU_ATTN", "its attention asks for an option vLLM's CPU attention backend rejects"),
    ("CPUAttentionBackendImpl.__init__() got an unexpected keyword",
     "its attention passes an option vLLM's CPU attention backend does not take"),
    ("Tried to instantiate dummy base class Event", "its attention creates torch.cuda.Event objects at "
     "construction, which the CPU-only torch that vLLM's CPU build pins cannot make"),
    ("torch.cuda.Stream requires CUDA support", "this variant creates CUDA streams at construction"),
    ("is supported only for CUDA, XPU and ROCm", "its MLP asks for an activation vLLM implements only for "
     "CUDA, XPU and ROCm"),
    ("Sparse Attention is not supported on CPU", "its sparse attention has no backend in vLLM's CPU build"),
    ("WorkspaceManager not initialized", "its attention takes scratch space from vLLM's workspace manager, which "
     "only vLLM's GPU worker sets up (its CPU worker never does)"),
    ("_VLRotaryEmbedding.forward_native() takes", "vLLM's CPU rotary path (MRotaryEmbedding.forward_cpu) passes "
     "`offsets` to forward_native, which this model's override does not take: a bug of vLLM's CPU path (GPU "
     "builds run forward_cuda); the harness already passes (3, T) mrope positions as vLLM's runner does"),
)


def _environment(reason: str) -> str:
    for text, meaning in ENVIRONMENT_ERRORS:
        if text in reason:
            return f"{reason} [not checked on this machine: {meaning}; the adapted decoder was not built]"
    return reason


def _check(pool: WorkerPool, job: Job, row: ZooResult) -> None:
    """Fill ``row`` from the PP=1, PP=2 and PP=3 checks of ``job``."""
    kind, answer = pool.ask("pp1", ("pp1", (job,)))
    if kind != "ok":  # a mismatch names its check itself ("PP=1: aux id ...", "... at PP=1")
        row.status, row.reason = VllmZooStatus.FAILED, answer if kind == "mismatch" else _environment(f"PP=1: {answer}")
        return
    n, ids, reference = answer["num_layers"], tuple(answer["ids"]), answer["reference"]
    row.num_layers, row.aux_layers, row.max_abs_err_pp1 = n, ids, answer["max_abs_err"]
    try:
        pp2 = _pipeline(pool, job, ids, n, 2, None, reference)
        row.max_abs_err_pp2, row.sends_stage0 = pp2.error, pp2.run.sends(0)
        partition = pp3_partition(n)
        row.partition_pp3, row.aux_layers_pp3 = partition, pp3_ids(n, partition)
        pp3 = _pipeline(pool, job, row.aux_layers_pp3, n, 3, partition, reference)
    except (PipelineError, ValueError) as exc:
        row.status, row.reason = VllmZooStatus.FAILED, str(exc) if isinstance(exc, PipelineError) else f"PP=3: {exc}"
        return
    row.max_abs_err_pp3 = pp3.error
    row.sends_pp3_stage0, row.sends_pp3_stage1 = pp3.run.sends(0), pp3.run.sends(1)
    relayed = pp3.run.plan.stage(1).relays
    own = [k for k in row.sends_pp3_stage1 if k not in relayed]
    row.status = VllmZooStatus.VERIFIED if job.code is not None else VllmZooStatus.SUPPORTED
    row.reason = (f"PP=1, PP=2 and PP=3 aux states equal the residual stream (ids {list(ids)}; PP=3: partition "
                  f"{list(partition)}, ids {list(row.aux_layers_pp3)}); PP=2 rank 0 sends {_keys(row.sends_stage0)}; "
                  f"PP=3 rank 1 relays {_keys(relayed)} and sends its own {_keys(own)}")


@dataclasses.dataclass(frozen=True)
class _Checked:
    run: PipelineRun
    error: float


def _pipeline(pool: WorkerPool, job: Job, ids: Sequence[int], n: int, pp: int, partition: tuple[int, ...] | None,
              reference: dict[int, np.ndarray]) -> _Checked:
    """One PP run of ``job`` checked against the plan (``run_pipeline``) and the PP=1 reference."""
    run = run_pipeline(pool, job, ids, n, pp, partition)
    worst, err = max_error(run, reference)
    if not err <= ATOL:
        where = f"PP={pp}" + ("" if partition is None else f" (partition {list(partition)})")
        raise PipelineError(f"{where}: aux id {worst} differs from the PP=1 residual stream by {err:.3g} "
                            f"(ids {list(run.plan.aux_layers)})")
    return _Checked(run=run, error=err)


def _keys(keys: Sequence[str]) -> str:
    """Aux keys for a reason: ``aux_hidden_states_0..3`` for a run of consecutive slots."""
    if not keys:
        return "no aux keys"
    slots = [int(k[len(AUX_KEY_PREFIX):]) for k in keys]
    if len(slots) > 1 and slots == list(range(slots[0], slots[0] + len(slots))):
        return f"{AUX_KEY_PREFIX}{slots[0]}..{slots[-1]}"
    return ", ".join(keys)


def _jobs_for(rel: str, outcome: Any, code: str | None, source: str) -> tuple[Job | None, str]:
    """The job checking ``outcome``'s decoder, or None and the reason none can be built.

    What is built is what a user serves: a holder (``*ForCausalLM``) of the decoder that vLLM's registry
    names, else a registered class of the same file (it holds the holder: OPTForCausalLM around OPTModel
    around OPTDecoder; a multimodal model around its language model). The decoder is then found inside it
    by class name.
    """
    module = module_of(rel)
    registered = _registered_classes(module, source)
    holders = list(outcome.causal_lm)
    attr = outcome.decoder_attr or "model"
    for holder in [*holders, *(c for c in registered if c not in holders)]:
        arch = _architecture(module, holder)
        if arch is not None:
            return Job(file=rel, module=module, decoder=outcome.class_name, causal_lm=holder, architecture=arch,
                       decoder_attr=attr, code=code), ""
    # a registered class built around a holder first, then one around the decoder itself (a draft head such as
    # DSparkV41DraftModel imports DeepseekV4Model too, but it is not the model a user serves)
    around = _importing_holders(module, holders) if holders else []
    around += [p for p in _importing_holders(module, [outcome.class_name]) if p not in around]
    for holder_module, registered_cls in around:
        arch = _architecture(holder_module, registered_cls)
        if arch is not None:
            return Job(file=rel, module=module, decoder=outcome.class_name, causal_lm=registered_cls,
                       architecture=arch, decoder_attr=attr, code=code, holder_module=holder_module), ""
    return None, (f"no architecture in vLLM's registry builds a class holding {outcome.class_name} "
                  f"(holders in {rel}: {', '.join(holders) or 'none'}; registered classes in it: "
                  f"{', '.join(registered) or 'none'}; no registered module imports them), so vLLM cannot build "
                  "it by name")


def _importing_holders(module: str, names: Sequence[str]) -> list[tuple[str, str]]:
    """(registered module, registered class) pairs whose module imports one of ``names`` from ``module``
    and defines the registered class: the registered model built around a holder in another file
    (ernie45_vl's ``Ernie4_5_VLMoeForConditionalGeneration`` around ernie45_vl_moe's holder). A registry
    module that is a package is followed to the modules defining the class (``_defining_modules``). Read
    from the source (ast), so the parent never imports model code."""
    import ast

    from pipespec.integrations.vllm.tiny import _registry

    package, _, stem = module.rpartition(".")
    out = []
    for registered, cls in sorted(_registry()):
        for mod in _defining_modules(registered, cls):
            if mod == module:
                continue
            path = _module_path(mod)
            tree = _parsed(path)
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and _import_source(node, mod, path) in (module, f"{package}.{stem}") \
                        and any(a.name in names for a in node.names):
                    out.append((mod, cls))
                    break
    return out


def _module_path(mod: str) -> str:
    """The source file of ``mod`` (a ``vllm.`` module: ``<name>.py``, else its package's ``__init__.py``) by
    the codemod's own import rule (``vllm_native_index.module_path``); "" when it is not on disk."""
    from pathlib import Path

    from pipespec.codemods.vllm_native_index import module_path

    found = module_path(mod, 0, Path(), Path(vllm_root()), packages=True)
    return str(found) if found is not None else ""


def _import_source(node: Any, importer: str, path: str) -> str:
    """The absolute module a ``from ... import`` statement of module ``importer`` (source file ``path``)
    imports from: relative levels count from the importer's package (itself, for an ``__init__.py``)."""
    if node.level == 0:
        return str(node.module or "")
    parts = (importer if path.endswith("__init__.py") else importer.rpartition(".")[0]).split(".")
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _defining_modules(mod: str, cls: str, depth: int = 0) -> list[str]:
    """The modules that define the registered class ``mod.cls``: ``mod`` itself, or, where ``mod`` is a
    package whose ``__init__`` imports ``cls`` (per platform: ``vllm.models.deepseek_v41`` imports
    ``DeepseekV41ForCausalLM`` from ``.amd.vl_model`` on ROCm, else from ``.nvidia.vl_model``), every
    module any branch of it imports the class from (each followed again, a few levels deep)."""
    import ast

    if not mod.startswith("vllm."):
        return []
    path = _module_path(mod)
    tree = _parsed(path)
    if tree is None:
        return []
    if any(isinstance(n, ast.ClassDef) and n.name == cls for n in tree.body):
        return [mod]
    if depth > 2:
        return []
    out: list[str] = []
    for node in ast.walk(tree):  # every branch of a platform switch
        if isinstance(node, ast.ImportFrom) and any(a.name == cls and a.asname in (None, cls) for a in node.names):
            for found in _defining_modules(_import_source(node, mod, path), cls, depth + 1):
                if found not in out:
                    out.append(found)
    return out


_PARSED: dict[str, Any] = {}


def _parsed(path: str) -> Any:
    import ast

    if path not in _PARSED:
        try:
            with open(path, encoding="utf-8") as f:
                _PARSED[path] = ast.parse(f.read())
        except (OSError, SyntaxError):
            _PARSED[path] = None
    return _PARSED[path]


def adapt_files(files: Sequence[str], progress: Callable[[str], None] | None = None) -> list[tuple[str, Any, str | None, str]]:
    """(file, decoder outcome, adapted code or None, installed source) for every PP decoder in ``files``."""
    from pathlib import Path

    from pipespec.codemods.adapt_vllm_native import adapt_vllm_module
    from pipespec.codemods.vllm_native_modules import ModuleSources
    from pipespec.errors import UsageError

    root = vllm_root()
    out: list[tuple[str, Any, str | None, str]] = []
    for rel in files:
        if progress is not None:
            progress(rel)
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            code = f.read()
        try:
            adaptation = adapt_vllm_module(code, label=rel, read_module=ModuleSources(Path(os.path.join(root, rel))))
        except UsageError:
            continue  # no PP decoder in this file
        for outcome in adaptation.decoders:
            adapted = adaptation.code if outcome.status is DecoderStatus.ADAPTED and adaptation.code != code else None
            out.append((rel, outcome, adapted, code))
    return out


def run_vllm_zoo(files: Sequence[str], progress: Any | None = None) -> list[ZooResult]:
    """Adapt and check every PP decoder in ``files`` (see the module docstring)."""
    pool = WorkerPool()  # workers import vLLM while the codemod runs
    try:
        decoders = adapt_files(files, None if progress is None else progress.adapting)
        if progress is not None:
            progress.start(len(decoders))
        results = []
        for rel, outcome, code, source in decoders:
            row = ZooResult(file=rel, class_name=outcome.class_name, status=VllmZooStatus.FAILED, reason="",
                            codemod=outcome.status)
            if outcome.status is DecoderStatus.DECLINED:
                row.status, row.reason = VllmZooStatus.DECLINED, outcome.reason
            elif outcome.status is DecoderStatus.ADAPTED and code is None:
                row.reason = "the codemod says adapted but returned the source unchanged"
            else:
                job, why = _jobs_for(rel, outcome, code, source)
                if job is None:
                    row.reason = why
                else:
                    row.causal_lm, row.architecture = job.causal_lm, job.architecture
                    _check(pool, job, row)
            results.append(row)
            if progress is not None:
                progress.done(row)
        return results
    finally:
        pool.close()


def inherited_flag_verdicts() -> list[dict[str, Any]]:
    """``judge_vllm_class`` on issue 14's four inherited-flag classes (PP = 2); a module that cannot be
    imported here (qwen3_vl needs torchvision) is judged from its source (``judge_decoder_source``)."""
    import importlib

    from pipespec.integrations.vllm.readiness import judge_decoder_source, judge_vllm_class

    rows = []
    for module, name in FLAG_CLASSES:
        how = "class"
        try:
            try:
                verdict = judge_vllm_class(getattr(importlib.import_module(module), name), pp=2)
            except ImportError:
                path = os.path.join(vllm_root(), *module.split(".")[1:]) + ".py"
                verdict = judge_decoder_source(path, name, vllm_root())
                how = "source (the module does not import here)"
            rows.append({"module": module, "class": name, "supported": verdict.supported, "judged_from": how,
                         "opted_out": verdict.opted_out, "message": verdict.message()})
        except Exception as exc:  # noqa: BLE001 - a verdict that cannot be reached is reported as such
            rows.append({"module": module, "class": name, "supported": None, "judged_from": how, "opted_out": False,
                         "message": f"could not judge: {type(exc).__name__}: {exc}"})
    return rows


# --------------------------------------------------------------------------------------- report
def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, the installed package's path shown as ``vllm/``."""
    return " ".join(str(text).split()).replace("|", "\\|").replace(vllm_root() + os.sep, "vllm/")


def coverage_markdown(results: Sequence[ZooResult], verdicts: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """docs/coverage-vllm.md: how it was made, counts, the inherited-flag verdicts, one row per decoder."""
    counts = {s: sum(r.status is s for r in results) for s in STATUSES}
    by_codemod = {s: sum(r.codemod is s for r in results) for s in DecoderStatus}
    pp2_passed = sum(r.max_abs_err_pp2 is not None for r in results)
    pp3_passed = sum(r.max_abs_err_pp3 is not None for r in results)
    out = [
        "# vLLM zoo coverage",
        "",
        f"<!-- generated by `{meta['command']}` (`make zoo-vllm`); do not edit, regenerate -->",
        "",
        f"Every decoder with a PP layer loop in the installed vLLM {meta['vllm']} (torch {meta['torch']}, "
        f"transformers {meta['transformers']}): `vllm/model_executor/models/` and `vllm/models/` through "
        "`adapt_vllm_module`, then built tiny inside vLLM on CPU (float32, its own `VllmConfig`, "
        "`set_current_vllm_config`, `initialize_model`, seeded weights by parameter name) and checked in vLLM's "
        "own process groups (`init_distributed_environment` + `initialize_model_parallel`, gloo on 127.0.0.1): "
        f"PP=1 aux states equal the unadapted model's residual stream (max abs error <= {ATOL:g}); PP=2 (two "
        "processes, vLLM's default partition) and PP=3 (three processes, an uneven partition with a relaying "
        "middle rank and an aux id on both stage boundaries; `pipespec.integrations.vllm.pp_ranks`): every rank "
        "is driven as vLLM's V2 model runner drives it (aux ids and receive slots set by vLLM's "
        "`set_eagle3_aux_hidden_state_layers` / `reserve_aux_intermediate_tensor_slots`, "
        "`verify_supports_aux_hidden_states_over_pp`, relay keys from `aux_hidden_state_relay_keys`, the relay "
        "merged by `PPHandler.relay_aux_hidden_states`, tensors passed with `get_pp_group().send_tensor_dict`), "
        "receives, packs and sends exactly the aux keys `pipespec.contract.layout.plan_layout` plans for its "
        "stage, and the last rank's aux states equal the PP=1 reference. Attention "
        "is not exercised: without the model runner's metadata vLLM's attention layers return an unwritten "
        "buffer, so the harness zeroes every attention layer's output in both models; Mamba-1/Mamba-2 "
        "mixers are not run at all (their no-metadata paths cannot run on the CPU build) and output zeros "
        "(`pipespec.integrations.vllm.harness`). Multimodal models are built in vLLM's text-only mode "
        "(`language_model_only`: towers not built), except where that mode breaks the model (MOSS-Audio: "
        "a tiny tower is built, `pipespec.integrations.vllm.tiny.TOWERS_BUILT`). Where a tiny config departs from the model's usual shape "
        "to run on this CPU build (e.g. dense layers, full attention), `pipespec.integrations.vllm.tiny` "
        "says why per architecture. A reason ending in \"not checked on this machine\" is a build error of "
        "this vLLM CPU build (torchvision, CUDA, Triton, CUTLASS, CPU attention options): that decoder was "
        "adapted but neither built nor checked here.",
        "",
        f"Generated {meta['date']} in {meta['wall_s']:.0f} s wall ({meta['cpus']} CPUs, load average "
        f"{meta['load']:.1f} at the start).",
        "",
        "## Counts",
        "",
        "| status | decoders |",
        "|---|---|",
        *[f"| {s} | {counts[s]} |" for s in STATUSES],
        f"| **total** | **{len(results)}** |",
        "",
        "Codemod outcome: " + ", ".join(f"{by_codemod[k]} {k}" for k in by_codemod) + ".",
        "",
        f"PP=3: {pp3_passed} of the {pp2_passed} decoders that pass PP=1 and PP=2 pass PP=3 too (`verified` and "
        "`supported` mean all three pass).",
        "",
        "## Inherited-flag classes (`pipespec.integrations.vllm.readiness.judge_vllm_class`, PP = 2)",
        "",
        "| class | module | supported | judged from | verdict |",
        "|---|---|---|---|---|",
        *[f"| {v['class']} | {v['module']} | {v['supported']} | {v['judged_from']} | {_cell(v['message'])} |"
          for v in verdicts],
        "",
        "## Per decoder",
        "",
        "| file | decoder | status | architecture | ids | err PP=1 | err PP=2 | PP=3 partition: ids | err PP=3 | reason |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        e1, e2, e3 = ("" if e is None else f"{e:.2g}" for e in (r.max_abs_err_pp1, r.max_abs_err_pp2, r.max_abs_err_pp3))
        ids = ",".join(map(str, r.aux_layers))
        pp3 = f"{','.join(map(str, r.partition_pp3))}: {','.join(map(str, r.aux_layers_pp3))}" if r.partition_pp3 else ""
        out.append(f"| {r.file} | {r.class_name} | {r.status} | {r.architecture} | {ids} | {e1} | {e2} | {pp3} | {e3} "
                   f"| {_cell(r.reason)} |")
    return "\n".join(out) + "\n"
