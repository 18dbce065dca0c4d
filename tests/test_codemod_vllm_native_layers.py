"""Which classes a decoder builds its layers from (``codemods/vllm_native_layers.py``), as examples.

Fixit's style: each ``FOUND`` example is a module whose ``Model`` builds ``self.layers``, with the layer
classes the resolver must name; each ``NOT_FOUND`` example must come back as the node it names instead.
The named limits (``MAX_NAME_HOPS``, ``MAX_CLASSES_UP``) are pinned at their edge, one example each side.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from pipespec.codemods.vllm_native_index import ClassIndex
from pipespec.codemods.vllm_native_layers import MAX_CLASSES_UP, MAX_NAME_HOPS, layer_classes
from pipespec.codemods.vllm_native_names import flat_source_of, snippet_of
from pipespec.codemods.vllm_native_status import DecoderStatus

LAYERS = """
class DenseLayer(nn.Module):
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual

class MoeLayer(nn.Module):
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual
"""


def _chain(hops: int) -> str:
    """A local name bound through ``hops`` other local names before it names DenseLayer."""
    names = [f"layer_{i}" for i in range(hops + 1)]
    binds = [f"        {a} = {b}\n" for a, b in zip(names, names[1:])] + [f"        {names[-1]} = DenseLayer\n"]
    return ("class Model(nn.Module):\n    def __init__(self, config):\n" + "".join(reversed(binds))
            + f"        self.layers = make_layers(config.n, lambda prefix: {names[0]}(config, prefix=prefix))\n")


def _bases(depth: int) -> str:
    """``Model`` whose ``__init__`` (and its bases' up to ``Base{depth}``) only call super(); the last builds."""
    out = [f"class Base{depth}(nn.Module):\n    def __init__(self, config):\n"
           "        self.layers = nn.ModuleList([DenseLayer(config) for _ in range(config.n)])\n"]
    for i in range(depth - 1, 0, -1):
        out.append(f"class Base{i}(Base{i + 1}):\n    def __init__(self, config):\n        super().__init__(config=config)\n")
    out.append("class Model(Base1):\n    def __init__(self, config):\n        super().__init__(config=config)\n")
    return "".join(out)


FOUND = {
    "called in a list": ("""
        class Model(nn.Module):
            def __init__(self, config):
                self.layers = nn.ModuleList([DenseLayer(config) for _ in range(config.n)])
        """, ["DenseLayer"]),
    "make_layers with a lambda": ("""
        class Model(nn.Module):
            def __init__(self, config, prefix=""):
                self.start_layer, self.end_layer, self.layers = make_layers(
                    config.n, lambda prefix: DenseLayer(config, prefix=prefix), prefix=f"{prefix}.layers")
        """, ["DenseLayer"]),
    "a local name chosen by config": ("""
        class Model(nn.Module):
            def __init__(self, config):
                layer_cls = MoeLayer if config.moe else DenseLayer
                self.layers = make_layers(config.n, lambda prefix: layer_cls(config, prefix=prefix))
        """, ["DenseLayer", "MoeLayer"]),
    "a local builder passed by name": ("""
        class Model(nn.Module):
            def __init__(self, config):
                def get_layer(prefix):
                    return MoeLayer(config, prefix=prefix)
                self.layers = make_layers(config.n, get_layer)
        """, ["MoeLayer"]),
    "a parameter's default": ("""
        class Model(nn.Module):
            def __init__(self, config, layer_type=MoeLayer):
                self.layers = make_layers(config.n, lambda prefix: layer_type(config, prefix=prefix))
        """, ["MoeLayer"]),
    "a class passed down to the base's parameter": ("""
        class Base(nn.Module):
            def __init__(self, config, layer_type=DenseLayer):
                self.layers = make_layers(config.n, lambda prefix: layer_type(config, prefix=prefix))

        class Model(Base):
            def __init__(self, config):
                super().__init__(config=config, layer_type=MoeLayer)
        """, ["MoeLayer"]),
    "a helper method __init__ calls": ("""
        class Model(nn.Module):
            def __init__(self, config):
                self._init_layers(config)

            def _init_layers(self, config):
                self.layers = nn.ModuleList([MoeLayer(config) for _ in range(config.n)])
        """, ["MoeLayer"]),
    "a class attribute called through self": ("""
        class Model(nn.Module):
            layer_cls = DenseLayer

            def __init__(self, config):
                self.layers = nn.ModuleList([self.layer_cls(config) for _ in range(config.n)])
        """, ["DenseLayer"]),
    f"a local name {MAX_NAME_HOPS - 1} names from the class": (_chain(MAX_NAME_HOPS - 1), ["DenseLayer"]),
    f"built {MAX_CLASSES_UP - 1} bases up": (_bases(MAX_CLASSES_UP - 1), ["DenseLayer"]),
}

# example -> the source text of the node named instead of the classes
NOT_FOUND = {
    "a builder the source does not define": ("""
        class Model(nn.Module):
            def __init__(self, config):
                self.layers = make_layers(config.n, lambda prefix: get_layer(config, prefix=prefix))
        """, "make_layers(config.n, lambda prefix: get_layer(config, prefix=prefix))"),
    "an __init__ that neither builds them nor calls super().__init__": ("""
        class Model(nn.Module):
            def __init__(self, config):
                self.norm = None
        """, "__init__"),
    "assigned twice": ("""
        class Model(nn.Module):
            def __init__(self, config):
                self.layers = nn.ModuleList([DenseLayer(config)])
                self.layers = nn.ModuleList([MoeLayer(config)])
        """, "Model"),
    "a base the source does not define": ("""
        class Model(ElsewhereModel):
            def __init__(self, config):
                super().__init__(config=config)
        """, "__init__"),
    f"a local name {MAX_NAME_HOPS} names from the class": (
        _chain(MAX_NAME_HOPS), "make_layers(config.n, lambda prefix: layer_0(config, prefix=prefix))"),
    f"built {MAX_CLASSES_UP} bases up": (_bases(MAX_CLASSES_UP), "Model"),
}


def _resolve(source: str) -> tuple[list[str] | None, str]:
    module = cst.parse_module(LAYERS + textwrap.dedent(source))
    model = next(s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == "Model")
    found = layer_classes(model, "layers", ClassIndex(module, lambda dotted: None).lookup)
    if isinstance(found, cst.CSTNode):
        return None, flat_source_of(found)
    return sorted(cls.name.value for cls, _ in found), ""


@pytest.mark.parametrize("example", FOUND)
def test_layer_classes_found(example: str) -> None:
    """The resolver names exactly the layer classes the example builds."""
    source, classes = FOUND[example]
    assert _resolve(source) == (classes, "")


@pytest.mark.parametrize("example", NOT_FOUND)
def test_layer_classes_not_found_name_the_node(example: str) -> None:
    """Where the classes cannot be told from the source, the node to blame comes back instead."""
    source, node = NOT_FOUND[example]
    assert _resolve(source) == (None, node)


def test_snippet_is_the_flat_source_cut_for_messages() -> None:
    """``snippet_of`` (messages) cuts at 90 characters; ``flat_source_of`` (generated code) never does."""
    long_call = cst.parse_expression("f(" + ", ".join(f"argument_{i}" for i in range(12)) + ")")
    flat = flat_source_of(long_call)
    assert len(flat) > 90 and flat == "f(" + ", ".join(f"argument_{i}" for i in range(12)) + ")"
    assert snippet_of(long_call) == flat[:87] + "..."
    spaced = cst.parse_expression("(a  +\n    b)")
    assert flat_source_of(spaced) == snippet_of(spaced) == "(a + b)"


def test_decoder_status_reads_as_its_value() -> None:
    """Reports, JSON and string comparisons see the same words as before the enum."""
    import json

    assert [s.value for s in DecoderStatus] == ["adapted", "unchanged", "declined"]
    assert DecoderStatus.DECLINED == "declined" and f"{DecoderStatus.ADAPTED}" == "adapted"
    assert json.dumps({"codemod": DecoderStatus.UNCHANGED}) == '{"codemod": "unchanged"}'
