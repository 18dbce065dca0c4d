"""Build one vLLM model tiny inside vLLM on CPU and check its EAGLE3 aux states numerically.

One process = one PP rank of vLLM's own process groups (gloo on 127.0.0.1, ``init_distributed_environment``
+ ``initialize_model_parallel``), kept alive while the zoo streams models through it
(``pipespec.integrations.vllm.zoo_workers``):

- ``check_pp1``: the model under test (an adapted class, or the installed one) and the unadapted
  reference are built by vLLM (``initialize_model`` under ``set_current_vllm_config``) from the same
  tiny config, with the same seeded weights by parameter name. The model's ``*ForCausalLM`` gets
  ``set_aux_hidden_state_layers(ids)``; the aux states its forward returns must equal the reference's
  residual stream at those ids (forward hooks on the reference's decoder layers: id L < N is what enters
  layer L, ``hidden_states + residual``; id N is the last layer's output before the norm), max abs error
  <= ``ATOL`` in float32. It also checks ``supports_eagle3(model)`` and that the decoder class itself (its
  ``__dict__``) sets ``supports_aux_hidden_states_over_pp = True``.
- ``build`` / ``_forward``: what each rank of a PP=2 or PP=3 run uses to build and run its stage of the
  model under test (``pipespec.integrations.vllm.pp_ranks``, which drives the ranks as vLLM's V2 runner
  does and compares them with ``pipespec.contract.layout.plan_layout`` and the PP=1 reference).

Attention: vLLM's attention backends need the metadata and KV cache its model runner builds; without
them (``set_forward_context(None, ...)``, vLLM's profiling mode) the CPU backend returns the
``torch.empty`` output buffer unwritten. The harness therefore replaces the output of every vLLM
attention layer (``AttentionLayerBase``: attention, MLA, Mamba/linear-attention mixers) with zeros, the
same for the model and the reference, so attention itself is not exercised; embeddings, norms, MLPs/MoE,
the residual stream, the decoder loop and its aux capture/packing are.

Imports vLLM (lives in ``pipespec.integrations.vllm``); nothing outside that package may import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
import tempfile
import types
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from pipespec.contract.names import AUX_OVER_PP_FLAG
from pipespec.integrations.vllm.reference_stream import (
    AuxCheckError,
    aux_of,
    compare_aux,
    layers_of,
    record_stream,
)

__all__ = ["Built", "Job", "build", "check_pp1", "init_rank", "set_model_root", "zoo_ids"]

NUM_TOKENS = 7


@dataclasses.dataclass(frozen=True)
class Job:
    """One decoder to check: where its classes live, what to build, and the adapted source if any."""

    file: str  # path under the vllm package, e.g. "model_executor/models/llama.py"
    module: str  # the installed module, e.g. "vllm.model_executor.models.llama"
    decoder: str  # decoder class name
    causal_lm: str  # the *ForCausalLM class name built
    architecture: str  # registry name that builds ``causal_lm``
    decoder_attr: str = "model"  # attribute of the *ForCausalLM holding the decoder
    code: str | None = None  # adapted module source; None checks the installed module as it is
    #: the module defining ``causal_lm`` when it is not ``module`` (a registered multimodal class in another
    #: file that imports the decoder's holder from ``module``: ernie45_vl around ernie45_vl_moe)
    holder_module: str | None = None


def zoo_ids(num_layers: int, pp_start: int) -> tuple[int, ...]:
    """Ids covering 0, the stage boundary (upstream's last output), one id after it, and N."""
    return tuple(sorted({0, pp_start, min(pp_start + 1, num_layers), num_layers}))


# ------------------------------------------------------------------------------- process setup
def init_rank(world_size: int, rank: int, init_method: str) -> None:
    """Join vLLM's process groups (gloo, CPU) as ``rank`` of ``world_size`` PP ranks (TP = 1)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # vLLM's CPU worker sets VLLM_DIST_IDENT to its group's port so that, once vLLM's C ops are loaded, the
    # ranks of a group share a shared-memory communicator, whose send_tensor_dict carries tensors only. A
    # name of its own per rank makes vLLM fall back to torch.distributed over gloo ("ranks do not share the
    # same SHM group name"), which carries any value (a failed rank's message) and leaves no /dev/shm
    # segment behind a killed worker: the same transport whether or not the C ops are loaded yet.
    os.environ["VLLM_DIST_IDENT"] = f"pipespec-zoo-{os.getpid()}"
    torch.set_num_threads(1)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method=init_method, local_rank=0, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world_size)


_ADAPTED: dict[tuple[str, int], types.ModuleType] = {}


def _adapted_module(job: Job) -> types.ModuleType:
    """Import the adapted source as a sibling of the installed module (package-relative imports work)."""
    assert job.code is not None
    key = (job.module, zlib.crc32(job.code.encode()))
    if key in _ADAPTED:
        return _ADAPTED[key]
    package, _, stem = job.module.rpartition(".")
    name = f"{package}._pipespec_adapted_{stem}_{key[1]:08x}"
    module = types.ModuleType(name)
    module.__package__ = package
    module.__file__ = f"<adapted {job.file}>"
    sys.modules[name] = module
    try:
        with _reregistration(job.module):
            # dont_inherit: this module's `from __future__ import annotations` must not turn the generated
            # annotations into strings (vLLM's @support_torch_compile reads them as types)
            exec(compile(job.code, module.__file__, "exec", dont_inherit=True), module.__dict__)  # noqa: S102
    except BaseException:
        del sys.modules[name]
        raise
    _ADAPTED[key] = module
    return module


@contextlib.contextmanager
def _reregistration(original: str) -> Iterator[None]:
    """Let the adapted copy of ``original`` run its import-time registrations a second time.

    The installed module already registered its ``CustomOp``/``PluggableLayer`` names and its
    ``torch.ops.vllm`` custom ops; run again, vLLM asserts "Duplicate op name". While the copy executes,
    the installed module's ``op_registry`` entries are set aside (and put back after, so every other
    model still gets the installed classes), and a custom op already defined is not defined again (the
    copy's op function is the same source).
    """
    from pipespec.integrations.vllm.compat import current

    release = current()  # both are listed in patches.PATCHES (scope zoo)
    registry = release.custom_op_registry()
    mine = {k: v for k, v in registry.items() if getattr(v, "__module__", None) == original}
    for key in mine:
        del registry[key]

    def once(register: Any) -> Any:
        def register_once(op_name: str, *args: Any, **kwargs: Any) -> None:
            if hasattr(torch.ops.vllm, op_name):
                return
            register(op_name, *args, **kwargs)

        return register_once

    try:
        with release.custom_op_registration(once):
            yield
    finally:
        registry.update(mine)


def _classes(job: Job) -> tuple[type, type]:
    """(class under test, unadapted reference class) of ``job``'s ``*ForCausalLM``."""
    original = importlib.import_module(job.holder_module or job.module)
    reference = getattr(original, job.causal_lm)
    if job.code is None:
        return reference, reference
    adapted = _adapted_module(job)
    if job.holder_module is None:
        return getattr(adapted, job.causal_lm), reference
    return getattr(_rebound_holder(job, adapted), job.causal_lm), reference


_HOLDERS: dict[tuple[str, int], types.ModuleType] = {}


def _rebound_holder(job: Job, adapted: types.ModuleType) -> types.ModuleType:
    """A copy of the installed ``job.holder_module`` whose names imported from ``job.module`` are the
    adapted module's classes (its code looks them up as globals when it builds the language model)."""
    assert job.holder_module is not None and job.code is not None
    key = (job.holder_module, zlib.crc32(job.code.encode()))
    if key in _HOLDERS:
        return _HOLDERS[key]
    installed_holder = importlib.import_module(job.holder_module)
    installed = importlib.import_module(job.module)
    path = inspect.getsourcefile(installed_holder)
    if path is None:
        raise RuntimeError(f"{job.holder_module} has no source file to copy")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    package, _, stem = job.holder_module.rpartition(".")
    name = f"{package}._pipespec_holder_{stem}_{key[1]:08x}"
    module = types.ModuleType(name)
    module.__package__ = package
    module.__file__ = path
    sys.modules[name] = module
    try:
        with _reregistration(job.holder_module):
            exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)  # noqa: S102
    except BaseException:
        del sys.modules[name]
        raise
    rebound = [k for k, v in module.__dict__.items()
               if isinstance(v, type) and getattr(installed, k, None) is v and hasattr(adapted, k)]
    if not rebound:
        raise RuntimeError(f"{job.holder_module} imports no class of {job.module}: it cannot hold the adapted decoder")
    for k in rebound:
        setattr(module, k, getattr(adapted, k))
    _HOLDERS[key] = module
    return module


# ------------------------------------------------------------------------------------ building
_MODEL_DIRS: dict[str, str] = {}
#: Where this process writes its tiny model directories (``set_model_root``).
_MODEL_ROOT: list[str | None] = [None]


def set_model_root(path: str) -> None:
    """Write this process's tiny model directories under ``path`` (a zoo worker: the pool's temp dir,
    which the parent removes)."""
    _MODEL_ROOT[0] = path


def _model_dir(job: Job) -> str:
    from pipespec.integrations.vllm.tiny import tiny_vllm_config, write_model_dir

    if job.architecture not in _MODEL_DIRS:
        stem = os.path.splitext(os.path.basename(job.file))[0]
        config, _ = tiny_vllm_config(job.architecture, stem)
        _MODEL_DIRS[job.architecture] = write_model_dir(
            config, tempfile.mkdtemp(prefix=f"{job.architecture}-", dir=_MODEL_ROOT[0]))
    return _MODEL_DIRS[job.architecture]


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    vllm_config: Any
    decoder: torch.nn.Module


_REGISTERED: set[str] = set()


def _register(job: Job) -> None:
    """Register the installed class under its architecture in this worker's registry, so that
    ``ModelConfig`` inspects it in-process (the lazy entry inspects it in a subprocess, ~8 s each)."""
    from vllm.model_executor.models.registry import ModelRegistry

    if job.architecture not in _REGISTERED:
        holder = importlib.import_module(job.holder_module or job.module)
        ModelRegistry.register_model(job.architecture, getattr(holder, job.causal_lm))
        _REGISTERED.add(job.architecture)


def _vllm_config_for(job: Job) -> Any:
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    from pipespec.integrations.vllm.tiny import TOWERS_BUILT

    model_config = ModelConfig(
        model=_model_dir(job), dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0,
        trust_remote_code=False,
        # vLLM's own text-only mode: a multimodal model's vision/audio towers are not built (the aux
        # states come from its language model alone), so a tower sized in code stays off the heap
        language_model_only=job.architecture not in TOWERS_BUILT,
    )
    return VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format="dummy"),
        attention_config=_attention_config(),
    )


def _attention_config() -> Any:
    """vLLM's reference CPU MLA backend for latent-attention layers, on every machine.

    Where the CPU has AMX tiles vLLM's CPU platform picks ``AMX_MLA`` unless ``CPU_MLA`` is asked for, and
    AMX_MLA's weight packing (``convert_weight_packed`` after loading) refuses the tiny heads' 8-16 input
    features ("invalid weight input features 16", every MLA model, measured on an AMX host); asked for,
    CPU_MLA builds them. The attention output is zeroed either way (``_silence_attention``), so the choice
    changes nothing the check compares; it makes the zoo the same with and without AMX.
    """
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    mla = AttentionBackendEnum.CPU_MLA
    return AttentionConfig(backend_per_kind={"mla_attention": mla, "sliding_window_mla": mla})


def build(cls: type, job: Job) -> Built:
    """``cls`` built by vLLM from the tiny config, seeded weights, vLLM's post-load processing."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    _register(job)

    vllm_config = _vllm_config_for(job)
    model_config = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        model = initialize_model(vllm_config, model_class=cls)
        _fill_weights(model)
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    model.eval()
    _silence_attention(model)
    return Built(model=model, vllm_config=vllm_config, decoder=_decoder_of(model, job))


def _decoder_of(model: torch.nn.Module, job: Job) -> torch.nn.Module:
    """The decoder stack inside ``model``: the submodule of class ``job.decoder`` (it may sit deeper
    than one attribute: OPTForCausalLM.model.decoder), else ``model.<decoder_attr>``."""
    if job.decoder:
        for module in model.modules():
            if type(module).__name__ == job.decoder:
                return module
    decoder = getattr(model, job.decoder_attr, None)
    if not isinstance(decoder, torch.nn.Module):
        raise RuntimeError(f"{job.causal_lm} builds no {job.decoder or job.decoder_attr} module")
    return decoder


def _fill_weights(model: torch.nn.Module) -> None:
    """Every floating parameter from a generator seeded by its name: same values in every build."""
    gen = torch.Generator()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point() or param.numel() == 0:
                continue
            gen.manual_seed(zlib.crc32(name.encode()))
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if param.dim() == 1 and "norm" in name and leaf == "weight":
                values = 1.0 + 0.1 * values
            else:
                values = 0.05 * values
            param.copy_(values.to(param.dtype))


def _silence_attention(model: torch.nn.Module) -> None:
    """Zero every vLLM attention layer's output (see the module docstring: no runner metadata)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    def zero(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = {}
        buffer = bound.get("output")
        if isinstance(buffer, torch.Tensor):
            buffer.zero_()
        return _zeros_like(out)

    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    for module in model.modules():
        if isinstance(module, AttentionLayerBase):
            if "output" in inspect.signature(module.forward).parameters:
                # a mixer that writes into the caller's buffer (Mamba-1) is not run at all: its result
                # would be zeroed, and vLLM's own no-metadata path for it cannot run on CPU (it hands
                # out_proj a transposed view; the CPU build's oneDNN GEMM needs stride(-1) == 1)
                module.forward = types.MethodType(_zero_output_buffer, module)
            elif isinstance(module, MambaMixer2):
                # nor is a Mamba-2 mixer: without metadata vLLM warms up its SSD kernels, which empties an
                # accelerator cache (RuntimeError on CPU); its output has the stream's shape
                module.forward = types.MethodType(_zero_stream, module)
            else:
                module.register_forward_hook(zero, with_kwargs=True)


def _zero_stream(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros_like(hidden_states)


def _zero_output_buffer(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs).arguments
    buffer = bound["output"]
    if not isinstance(buffer, torch.Tensor):
        raise RuntimeError(f"{type(self).__name__}.forward got output={type(buffer).__name__}, not a buffer")
    buffer.zero_()


def _zeros_like(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return torch.zeros_like(out)
    if isinstance(out, tuple):
        return tuple(_zeros_like(o) for o in out)
    return out


# ------------------------------------------------------------------------------------ running
def _inputs(built: Built) -> tuple[torch.Tensor, torch.Tensor]:
    config = built.vllm_config.model_config.hf_config
    vocab = int(getattr(config.get_text_config(), "vocab_size", 128) or 128)
    ids = (torch.arange(NUM_TOKENS) * 37 + 3) % min(vocab, 128)
    positions = torch.arange(NUM_TOKENS)
    if built.vllm_config.model_config.uses_mrope:
        positions = positions.expand(3, NUM_TOKENS).contiguous()
    return ids, positions


def _forward(built: Built, intermediate: Any | None = None, with_input_ids: bool = True) -> Any:
    """One forward on the zoo input; ``with_input_ids=False`` passes ``input_ids=None``, as vLLM's V2 runner
    does on every rank but the first."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    input_ids, positions = _inputs(built)
    with torch.no_grad(), set_current_vllm_config(built.vllm_config), set_forward_context(
        None, built.vllm_config, num_tokens=NUM_TOKENS
    ):
        return built.model(input_ids=input_ids if with_input_ids else None, positions=positions,
                           intermediate_tensors=intermediate)


def check_pp1(job: Job) -> dict[str, Any]:
    """PP=1: aux states of the model under test == the reference residual stream at the zoo ids.

    Returns ``{"max_abs_err", "num_layers", "ids", "reference": {id: ndarray for every id 0..N}}``; a failed
    check raises ``AuxCheckError`` saying which id differs and by how much.
    """
    from vllm.model_executor.models.interfaces import supports_eagle3

    tested_cls, reference_cls = _classes(job)
    ref = build(reference_cls, job)
    n = len(layers_of(ref.decoder))
    ids = tuple(range(n + 1))
    with record_stream(ref.decoder, ids) as stream:
        _forward(ref)
    missing = [i for i in ids if i not in stream]
    if missing:
        raise AuxCheckError(f"reference hooks saw no residual stream at ids {missing}")
    from vllm.distributed.utils import get_pp_indices

    check_ids = zoo_ids(n, get_pp_indices(n, 1, 2)[0])
    result: dict[str, Any] = {
        "num_layers": n, "ids": list(check_ids), "reference": {i: stream[i].numpy() for i in ids},
    }
    tested = build(tested_cls, job)
    setter = getattr(tested.model, "set_aux_hidden_state_layers", None)
    if callable(setter):
        setter(check_ids)
    what = f"{job.causal_lm} at PP=1" + ("" if callable(setter) else " (it has no set_aux_hidden_state_layers)")
    got = aux_of(_forward(tested), what)
    result["max_abs_err"] = compare_aux(got, stream, check_ids, "PP=1")
    if not supports_eagle3(tested.model):
        raise AuxCheckError(f"supports_eagle3({job.causal_lm}) is False: vLLM refuses EAGLE3 for it")
    decoder_cls = type(tested.decoder)
    if decoder_cls.__dict__.get(AUX_OVER_PP_FLAG) is not True:
        raise AuxCheckError(f"{decoder_cls.__name__} does not set {AUX_OVER_PP_FLAG} = True on itself")
    return result
