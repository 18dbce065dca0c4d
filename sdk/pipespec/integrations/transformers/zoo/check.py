"""One type's zoo check: build its tiny model, adapt its decoder, run it as P stages, compare.

For one model type and each pipeline size P: the **reference** (``reference.run_reference``: the tiny
model's own decoder, float32, every aux id recorded by hooks), the **stages** (``stages.InProcessPipeline``:
``pipespec.adapt(<decoder class>)`` instantiated once per stage with the reference's weights) and the
**comparison** (``compare.compare_stage_outputs``: final hidden state and every aux state).

Status: ``verified`` (every P agreed), ``declined`` (with the specific reason: the tiny model cannot be
built, or the adaptation refuses the forward's shape), ``failed`` (the adaptation ran but disagreed, or
crashed after adapting: a bug). One type's exception never stops the run. Knows nothing of other types,
worker processes or reports (``runner``, ``report``).
"""

from __future__ import annotations

import copy
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipespec.contract.names import HAS_RESIDUAL_ATTR
from pipespec.integrations.transformers.zoo.compare import Mismatch, compare_stage_outputs
from pipespec.integrations.transformers.zoo.reference import (
    Reference,
    dotted_get,
    find_decoder,
    make_input_ids,
    reference_decode,
    run_reference,
)
from pipespec.integrations.transformers.zoo.shapes import classify_forward_shape
from pipespec.integrations.transformers.zoo.stages import InProcessPipeline, uneven_partition, zoo_aux_ids
from pipespec.integrations.transformers.zoo.tiny import TinyBuildError, TinyModel, build_tiny_model
from pipespec.str_enum import StrEnum

__all__ = ["STATUSES", "ZooResult", "ZooStatus", "run_type", "short_error"]


class ZooStatus(StrEnum):
    """A model type's outcome in ``pipespec zoo`` (its JSON ``"status"``), from best to worst."""

    VERIFIED = "verified"  # adapted, and every stage split equals the unadapted model
    DECLINED = "declined"  # a forward shape the codemod does not rewrite (the reason names it)
    FAILED = "failed"  # adapted or built, but wrong or crashed: a bug to look at


STATUSES = tuple(ZooStatus)


@dataclass
class ZooResult:
    """The outcome for one model type; ``to_json`` is the DESIGN.md contract of ``pipespec zoo --json``."""

    model_type: str
    status: ZooStatus
    reason: str = ""
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    shape: str = "other"
    decoder_class: str = ""
    num_layers: int | None = None
    pp_sizes: tuple[int, ...] = ()
    fixes: tuple[str, ...] = ()
    hf_hidden_states_match: bool | None = None  # HF hidden_states[L] == input of layer L for every L < N
    hf_last_is_post_norm: bool | None = None  # HF hidden_states[-1] == last_hidden_state
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.status = ZooStatus(self.status)

    def to_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "status": self.status, "reason": self.reason, "max_abs_err": self.max_abs_err}


@dataclass
class _Subject:
    """What a type's stage runs are checked with: the adapted class's template instance (the reference
    decoder's weights), the inputs, and the unadapted model's references."""

    spec: Any
    template: torch.nn.Module
    input_ids: torch.Tensor
    reference: Reference
    num_layers: int
    has_residual: bool
    cache_kwarg: str | None
    steps: list[tuple[torch.Tensor, Reference]]  # (step input ids, reference) per decode step


def short_error(exc: BaseException) -> str:
    """``Type: message`` on one line, the message cut at 400 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename.rsplit('/', 2)[-1]}:{f.lineno})"


def run_type(model_type: str, pp_sizes: Sequence[int] = (1, 2, 3), seed: int = 0, decode_steps: int = 0) -> ZooResult:
    """Verify, decline or fail one model type. Never raises (except KeyboardInterrupt).

    ``decode_steps > 0`` also decodes that many tokens after the prefill, every stage with its own
    ``pipespec.integrations.transformers.stage_cache`` cache, against the unadapted model decoding with its own cache.
    """
    start = time.perf_counter()
    result = ZooResult(model_type=model_type, status=ZooStatus.DECLINED)
    try:
        _run_type(result, pp_sizes, seed, decode_steps)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one type must never kill the run
        result.status = ZooStatus.FAILED
        result.reason = f"zoo runner error: {short_error(exc)}{_where(exc)}"
    result.seconds = time.perf_counter() - start
    return result



def _run_type(result: ZooResult, pp_sizes: Sequence[int], seed: int, decode_steps: int) -> None:
    found = _adapt_decoder(result, seed)
    if found is None:
        return
    tiny, decoder, adapted = found
    subject = _subject(result, tiny, decoder, adapted, seed, decode_steps)
    if subject is not None:
        _check_pipelines(result, subject, pp_sizes, decode_steps)


def _adapt_decoder(result: ZooResult, seed: int) -> tuple[TinyModel, torch.nn.Module, type] | None:
    """The tiny model, its decoder stack and ``adapt(<decoder class>)``; ``None`` once ``result`` says why not."""
    from pipespec.errors import PipespecError
    from pipespec.integrations.transformers.adapt import adapt
    from pipespec.integrations.transformers.infer import decoder_class_for_model_type

    model_type = result.model_type
    try:
        tiny = build_tiny_model(model_type, seed=seed)
    except TinyBuildError as exc:
        result.reason = f"could not build tiny model: {exc}"
        return None
    result.fixes = tiny.fixes
    try:
        decoder_cls = decoder_class_for_model_type(model_type)
        decoder = find_decoder(tiny.model, decoder_cls)
    except (PipespecError, LookupError) as exc:
        result.reason = f"no decoder stack found: {exc}"
        return None
    decoder_cls = type(decoder)
    result.decoder_class = decoder_cls.__name__
    result.shape = classify_forward_shape(decoder_cls)
    try:
        adapted = adapt(decoder_cls)
    except PipespecError as exc:
        result.reason = str(exc)
        return None
    except Exception as exc:  # noqa: BLE001 - the codemod crashed on real source: a bug to report
        result.status = ZooStatus.FAILED
        result.reason = f"adapt({decoder_cls.__name__}) crashed: {short_error(exc)}{_where(exc)}"
        return None
    return tiny, decoder, adapted


def _subject(
    result: ZooResult, tiny: TinyModel, decoder: torch.nn.Module, adapted: type, seed: int, decode_steps: int
) -> _Subject | None:
    """The references (prefill, and each decode step) and the adapted template; ``None`` once ``result`` says why not."""
    from pipespec.errors import PipespecError
    from pipespec.integrations.transformers.adapt import cache_kwarg_name

    spec = adapted.pipespec_spec  # type: ignore[attr-defined]
    input_ids = make_input_ids(tiny, seed)
    try:
        reference = run_reference(decoder, spec.layers_attr, spec.norm_attr, input_ids)
    except Exception as exc:  # noqa: BLE001 - the unadapted model cannot run its own forward here
        result.reason = f"the unadapted tiny model's forward fails: {short_error(exc)}"
        return None
    num_layers = len(dotted_get(decoder, spec.layers_attr))
    result.num_layers = num_layers
    _note_hf_conventions(result, reference, num_layers)

    template = _make_adapted_instance(adapted, decoder)
    declared = template.pipespec_num_layers()  # type: ignore[operator]
    if declared != num_layers:
        result.status = ZooStatus.FAILED
        result.reason = f"adapted {adapted.__name__} counts {declared} layers but the stack has {num_layers}"
        return None
    has_residual = bool(getattr(adapted, HAS_RESIDUAL_ATTR, False))
    cache_kwarg = None
    steps: list[tuple[torch.Tensor, Reference]] = []
    if decode_steps > 0:
        try:
            cache_kwarg = cache_kwarg_name(adapted)
        except PipespecError as exc:
            result.reason = f"cannot decode with a per-stage cache: {exc}"
            return None
        try:
            steps = reference_decode(decoder, spec.layers_attr, spec.norm_attr, input_ids, cache_kwarg, decode_steps, seed)
        except Exception as exc:  # noqa: BLE001 - the unadapted model cannot decode here
            result.reason = f"the unadapted tiny model cannot decode with its own cache: {short_error(exc)}"
            return None
    return _Subject(spec, template, input_ids, reference, num_layers, has_residual, cache_kwarg, steps)


def _check_pipelines(result: ZooResult, subject: _Subject, pp_sizes: Sequence[int], decode_steps: int) -> None:
    """Every requested P that fits: verified when all agree, else failed with the first disagreement."""
    num_layers = subject.num_layers
    worst_abs = worst_rel = 0.0
    checked = []
    for pp_size in pp_sizes:
        if pp_size > num_layers:
            result.details.append(f"P={pp_size} skipped: only {num_layers} layers")
            continue
        partition = uneven_partition(num_layers, pp_size)
        aux_ids = zoo_aux_ids(num_layers, partition)
        try:
            problems, abs_err, rel_err = _agreement(subject, pp_size, partition, aux_ids)
        except Exception as exc:  # noqa: BLE001 - crashed after adapting: a bug
            result.status = ZooStatus.FAILED
            result.reason = f"P={pp_size} partition {partition}: stage forward crashed: {short_error(exc)}{_where(exc)}"
            result.max_abs_err = worst_abs if checked else None
            return
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
        checked.append(pp_size)
        if problems:
            result.status = ZooStatus.FAILED
            result.reason = f"P={pp_size} partition {partition} aux ids {aux_ids}: " + "; ".join(problems[:3])
            result.max_abs_err, result.max_rel_err = worst_abs, worst_rel
            result.pp_sizes = tuple(checked)
            return
    if not checked:
        result.reason = f"no requested pipeline size fits {num_layers} layers (asked for P={','.join(map(str, pp_sizes))})"
        return
    result.status = ZooStatus.VERIFIED
    result.pp_sizes = tuple(checked)
    result.max_abs_err, result.max_rel_err = worst_abs, worst_rel
    result.reason = f"{_shown_source(subject.spec.source)}; P={','.join(map(str, checked))}" + (
        f"; prefill + {decode_steps} decode steps with stage caches" if decode_steps else ""
    )


def _agreement(
    subject: _Subject, pp_size: int, partition: Sequence[int], aux_ids: Sequence[int]
) -> tuple[list[str], float, float]:
    """One P: the stages' prefill, then each decode step, against the references: (problems, max abs, max rel).

    A hop or a return the layout plan does not allow is a problem; any other exception propagates (a crash).
    """
    try:
        pipeline = InProcessPipeline(
            lambda: copy.deepcopy(subject.template), pp_size, partition, aux_ids, subject.has_residual, subject.cache_kwarg
        )
        final, aux_list = pipeline.forward(subject.input_ids)
        problems, abs_err, rel_err = compare_stage_outputs(final, aux_list, aux_ids, subject.reference)
        for step, (step_ids, step_ref) in enumerate(subject.steps, start=1):
            if problems:
                break
            final, aux_list = pipeline.forward(step_ids)
            problems, step_abs, step_rel = compare_stage_outputs(final, aux_list, aux_ids, step_ref)
            problems = [f"decode step {step}: {p}" for p in problems]
            abs_err, rel_err = max(abs_err, step_abs), max(rel_err, step_rel)
    except Mismatch as exc:
        return [str(exc)], float("inf"), float("inf")
    return problems, abs_err, rel_err


def _shown_source(source: str) -> str:
    """A spec's source with a path inside the working directory made relative (reports get committed)."""
    if os.path.isabs(source):
        rel = os.path.relpath(source)
        if not rel.startswith(".."):
            return rel
    return source


def _make_adapted_instance(adapted: type, decoder: torch.nn.Module) -> torch.nn.Module:
    """``Adapted(config)`` holding exactly the reference decoder's weights (as the engine loads them)."""
    instance = adapted(decoder.config)
    missing, unexpected = instance.load_state_dict(decoder.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"adapted instance does not take the decoder's weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    instance.eval()
    return instance


def _note_hf_conventions(result: ZooResult, reference: Reference, num_layers: int) -> None:
    hs = reference.hf_hidden_states
    if not hs or len(hs) != num_layers + 1:
        return
    result.hf_hidden_states_match = all(
        L in reference.aux and hs[L].shape == reference.aux[L].shape and torch.equal(hs[L], reference.aux[L])
        for L in range(num_layers)
    )
    result.hf_last_is_post_norm = hs[-1].shape == reference.last_hidden_state.shape and torch.equal(hs[-1], reference.last_hidden_state)
