"""The zoo's forward-shape labels: which family of forward a decoder class has, for the coverage table.

A label only (the adaptation does its own, stricter analysis, in the codemods): read from the class's
source with Python's ``ast``, never by importing or running anything new.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["SHAPES", "classify_forward_shape"]

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
