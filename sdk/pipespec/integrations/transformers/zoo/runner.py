"""Run the zoo: for each causal-LM type, build a tiny model, adapt its decoder, run it as P stages, compare.

For one model type and one pipeline size P the check is:

1. the **reference** — the tiny model's own decoder, run once in float32 with
   ``output_hidden_states=True``; forward pre-hooks on every decoder layer record what enters it (aux id
   L, by the contract's definition) and a pre-hook on the final norm records what leaves the last layer
   (id N, pre-norm; HF's last ``hidden_states`` entry is post-norm in most models);
2. the **stages** — ``pipespec.adapt(<decoder class>)`` instantiated once per stage with the reference's
   weights, configured with ``set_pipeline_stage(rank, P, partition)`` (uneven for P ≥ 2) and aux ids that
   include 0, every stage boundary and N; stage 0 takes ``input_ids``, every later stage only the
   ``IntermediateTensors`` the previous one returned (copied, as a transport would), whose keys must be
   exactly the hop's keys of the layout plan;
3. the **comparison** — the last stage's final hidden state against the reference's
   ``last_hidden_state``, and every aux state against the reference capture of its id; relative error
   (max |a - b| / max |b|) at most ``REL_TOL``.

Status: ``verified`` (every P agreed), ``declined`` (with the specific reason: the tiny model cannot be
built, or the adaptation refuses the forward's shape), ``failed`` (the adaptation ran but disagreed, or
crashed after adapting: a bug). One type's exception never stops the run.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import eagle3_default_aux_ids, plan_layout
from pipespec.contract.mixin import hop_keys
from pipespec.integrations.transformers.zoo.tiny import (
    VOCAB,
    TinyBuildError,
    TinyModel,
    build_tiny_model,
    causal_lm_model_types,
)

__all__ = [
    "REL_TOL",
    "SHAPES",
    "Reference",
    "ZooResult",
    "classify_forward_shape",
    "compare_stage_outputs",
    "run_type",
    "run_zoo",
    "uneven_partition",
    "zoo_aux_ids",
]

REL_TOL = 1e-5
STATUSES = ("verified", "declined", "failed")
BATCH, SEQ = 2, 8

#: Forward-shape classes for the coverage table, in display order.
SHAPES = {
    "llama": "exact Llama loop",
    "llama-like": "Llama-like variant",
    "gpt2": "GPT2-style `self.h`",
    "bart-opt": "Bart/OPT-style decoder",
    "bert": "BERT-style encoder stack",
    "ssm": "SSM / recurrent",
    "other": "other",
}


@dataclass
class ZooResult:
    """The outcome for one model type; ``to_json`` is the DESIGN.md contract of ``pipespec zoo --json``."""

    model_type: str
    status: str
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

    def to_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "status": self.status, "reason": self.reason, "max_abs_err": self.max_abs_err}


@dataclass
class Reference:
    """What the unadapted decoder computes: final hidden, and the value of every aux id 0..N."""

    last_hidden_state: torch.Tensor
    aux: dict[int, torch.Tensor]  # id -> tensor (id N = pre-norm output of the last layer)
    hf_hidden_states: tuple[torch.Tensor, ...] | None
    cache: Any = None  # the model's own cache after this forward (decode steps continue from it)


# ------------------------------------------------------------------------------- layout choices
def uneven_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layer counts growing with the rank (1 : 2 : ... : P), every stage at least one layer.

    Uneven on purpose: vLLM only tested even splits, and off-by-one bugs hide in uneven ones.

    >>> uneven_partition(6, 3), uneven_partition(6, 2), uneven_partition(6, 1)
    ([1, 2, 3], [2, 4], [6])
    """
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {pp_size} stages")
    total = pp_size * (pp_size + 1) // 2
    counts = [max(1, (num_layers * (r + 1)) // total) for r in range(pp_size)]
    r = pp_size - 1
    while sum(counts) < num_layers:
        counts[r] += 1
        r = r - 1 if r > 0 else pp_size - 1
    while sum(counts) > num_layers:
        r = max(range(pp_size), key=lambda i: counts[i])
        counts[r] -= 1
    return counts


def zoo_aux_ids(num_layers: int, partition: Sequence[int]) -> list[int]:
    """0, N, every stage boundary (ids that belong to the upstream stage) and EAGLE3's defaults."""
    ids = {0, num_layers, *eagle3_default_aux_ids(num_layers)}
    bound = 0
    for count in partition[:-1]:
        bound += count
        ids.add(bound)
    return sorted(ids)


# ------------------------------------------------------------------------------- comparison
def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative error = max abs error / max |expected|)."""
    if actual.shape != expected.shape:
        raise _Mismatch(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    diff = (actual.detach().float() - expected.detach().float()).abs().max().item()
    scale = expected.detach().float().abs().max().item()
    return diff, diff / max(scale, 1e-12)


class _Mismatch(Exception):
    pass


def compare_stage_outputs(
    final_hidden: torch.Tensor,
    aux_list: Sequence[torch.Tensor],
    aux_ids: Sequence[int],
    reference: Reference,
    rel_tol: float = REL_TOL,
) -> tuple[list[str], float, float]:
    """Compare what the last stage returned with the reference.

    Returns (problems, max abs error, max relative error); no problems means the stages agree.
    ``aux_list[i]`` must be the state of ``aux_ids[i]``.
    """
    problems: list[str] = []
    worst_abs = worst_rel = 0.0

    def check(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        nonlocal worst_abs, worst_rel
        try:
            abs_err, rel = _rel_err(actual, expected)
        except _Mismatch as exc:
            problems.append(f"{what}: {exc}")
            worst_abs = worst_rel = float("inf")
            return
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
        if not rel <= rel_tol:  # also catches NaN
            problems.append(f"{what}: relative error {rel:.3g} > {rel_tol:g} (max abs {abs_err:.3g})")

    check("final hidden state", final_hidden, reference.last_hidden_state)
    if len(aux_list) != len(aux_ids):
        problems.append(f"{len(aux_list)} aux states returned for ids {list(aux_ids)}")
    for layer_id, actual in zip(aux_ids, aux_list):
        expected = reference.aux.get(layer_id)
        if expected is None:
            problems.append(f"aux id {layer_id}: no reference value captured")
            continue
        check(f"aux id {layer_id}", actual, expected)
    return problems, worst_abs, worst_rel


# ------------------------------------------------------------------------------- model plumbing
def _dotted_get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def find_decoder(lm: torch.nn.Module, decoder_cls: type) -> torch.nn.Module:
    """The decoder-stack module inside a causal LM: the instance of ``decoder_cls``; for a multimodal
    wrapper (``Gemma3Model``), its ``language_model`` — the text decoder whose states a draft reads."""
    found = next((m for m in lm.modules() if type(m) is decoder_cls), None)
    if found is None:
        found = next((m for m in lm.modules() if isinstance(m, decoder_cls)), None)
    if found is None:
        raise LookupError(f"{type(lm).__name__} holds no {decoder_cls.__name__} module")
    inner = getattr(found, "language_model", None)
    if isinstance(inner, torch.nn.Module) and inner is not found:
        return inner
    return found


def _forward_params(module: torch.nn.Module) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}


def _call_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    """``use_cache=False`` / ``output_hidden_states=True`` where the forward takes them (or ``**kwargs``)."""
    params = _forward_params(module)
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out: dict[str, Any] = {}
    for name, value in (("use_cache", False), ("return_dict", True)):
        if name in params or has_var_kw:
            out[name] = value
    return out


def make_input_ids(tiny: TinyModel, seed: int = 0) -> torch.Tensor:
    """Random token ids (special ids 0..2 avoided); musicgen-style decoders take one row per codebook."""
    gen = torch.Generator().manual_seed(seed)
    config = getattr(tiny.model, "config", tiny.config)
    rows = BATCH * int(getattr(config, "num_codebooks", 1) or 1) if hasattr(config, "num_codebooks") else BATCH
    vocab = int(getattr(config, "vocab_size", VOCAB) or VOCAB)
    return torch.randint(3, max(4, vocab), (rows, SEQ), generator=gen)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def run_reference(
    decoder: torch.nn.Module, layers_attr: str, norm_attr: str | None, input_ids: torch.Tensor, **call_kwargs: Any
) -> Reference:
    """Run the unadapted decoder once, recording every aux id by hooks (see the module docstring).

    ``call_kwargs`` override the defaults (``use_cache=False``): decode steps pass ``use_cache=True`` and
    the previous step's cache.
    """
    layers = list(_dotted_get(decoder, layers_attr))
    n = len(layers)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def pre_hook(idx: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            value = args[0] if args else kwargs.get("hidden_states")
            if isinstance(value, torch.Tensor) and idx not in captured:
                captured[idx] = value.detach().clone()

        return hook

    def last_out_hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        value = _first_tensor(output)
        if value is not None and n not in captured:
            captured[-1] = value.detach().clone()  # fallback for id N when there is no norm to hook

    def norm_hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        value = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
        if isinstance(value, torch.Tensor):
            captured[n] = value.detach().clone()

    for idx, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(idx), with_kwargs=True))
    handles.append(layers[-1].register_forward_hook(last_out_hook))
    norm = None
    if norm_attr:
        try:
            norm = _dotted_get(decoder, norm_attr)
        except AttributeError:
            norm = None
    if isinstance(norm, torch.nn.Module):
        handles.append(norm.register_forward_pre_hook(norm_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = decoder(input_ids=input_ids, output_hidden_states=True, **(_call_kwargs(decoder) | call_kwargs))
    finally:
        for h in handles:
            h.remove()
    if n not in captured and -1 in captured:
        captured[n] = captured[-1]
    captured.pop(-1, None)
    last = getattr(out, "last_hidden_state", None)
    if last is None:
        last = _first_tensor(out)
    if last is None:
        raise RuntimeError(f"reference forward returned {type(out).__name__} without a last hidden state")
    hs = getattr(out, "hidden_states", None)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return Reference(last_hidden_state=last.detach(), aux=captured, hf_hidden_states=tuple(hs) if hs else None, cache=cache)


def _transport(tensors: Mapping[str, torch.Tensor]) -> IntermediateTensors:
    """What a real hop delivers: fresh tensors with the same values, no shared storage or autograd."""
    return IntermediateTensors({k: v.detach().clone() for k, v in tensors.items()})


class InProcessPipeline:
    """An adapted decoder as ``pp_size`` stage instances in one process, handing tensors across.

    Each stage is its own instance (built by ``make_stage``), configured as the engine configures a stage
    process; with ``cache_kwarg`` each also gets its own ``pipespec.integrations.transformers.stage_cache`` cache, so successive
    ``forward`` calls are prefill then decode steps. Every hop is checked against the layout plan: a
    non-last stage must return ``IntermediateTensors`` with exactly the hop's keys.
    """

    def __init__(
        self,
        make_stage: Callable[[], torch.nn.Module],
        pp_size: int,
        partition: Sequence[int],
        aux_ids: Sequence[int],
        has_residual: bool = False,
        cache_kwarg: str | None = None,
    ) -> None:
        self.plan = plan_layout(sum(partition), pp_size, aux_layers=aux_ids, partition=partition)
        self.pp_size = pp_size
        self.has_residual = has_residual
        self.cache_kwarg = cache_kwarg
        self.stages: list[torch.nn.Module] = []
        self.caches: list[Any] = []
        for rank in range(pp_size):
            stage = make_stage()
            stage.set_pipeline_stage(rank, pp_size, list(partition))  # type: ignore[operator]
            stage.set_aux_hidden_state_layers(aux_ids)  # type: ignore[operator]
            self.stages.append(stage)
            if cache_kwarg is not None:
                from pipespec.integrations.transformers.stage_cache import new_stage_cache

                self.caches.append(new_stage_cache(stage))

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every stage on ``input_ids``; return the last stage's (final hidden, aux list)."""
        received: IntermediateTensors | None = None
        out: Any = None
        for rank, stage in enumerate(self.stages):
            kwargs = _call_kwargs(stage)
            if self.cache_kwarg is not None:
                kwargs.update({"use_cache": True, self.cache_kwarg: self.caches[rank]})
            with torch.no_grad():
                out = stage(input_ids=input_ids if rank == 0 else None, intermediate_tensors=received, **kwargs)
            if rank < self.pp_size - 1:
                if not isinstance(out, IntermediateTensors):
                    raise _Mismatch(f"stage {rank} of {self.pp_size} returned {type(out).__name__}, not IntermediateTensors")
                expected = set(hop_keys(self.plan.stage(rank), self.has_residual))
                if set(out.keys()) != expected:
                    raise _Mismatch(
                        f"stage {rank} of {self.pp_size} sent keys {sorted(out.keys())}, the layout plan says {sorted(expected)}"
                    )
                received = _transport(out)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple))):
            raise _Mismatch(f"last stage returned {type(out).__name__}, not (output, aux_list)")
        output, aux_list = out
        final = getattr(output, "last_hidden_state", None)
        if final is None:
            final = _first_tensor(output)
        if final is None:
            raise _Mismatch(f"last stage output {type(output).__name__} has no last hidden state")
        return final, list(aux_list)


def run_stages(
    make_stage: Callable[[], torch.nn.Module],
    input_ids: torch.Tensor,
    pp_size: int,
    partition: Sequence[int],
    aux_ids: Sequence[int],
    has_residual: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward (no cache) of an adapted decoder as ``pp_size`` in-process stages: (final hidden, aux list)."""
    return InProcessPipeline(make_stage, pp_size, partition, aux_ids, has_residual).forward(input_ids)


# ------------------------------------------------------------------------------- forward shapes
_SSM_LAYER_WORDS = ("Mamba", "Rwkv", "xLSTM", "Recurrent", "XLNet")


def classify_forward_shape(decoder_cls: type) -> str:
    """Which family of forward the decoder class has (a key of ``SHAPES``), read from its source.

    A label for the coverage table only (the adaptation does its own, stricter analysis): Python's
    ``ast`` is enough here and ten times faster than a libcst parse, which matters over 196 types.
    """
    from pipespec.integrations.transformers.infer import forward_owner

    try:
        owner = forward_owner(decoder_cls)
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
    except Exception:  # noqa: BLE001 - no source or no forward: nothing to classify
        return "other"
    cls_node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == owner.__name__), None)
    func = None
    if cls_node is not None:
        func = next((n for n in cls_node.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if func is None:
        return "other"
    params = {a.arg for a in func.args.args + func.args.kwonlyargs}
    loops: list[tuple[str, ast.For]] = []
    for node in ast.walk(func):
        if isinstance(node, ast.For):
            it = node.iter
            while isinstance(it, ast.Call) and it.args:  # enumerate(...), islice(...), zip(...)
                it = it.args[0]
            if isinstance(it, ast.Subscript):
                it = it.value
            name = ast.unparse(it)
            if name.startswith("self."):
                loops.append((name[len("self."):], node))
    calls = {ast.unparse(n.func) for n in ast.walk(func) if isinstance(n, ast.Call)}
    body = ast.unparse(func)
    if "cache_params" in params or any(w in decoder_cls.__name__ for w in _SSM_LAYER_WORDS):
        return "ssm"
    attrs = [a for a, _ in loops]
    if "h" in attrs:
        return "gpt2"
    if "self.encoder" in calls or "layer" in attrs:
        return "bert"
    if "self.decoder" in calls:
        return "bart-opt"  # OPTModel & co.: a wrapper whose forward runs a Bart/OPT-style decoder
    layer_loops = [(a, loop) for a, loop in loops if a == "layers" or a.endswith(".layers")]
    if not layer_loops:
        return "other"
    if "encoder_hidden_states" in params or "self.embed_positions" in body or decoder_cls.__name__.endswith("Decoder"):
        return "bart-opt"
    for _attr, loop in layer_loops:
        if isinstance(loop.target, ast.Name) and ast.unparse(loop.iter) == "self.layers[:self.config.num_hidden_layers]":
            return "llama"
    return "llama-like"


# ------------------------------------------------------------------------------- one type
def _short(exc: BaseException) -> str:
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
    result = ZooResult(model_type=model_type, status="declined")
    try:
        _run_type(result, pp_sizes, seed, decode_steps)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one type must never kill the run
        result.status = "failed"
        result.reason = f"zoo runner error: {_short(exc)}{_where(exc)}"
    result.seconds = time.perf_counter() - start
    return result


def _run_type(result: ZooResult, pp_sizes: Sequence[int], seed: int, decode_steps: int) -> None:
    from pipespec.errors import PipespecError
    from pipespec.integrations.transformers.adapt import adapt, cache_kwarg_name
    from pipespec.integrations.transformers.infer import decoder_class_for_model_type

    model_type = result.model_type
    try:
        tiny = build_tiny_model(model_type, seed=seed)
    except TinyBuildError as exc:
        result.reason = f"could not build tiny model: {exc}"
        return
    result.fixes = tiny.fixes
    try:
        decoder_cls = decoder_class_for_model_type(model_type)
        decoder = find_decoder(tiny.model, decoder_cls)
    except (PipespecError, LookupError) as exc:
        result.reason = f"no decoder stack found: {exc}"
        return
    decoder_cls = type(decoder)
    result.decoder_class = decoder_cls.__name__
    result.shape = classify_forward_shape(decoder_cls)
    try:
        adapted = adapt(decoder_cls)
    except PipespecError as exc:
        result.reason = str(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the codemod crashed on real source: a bug to report
        result.status = "failed"
        result.reason = f"adapt({decoder_cls.__name__}) crashed: {_short(exc)}{_where(exc)}"
        return

    spec = adapted.pipespec_spec  # type: ignore[attr-defined]
    input_ids = make_input_ids(tiny, seed)
    try:
        reference = run_reference(decoder, spec.layers_attr, spec.norm_attr, input_ids)
    except Exception as exc:  # noqa: BLE001 - the unadapted model cannot run its own forward here
        result.reason = f"the unadapted tiny model's forward fails: {_short(exc)}"
        return
    num_layers = len(_dotted_get(decoder, spec.layers_attr))
    result.num_layers = num_layers
    _note_hf_conventions(result, reference, num_layers)

    template = _make_adapted_instance(adapted, decoder)
    declared = template.pipespec_num_layers()  # type: ignore[operator]
    if declared != num_layers:
        result.status = "failed"
        result.reason = f"adapted {adapted.__name__} counts {declared} layers but the stack has {num_layers}"
        return
    has_residual = bool(getattr(adapted, "pipespec_has_residual", False))
    cache_kwarg = None
    steps: list[tuple[torch.Tensor, Reference]] = []
    if decode_steps > 0:
        try:
            cache_kwarg = cache_kwarg_name(adapted)
        except PipespecError as exc:
            result.reason = f"cannot decode with a per-stage cache: {exc}"
            return
        try:
            steps = _reference_decode(decoder, spec.layers_attr, spec.norm_attr, input_ids, cache_kwarg, decode_steps, seed)
        except Exception as exc:  # noqa: BLE001 - the unadapted model cannot decode here
            result.reason = f"the unadapted tiny model cannot decode with its own cache: {_short(exc)}"
            return
    worst_abs = worst_rel = 0.0
    checked = []
    for pp_size in pp_sizes:
        if pp_size > num_layers:
            result.details.append(f"P={pp_size} skipped: only {num_layers} layers")
            continue
        partition = uneven_partition(num_layers, pp_size)
        aux_ids = zoo_aux_ids(num_layers, partition)
        try:
            pipeline = InProcessPipeline(lambda: copy.deepcopy(template), pp_size, partition, aux_ids, has_residual, cache_kwarg)
            final, aux_list = pipeline.forward(input_ids)
            problems, abs_err, rel_err = compare_stage_outputs(final, aux_list, aux_ids, reference)
            for step, (step_ids, step_ref) in enumerate(steps, start=1):
                if problems:
                    break
                final, aux_list = pipeline.forward(step_ids)
                problems, step_abs, step_rel = compare_stage_outputs(final, aux_list, aux_ids, step_ref)
                problems = [f"decode step {step}: {p}" for p in problems]
                abs_err, rel_err = max(abs_err, step_abs), max(rel_err, step_rel)
        except _Mismatch as exc:
            problems, abs_err, rel_err = [str(exc)], float("inf"), float("inf")
        except Exception as exc:  # noqa: BLE001 - crashed after adapting: a bug
            result.status = "failed"
            result.reason = f"P={pp_size} partition {partition}: stage forward crashed: {_short(exc)}{_where(exc)}"
            result.max_abs_err = worst_abs if checked else None
            return
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
        checked.append(pp_size)
        if problems:
            result.status = "failed"
            result.reason = f"P={pp_size} partition {partition} aux ids {aux_ids}: " + "; ".join(problems[:3])
            result.max_abs_err, result.max_rel_err = worst_abs, worst_rel
            result.pp_sizes = tuple(checked)
            return
    if not checked:
        result.reason = f"no requested pipeline size fits {num_layers} layers (asked for P={','.join(map(str, pp_sizes))})"
        return
    result.status = "verified"
    result.pp_sizes = tuple(checked)
    result.max_abs_err, result.max_rel_err = worst_abs, worst_rel
    result.reason = f"{_shown_source(spec.source)}; P={','.join(map(str, checked))}" + (
        f"; prefill + {decode_steps} decode steps with stage caches" if decode_steps else ""
    )


def _reference_decode(
    decoder: torch.nn.Module, layers_attr: str, norm_attr: str | None, input_ids: torch.Tensor, cache_kwarg: str,
    decode_steps: int, seed: int,
) -> list[tuple[torch.Tensor, Reference]]:
    """The unadapted decoder's prefill then ``decode_steps`` one-token steps with its own cache:
    [(step input ids, reference of that step)]."""
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = int(getattr(decoder.config, "vocab_size", VOCAB) or VOCAB)
    previous = run_reference(decoder, layers_attr, norm_attr, input_ids, use_cache=True)
    out = []
    for _ in range(decode_steps):
        if previous.cache is None:
            raise RuntimeError("the forward returned no cache with use_cache=True")
        step_ids = torch.randint(3, max(4, vocab), (input_ids.shape[0], 1), generator=gen)
        previous = run_reference(decoder, layers_attr, norm_attr, step_ids, use_cache=True, **{cache_kwarg: previous.cache})
        out.append((step_ids, previous))
    return out


def _shown_source(source: str) -> str:
    """A spec's source with a path inside the working directory made relative (reports get committed)."""
    import os

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


# ------------------------------------------------------------------------------- the whole zoo
def run_zoo(
    model_types: Iterable[str] | None = None,
    pp_sizes: Sequence[int] = (1, 2, 3),
    progress: Callable[[int, int, ZooResult], None] | None = None,
    jobs: int = 1,
    decode_steps: int = 0,
) -> list[ZooResult]:
    """Run ``run_type`` over ``model_types`` (default: every causal-LM type installed); results in order.

    ``jobs > 1`` spreads the types over that many worker processes (spawned, one torch thread each);
    each worker pays the imports once.
    """
    types = list(model_types) if model_types is not None else causal_lm_model_types()
    if jobs > 1 and len(types) > 1:
        return _run_parallel(types, tuple(pp_sizes), progress, min(jobs, len(types)), decode_steps)
    results = []
    threads = torch.get_num_threads()
    # Tiny tensors: one thread is fastest, and it keeps the zoo from fighting other processes for cores.
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for i, model_type in enumerate(types):
                result = run_type(model_type, pp_sizes, decode_steps=decode_steps)
                results.append(result)
                if progress is not None:
                    progress(i + 1, len(types), result)
    finally:
        torch.set_num_threads(threads)
    return results


def _worker_init() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)


def _run_parallel(
    types: list[str], pp_sizes: tuple[int, ...], progress: Callable[[int, int, ZooResult], None] | None, jobs: int,
    decode_steps: int,
) -> list[ZooResult]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: dict[int, ZooResult] = {}
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
    try:
        futures = {pool.submit(run_type, t, pp_sizes, 0, decode_steps): i for i, t in enumerate(types)}
        for done, future in enumerate(as_completed(futures), start=1):
            i = futures[future]
            try:
                results[i] = future.result()
            except Exception as exc:  # noqa: BLE001 - a worker died (e.g. killed for memory): that type failed
                results[i] = ZooResult(model_type=types[i], status="failed", reason=f"zoo worker died: {_short(exc)}")
            if progress is not None:
                progress(done, len(types), results[i])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [results[i] for i in range(len(types))]
