"""pipespec's Transformers-backend subclass at model level, PP = 1, 2 and 3, inside real vLLM on CPU.

One group of spawned processes per pipeline size, each rank joining vLLM's own process groups (gloo on
127.0.0.1, a free port per group; ``pipespec.integrations.vllm.harness.init_rank``). Per family (a tiny
transformers config from pipespec's recipe, ``model_impl="transformers"``, weights seeded by parameter
name, every attention output zeroed the same way in every build — see ``_silence``):

* PP = 1: vLLM's unmodified backend class runs with hooks recording the residual stream at every id
  (``reference_stream.record_stream``: what enters each layer, and the last layer's output), the
  reference; pipespec's subclass with the ids returns ``(hidden_states, aux)``;
* PP = P: rank r builds its stage of the subclass and is driven as vLLM's V2 runner drives a rank, with the
  zoo's rank machinery (``pipespec.integrations.vllm.pp_ranks``): vLLM's ``set_eagle3_aux_hidden_state_layers``
  (the ids, and the receive slots by ``reserve_aux_intermediate_tensor_slots``),
  ``verify_supports_aux_hidden_states_over_pp`` and the relay keys; what rank r-1 sent through vLLM's
  ``get_pp_group().send_tensor_dict`` / ``recv_tensor_dict`` copied into the receive buffers as the runner
  copies it; a middle rank's output merged with the relayed keys by ``PPHandler.relay_aux_hidden_states``;
  the last rank returns its aux list.

Usage: tf_backend_stages.py --families llama,qwen2,gemma2 --pp 2,3 --ids 0,2,3,4,6 --out FILE.json
It also records vLLM's own backend class on the same models, the bugs the subclass exists for: what its
``set_aux_hidden_state_layers`` says to ids with 0 (PP = 1), and what its first rank does with the other
ids (PP >= 2: the keys it sends, or its error). Writes per family: ``num_layers``, the PP=1 errors,
``vllm_own``, and per PP size and rank: the keys sent (in order), the keys of its reserved receive buffer,
each sent aux tensor's max abs error against the reference at its id, and on the last rank the error of
each returned aux state. The test compares keys with
``plan_layout`` and errors with ``ATOL``. Every wait has a timeout; every process is joined or killed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
TIMEOUT_S = 420.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _silence(model: Any) -> None:
    """Zero attention the same way in every build: the harness's hooks on vLLM's attention layers, and a
    hook on each transformers module a vLLM ``Attention`` serves (the backend calls ``attn.forward``
    directly, so hooks on the vLLM layer never fire there; without runner metadata its output is unwritten)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from pipespec.integrations.vllm.harness import _silence_attention, _zeros_like

    _silence_attention(model)
    for module in model.modules():
        if isinstance(getattr(module, "attn", None), AttentionLayerBase):
            module.register_forward_hook(lambda _m, _a, out: _zeros_like(out))


def _build(cls: type, model_dir: str) -> Any:
    import torch
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from pipespec.integrations.vllm.harness import Built, _attention_config, _fill_weights

    model_config = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0,
                               model_impl="transformers")
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                             load_config=LoadConfig(load_format="dummy"), attention_config=_attention_config())
    with set_current_vllm_config(vllm_config):
        model = initialize_model(vllm_config, model_class=cls)
        _fill_weights(model)
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    model.eval()
    _silence(model)
    return Built(model=model, vllm_config=vllm_config, decoder=model.model)


def _backend_class(model_dir: str) -> type:
    """The class vLLM resolves for the directory with ``model_impl="transformers"`` (unmodified)."""
    from vllm.config import ModelConfig

    config = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, model_impl="transformers")
    cls, _ = config.registry.resolve_model_cls(config.architectures, model_config=config)
    return cls


def _np(tensor: Any) -> Any:
    return tensor.detach().clone().numpy()


def _family_on_rank(family: str, model_dir: str, ids: tuple[int, ...]) -> dict[str, Any]:
    import torch
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.pp_utils import PPHandler

    from pipespec.integrations.vllm.harness import NUM_TOKENS, _forward
    from pipespec.integrations.vllm.pp_ranks import _into_buffers, _prepare
    from pipespec.integrations.vllm.reference_stream import aux_of, layers_of, record_stream
    from pipespec.integrations.vllm.transformers_backend import adapted_class

    backend = _backend_class(model_dir)
    pp = get_pp_group()
    if pp.world_size == 1:
        ref = _build(backend, model_dir)
        n = len(layers_of(ref.decoder))
        with record_stream(ref.decoder, tuple(range(n + 1))) as stream:
            _forward(ref)
        tested = _build(adapted_class(backend), model_dir)
        _prepare(tested.model, ids)
        got = aux_of(_forward(tested), f"{family} at PP=1")
        return {"num_layers": n, "reference": {i: _np(t[0]) for i, t in stream.items()},
                "aux": [_np(t) for t in got], "class": f"{backend.__module__}:{backend.__name__}",
                "vllm_own": _vllm_own_set(ref.model, ids)}
    result: dict[str, Any] = {}
    if pp.is_first_rank:  # vLLM's own class, ids without 0: what its non-last rank does
        result["vllm_own_first_rank"] = _vllm_own_first_rank(backend, model_dir, tuple(i for i in ids if i > 0))
    built = _build(adapted_class(backend), model_dir)
    model = built.model
    relay = _prepare(model, ids)
    buffer = model.make_empty_intermediate_tensors(batch_size=NUM_TOKENS, dtype=torch.float32, device=torch.device("cpu"))
    result["receive_buffer"] = list(buffer.tensors)
    received = None
    if not pp.is_first_rank:
        received, _ = _into_buffers(model, pp.recv_tensor_dict(), pp.rank_in_group)
    out = _forward(built, received)
    if pp.is_last_rank:
        result["aux"] = [_np(t) for t in aux_of(out, f"{family} on the last PP rank")]
        return result
    if not isinstance(out, IntermediateTensors):
        raise TypeError(f"rank {pp.rank_in_group} returned {type(out).__name__}, not IntermediateTensors")
    sent = PPHandler.relay_aux_hidden_states(relay, received, out)  # type: ignore[arg-type]
    pp.send_tensor_dict(dict(sent.tensors))
    result["sends"] = list(sent.tensors)
    result["tensors"] = {k: _np(v) for k, v in sent.tensors.items() if k != "hidden_states"}
    return result


def _vllm_own_set(model: Any, ids: tuple[int, ...]) -> str:
    """What vLLM's own backend class says to ``set_aux_hidden_state_layers(ids)`` ("ok" or the error)."""
    try:
        model.set_aux_hidden_state_layers(ids)
    except Exception as exc:  # noqa: BLE001 - reported as it is: the bug the subclass exists for
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _vllm_own_first_rank(backend: type, model_dir: str, ids: tuple[int, ...]) -> str:
    """vLLM's own backend class on the first of several ranks: the keys it sends, or its error."""
    from pipespec.integrations.vllm.harness import _forward

    own = _build(backend, model_dir)
    try:
        own.model.set_aux_hidden_state_layers(ids)
        return "sends " + ", ".join(_forward(own).tensors)
    except Exception as exc:  # noqa: BLE001 - reported as it is: the bug the subclass exists for
        return f"{type(exc).__name__}: {exc}"


def _register_backend_in_process() -> None:
    """vLLM's text backend classes registered as classes, so ``ModelConfig`` inspects them in this process
    (the lazy entries inspect in a subprocess, seconds each), as the zoo harness registers its classes."""
    import importlib

    from vllm.model_executor.models import ModelRegistry

    backend = importlib.import_module("vllm.model_executor.models.transformers")
    for name in ("TransformersForCausalLM", "TransformersMoEForCausalLM"):
        ModelRegistry.register_model(name, getattr(backend, name))


def _rank_main(conn: Any, world: int, rank: int, init: str, families: list[str], ids: tuple[int, ...],
               dirs: dict[str, str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from pipespec.integrations.vllm.harness import init_rank

        init_rank(world, rank, init)
        _register_backend_in_process()
        for family in families:
            conn.send((family, "ok", _family_on_rank(family, dirs[family], ids)))
        conn.send(None)
    except Exception:  # noqa: BLE001 - the parent reports it with the family's result
        conn.send(("*", "error", traceback.format_exc()[-3000:]))


def _model_dirs(families: list[str], root: str) -> dict[str, str]:
    from pipespec.integrations.vllm.tiny import tiny_vllm_config, write_model_dir

    dirs = {}
    for family in families:
        config, _ = tiny_vllm_config(FAMILIES[family], family)
        dirs[family] = write_model_dir(config, tempfile.mkdtemp(prefix=f"{family}-", dir=root))
    return dirs


def _compare(reference: dict[int, Any], layer_id: int, tensor: Any) -> float:
    import numpy as np

    want = reference[layer_id]
    if tuple(tensor.shape) != tuple(want.shape):
        return float("inf")
    err = float(np.abs(tensor.astype(np.float64) - want.astype(np.float64)).max())
    return err if err == err else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--pp", default="2,3")
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    families = args.families.split(",")
    sizes = [1, *[int(p) for p in args.pp.split(",")]]
    ids = tuple(int(i) for i in args.ids.split(","))
    started = time.time()
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pipespec-tf-backend-") as root:
        dirs = _model_dirs(families, root)
        procs: dict[tuple[int, int], tuple[Any, Any]] = {}
        for size in sizes:
            init = f"tcp://127.0.0.1:{_free_port()}"
            for rank in range(size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(child, size, rank, init, families, ids, dirs), daemon=True)
                proc.start()
                child.close()
                procs[(size, rank)] = (proc, parent)
        answers: dict[tuple[int, int], dict[str, Any]] = {}
        errors: list[str] = []
        deadline = time.time() + TIMEOUT_S
        for key, (proc, conn) in procs.items():
            answers[key] = {}
            while True:
                if not conn.poll(max(0.0, deadline - time.time())):
                    errors.append(f"PP={key[0]} rank {key[1]}: no answer within {TIMEOUT_S:.0f} s")
                    break
                try:
                    message = conn.recv()
                except EOFError:
                    errors.append(f"PP={key[0]} rank {key[1]}: died (exit code {proc.exitcode})")
                    break
                if message is None:
                    break
                family, status, payload = message
                if status != "ok":
                    errors.append(f"PP={key[0]} rank {key[1]}: {payload}")
                    break
                answers[key][family] = payload
        for proc, conn in procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
    report: dict[str, Any] = {"ids": list(ids), "errors": errors, "families": {}, "s": 0.0}
    for family in families:
        base = answers.get((1, 0), {}).get(family)
        if base is None:
            continue
        reference = base["reference"]
        entry: dict[str, Any] = {"class": base["class"], "num_layers": base["num_layers"], "vllm_own": base["vllm_own"],
                                 "pp1": [_compare(reference, i, t) for i, t in zip(ids, base["aux"])], "stages": {}}
        sorted_ids = sorted(set(ids))
        for size in sizes[1:]:
            ranks = []
            for rank in range(size):
                got = answers.get((size, rank), {}).get(family)
                if got is None:
                    ranks.append(None)
                    continue
                row: dict[str, Any] = {"receive_buffer": got["receive_buffer"]}
                if "vllm_own_first_rank" in got:
                    row["vllm_own_first_rank"] = got["vllm_own_first_rank"]
                if "sends" in got:
                    row["sends"] = got["sends"]
                    row["sent_errors"] = {k: _compare(reference, sorted_ids[int(k.rsplit("_", 1)[1])], v)
                                          for k, v in got["tensors"].items()}
                else:
                    row["aux_errors"] = [_compare(reference, i, t) for i, t in zip(sorted_ids, got["aux"])]
                    row["num_aux"] = len(got["aux"])
                ranks.append(row)
            entry["stages"][str(size)] = ranks
        report["families"][family] = entry
    report["s"] = round(time.time() - started, 1)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f)
    sys.exit(0)


if __name__ == "__main__":
    main()
