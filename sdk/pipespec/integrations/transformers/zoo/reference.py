"""The zoo's reference: what the unadapted decoder computes, every aux id recorded by hooks.

Forward pre-hooks on every decoder layer record what enters it (aux id L, by the contract's
definition) and a pre-hook on the final norm records what leaves the last layer (id N, pre-norm; HF's
last ``hidden_states`` entry is post-norm in most models). Also the plumbing every check shares: the
decoder inside a causal LM, the random input ids, the keyword arguments a forward takes.

Runs the model as transformers built it; imports nothing of pipespec's adaptation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pipespec.integrations.transformers.adapt import returned_cache
from pipespec.integrations.transformers.zoo.sizes import VOCAB
from pipespec.integrations.transformers.zoo.tiny import TinyModel

__all__ = [
    "BATCH",
    "SEQ",
    "Reference",
    "dotted_get",
    "find_decoder",
    "first_tensor",
    "forward_kwargs",
    "make_input_ids",
    "reference_decode",
    "run_reference",
]

BATCH, SEQ = 2, 8


@dataclass
class Reference:
    """What the unadapted decoder computes: final hidden, and the value of every aux id 0..N."""

    last_hidden_state: torch.Tensor
    aux: dict[int, torch.Tensor]  # id -> tensor (id N = pre-norm output of the last layer)
    hf_hidden_states: tuple[torch.Tensor, ...] | None
    cache: Any = None  # the model's own cache after this forward (decode steps continue from it)


def dotted_get(obj: Any, dotted: str) -> Any:
    """``dotted_get(decoder, "model.layers")`` is ``decoder.model.layers``."""
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


def forward_kwargs(module: torch.nn.Module) -> dict[str, Any]:
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


def first_tensor(value: Any) -> torch.Tensor | None:
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
    layers = list(dotted_get(decoder, layers_attr))
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
        value = first_tensor(output)
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
            norm = dotted_get(decoder, norm_attr)
        except AttributeError:
            norm = None
    if isinstance(norm, torch.nn.Module):
        handles.append(norm.register_forward_pre_hook(norm_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = decoder(input_ids=input_ids, output_hidden_states=True, **(forward_kwargs(decoder) | call_kwargs))
    finally:
        for h in handles:
            h.remove()
    if n not in captured and -1 in captured:
        captured[n] = captured[-1]
    captured.pop(-1, None)
    last = getattr(out, "last_hidden_state", None)
    if last is None:
        last = first_tensor(out)
    if last is None:
        raise RuntimeError(f"reference forward returned {type(out).__name__} without a last hidden state")
    hs = getattr(out, "hidden_states", None)
    return Reference(last_hidden_state=last.detach(), aux=captured, hf_hidden_states=tuple(hs) if hs else None,
                     cache=returned_cache(out))


def reference_decode(
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
