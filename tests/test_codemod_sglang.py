"""The sglang dialect (``adapt_sglang_module``): SGLang 0.5.23's model files made to relay aux states over PP.

Golden fixtures are byte-exact copies of sglang 0.5.23's model files (tests/fixtures/sglang_native/0.5.23/)
with their committed outputs in ``expected/`` (reviewed against docs/aux-ids.md). The adapted llama forward
is also run, on a toy pipeline, against the contract: stage by stage, with SGLang's own
``aux_hidden_states.py`` (a byte-exact copy) as the collector, every split of the layers gives the ids' values
in slot order, and each stage sends exactly the keys ``pipespec layout`` names. The run inside real SGLang is
the plugin's suite (tests/sglang/).
"""

from __future__ import annotations

import ast
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from pipespec.codemods.adapt_sglang import CaptureForm, SglangStatus, adapt_sglang_module
from pipespec.contract.layout import plan_layout

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "0.5.23"
FIXTURES = ROOT / "tests" / "fixtures" / "sglang_native" / RELEASE
# file -> (decoder, capture form, the convention's words for given ids): what each golden covers
GOLDEN = {
    "llama": ("LlamaModel", CaptureForm.LIST, "layer_ids is not None: id + 1"),
    "qwen2": ("Qwen2Model", CaptureForm.LIST, "layer_ids is not None: id + 1"),
    "qwen3": ("Qwen3Model", CaptureForm.LIST, "layer_ids is not None: id + 1"),  # Qwen3Model(Qwen2Model) overrides forward
    # the MoE decoder: loop inside `else` of a TBO branch, layers flagged `_is_layer_to_capture` by its setter
    "qwen2_moe": ("Qwen2MoeModel", CaptureForm.LIST, "layer_ids is not None: id + 1"),
    # the packed buffer, a hand-off that already carries topk_indices, and the "+1 only when the first id is 1" rule
    "deepseek_v2": ("DeepseekV2Model", CaptureForm.PACKER, "layer_ids and layer_ids[0] == 1: id + 1"),
}


def _adapt(name: str) -> Any:
    return adapt_sglang_module((FIXTURES / f"{name}.py").read_text(), label=f"{name}.py")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_release_file_adapts_to_its_golden(name: str) -> None:
    """The released file's adaptation is byte-identical to the committed, reviewed output."""
    decoder, form, convention = GOLDEN[name]
    result = _adapt(name)
    assert result.code == (FIXTURES / "expected" / f"{name}.py").read_text()
    row = result.outcome(decoder)
    assert (row.status, row.capture_form) == (SglangStatus.ADAPTED, form)
    assert convention in row.id_convention
    assert any(s.endswith(".set_eagle3_layers_to_capture") for s in result.setters)
    tree = ast.parse(result.code)
    compile(tree, name, "exec")
    assert not any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pipespec") for n in ast.walk(tree))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_second_run_changes_nothing(name: str) -> None:
    """T(T(x)) == T(x): an adapted file reports its decoder unchanged and keeps every byte."""
    once = (FIXTURES / "expected" / f"{name}.py").read_text()
    again = adapt_sglang_module(once, label=name)
    assert again.code == once
    assert [r.status for r in again.decoders] == [SglangStatus.UNCHANGED]
    assert again.setters == ()


def test_setter_keeps_capture_flag_a_last_rank_fact() -> None:
    """Every rank learns its ids; only the last makes the decoder return (hidden, aux)."""
    module = ast.parse((FIXTURES / "expected" / "llama.py").read_text())
    setter = _method(module, "LlamaForCausalLM", "set_eagle3_layers_to_capture")
    for last in (False, True):
        causal = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=last),
                                       config=types.SimpleNamespace(num_hidden_layers=8),
                                       model=types.SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False)
        setter(causal, [0, 3, 6])
        assert causal.model.layers_to_capture == [1, 4, 7]  # SGLang id i = output of layer i = pipespec id i + 1
        assert causal.capture_aux_hidden_states is last
        setter(causal, None)
        assert causal.model.layers_to_capture == [2, 4, 5]


def test_unguarded_setter_keeps_capture_flag_a_last_rank_fact() -> None:
    """qwen2_5_vl's setter (0.5.23's release file) has no guard and sets ``capture_aux_hidden_states = True`` on
    every rank, so a non-last rank would unpack its decoder's PPProxyTensors as ``(hidden, aux)``: the adapted
    setter keeps the flag a last-rank fact, every rank still learns its ids, and a second run changes nothing."""
    from pipespec.integrations.sglang.sources import source_tree

    code = (source_tree(RELEASE) / "srt" / "models" / "qwen2_5_vl.py").read_text(encoding="utf-8")
    result = adapt_sglang_module(code, label="qwen2_5_vl.py")
    assert result.setters == ("Qwen2_5_VLForConditionalGeneration.set_eagle3_layers_to_capture",)
    assert result.decoders == () and result.setters_left == ()
    setter = _method(ast.parse(result.code), "Qwen2_5_VLForConditionalGeneration", "set_eagle3_layers_to_capture")
    for last in (False, True):
        vl = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=last),
                                   config=types.SimpleNamespace(num_hidden_layers=8),
                                   model=types.SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False)
        setter(vl, [0, 3, 6])
        assert vl.model.layers_to_capture == [1, 4, 7]
        assert vl.capture_aux_hidden_states is last
    again = adapt_sglang_module(result.code, label="qwen2_5_vl.py")
    assert again.code == result.code and again.setters == ()


SETTER = """\
class Base:
    def __init__(self):
        self.pp_group = get_pp_group()


class {cls}:
    def set_eagle3_layers_to_capture(self, layer_ids=None):
{body}
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [val + 1 for val in layer_ids]
"""


@pytest.mark.parametrize(("cls", "body", "left"), [
    ("M(Base)", "        pass", ""),  # self.pp_group from a base class of the file: adapted
    ("M", "        pass", "M.set_eagle3_layers_to_capture: sets capture_aux_hidden_states = True on every rank, and "
                           "its class holds no self.pp_group (in this file) to keep that to the last rank"),
    ("M(Base)", "        if self.pp_group.world_size > 1:\n            raise NotImplementedError('PP')",
     "M.set_eagle3_layers_to_capture: decides on the pipeline itself (`if self.pp_group.world_size > 1`)"),
    ("M(Base)", "        if layer_ids is None:\n            return",
     "M.set_eagle3_layers_to_capture: sets capture_aux_hidden_states = True on every rank and returns early"),
])
def test_unguarded_setter_adapted_or_left_with_the_reason(cls: str, body: str, left: str) -> None:
    """An unguarded setter gets the last-rank line only where its class holds ``self.pp_group`` and nothing
    else in it decides on the pipeline or returns; otherwise the file is unchanged and the reason reported
    (the plugin refuses the class with it)."""
    code = SETTER.format(cls=cls, body=body)
    result = adapt_sglang_module(code, label="m.py")
    if left:
        assert (result.code, result.setters, result.setters_left) == (code, (), (left,))
    else:
        assert result.setters == ("M.set_eagle3_layers_to_capture",)
        assert result.code.endswith("        self.capture_aux_hidden_states = self.pp_group.is_last_rank\n")


# ------------------------------------------------------------------ the adapted forward, run stage by stage


class _Proxy:
    """The interface of sglang's ``PPProxyTensors`` the forward uses: ``.tensors``, ``[key]``, ``[key] = v``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value


class _Layer:
    """Layer i: h -> 1.5 h + i + 1, capturing its input when told to (SGLang's ``capture_output``)."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.attn_boundary = types.SimpleNamespace(from_pp=lambda proxy, batch: proxy["hidden_states"])

    def __call__(self, positions: Any, hidden: torch.Tensor, batch: Any, capture_output: Any = None) -> torch.Tensor:
        if capture_output is not None:
            capture_output(hidden)
        return hidden * 1.5 + self.i + 1


def _method(module: ast.Module, cls: str, name: str, **names: Any) -> Any:
    klass = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    namespace: dict[str, Any] = {"Optional": Any, "Union": Any, "Tuple": Any, "List": Any, "torch": torch,
                                 "ForwardBatch": Any, "PPProxyTensors": _Proxy, **names}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), f"{cls}.{name}", "exec"), namespace)
    return namespace[name]


def _run_pipeline(forward: Any, n: int, partition: tuple[int, ...], ids: list[int]) -> tuple[list[torch.Tensor], list[list[str]]]:
    starts = [sum(partition[:s]) for s in range(len(partition))]
    proxy: _Proxy | None = None
    sent: list[list[str]] = []
    out: Any = None
    for s, start in enumerate(starts):
        model = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(is_first_rank=s == 0, is_last_rank=s == len(partition) - 1),
            start_layer=start, end_layer=start + partition[s], layers=[_Layer(i) for i in range(n)],
            layers_to_capture=list(ids), embed_tokens=lambda ids_: ids_.float(), norm=lambda h: h * 0)
        out = forward(model, torch.arange(3.0), None, object(), pp_proxy_tensors=proxy)
        if s < len(partition) - 1:
            proxy = out
            sent.append(sorted(k for k in out.tensors if k != "hidden_states"))
    hidden, aux = out
    return list(aux), sent


def _residual_batch() -> types.SimpleNamespace:
    return types.SimpleNamespace(start=lambda batch: None, to_pp=lambda h, batch: _Proxy({"hidden_states": h}),
                                 snapshot=lambda h, batch: h.clone(), final_norm=lambda h, batch, norm: norm(h))


@pytest.mark.parametrize(("partition", "ids"), [
    ((3, 3), [0, 3, 5, 6]),  # id 0, an id on the boundary, id N
    ((2, 2, 2), [2, 4]),  # both ids end a stage: each is its upstream stage's last output
    ((1, 4, 1), [1, 2, 5, 6]),  # uneven, a middle stage that produces and relays
    ((4, 2), [1]),  # nothing produced downstream: the last stage only collects
])
def test_adapted_llama_forward_relays_every_id_in_slot_order(partition: tuple[int, ...], ids: list[int]) -> None:
    """Any split of the layers hands the last rank the same list as PP = 1: id L's value is the stream
    entering layer L (id N: the last layer's output), in id order; each stage sends what layout plans."""
    aux_module = types.ModuleType("aux_hidden_states")
    exec(compile((FIXTURES / "aux_hidden_states.py").read_text(), "aux_hidden_states.py", "exec"), aux_module.__dict__)
    module = ast.parse((FIXTURES / "expected" / "llama.py").read_text())
    forward = _method(module, "LlamaModel", "forward", AuxHiddenStateList=aux_module.AuxHiddenStateList,
                      residual_batch=_residual_batch())
    n = sum(partition)
    stream = [torch.arange(3.0)]
    for i in range(n):
        stream.append(stream[-1] * 1.5 + i + 1)
    single, _ = _run_pipeline(forward, n, (n,), ids)
    split, sent = _run_pipeline(forward, n, partition, ids)
    assert [t.tolist() for t in split] == [t.tolist() for t in single] == [stream[i].tolist() for i in ids]
    plan = plan_layout(n, len(partition), aux_layers=ids, partition=list(partition))
    assert sent == [sorted(stage.sends) for stage in plan.stages[:-1]]


def test_missing_upstream_key_names_the_keys_present() -> None:
    """A stage that receives fewer states than its ids say fails naming the key, never a shorter list."""
    aux_module = types.ModuleType("aux_hidden_states")
    exec(compile((FIXTURES / "aux_hidden_states.py").read_text(), "aux_hidden_states.py", "exec"), aux_module.__dict__)
    forward = _method(ast.parse((FIXTURES / "expected" / "llama.py").read_text()), "LlamaModel", "forward",
                      AuxHiddenStateList=aux_module.AuxHiddenStateList, residual_batch=_residual_batch())
    model = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_first_rank=False, is_last_rank=True),
                                  start_layer=2, end_layer=4, layers=[_Layer(i) for i in range(4)], layers_to_capture=[1, 3])
    with pytest.raises(KeyError, match=r"aux_hidden_states_0 is missing .*keys present: \['hidden_states'\]"):
        forward(model, None, None, object(), pp_proxy_tensors=_Proxy({"hidden_states": torch.zeros(3)}))


# ------------------------------------------------------------------ declines: the construct and its line

HEADER = """\
from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
"""


@pytest.mark.parametrize(("body", "reason"), [
    ("""\
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](hidden_states)
        if not self.pp_group.is_last_rank:
            return residual_batch.to_pp(hidden_states, forward_batch)
        return hidden_states
""", "captures no aux states: no AuxHiddenStateList or AuxHiddenStatePacker in forward (line 7)"),
    ("""\
        aux_hidden_states = AuxHiddenStateList()
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](hidden_states, capture_output=aux_hidden_states.capture if i in self.layers_to_capture else None)
        if not self.pp_group.is_last_rank:
            return {"hidden_states": hidden_states}
        return hidden_states, aux_hidden_states
""", "the non-last rank returns `{\"hidden_states\": hidden_states}`, not a PPProxyTensors hand-off (line 11)"),
    ("""\
        aux_hidden_states = AuxHiddenStateList()
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](hidden_states, capture_output=aux_hidden_states.capture if i in self.layers_to_capture else None)
        return residual_batch.to_pp(hidden_states, forward_batch)
""", "no `if not self.pp_group.is_last_rank:` hand-off at forward's top level after the layer loop (line 8)"),
    ("""\
        aux_hidden_states = AuxHiddenStateList()
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](hidden_states)
            aux_hidden_states.append(hidden_states)
        if not self.pp_group.is_last_rank:
            return residual_batch.to_pp(hidden_states, forward_batch)
        return hidden_states, aux_hidden_states
""", "the layer loop does not pass `aux_hidden_states` to its layers as `... if <test> else None` (line 8)"),
])
def test_unrewritable_forward_is_declined_with_construct_and_line(body: str, reason: str) -> None:
    """A decoder the dialect cannot rewrite is declined (construct and line) and the file stays as it was,
    setters included: a rank that learned its ids but could not send them would shorten the last rank's list."""
    code = HEADER + "\n\nclass M:\n    def forward(self, hidden_states, forward_batch, pp_proxy_tensors=None):\n" + body + textwrap.dedent("""
        class MForCausalLM:
            def set_eagle3_layers_to_capture(self, layer_ids=None):
                if not self.pp_group.is_last_rank:
                    return
                self.capture_aux_hidden_states = True
                self.model.layers_to_capture = [val + 1 for val in layer_ids]
        """)
    result = adapt_sglang_module(code, label="m.py")
    row = result.outcome("M")
    assert (row.status, row.reason) == (SglangStatus.DECLINED, reason)
    assert result.code == code and result.setters == ()


def test_classes_limits_the_decoders() -> None:
    """``classes`` names the decoders to adapt; the others are not reported."""
    code = (FIXTURES / "llama.py").read_text()
    assert adapt_sglang_module(code, label="llama.py", classes=["Nope"]).decoders == ()


# ------------------------------------------------------------------ adapter-gen --dialect sglang


def _adapter_gen(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from pipespec.cli.adapter_gen import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_diff_out_in_place_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--diff writes nothing, --out writes the golden, --check says which file is stale, --in-place converges."""
    source = tmp_path / "qwen2.py"
    source.write_text((FIXTURES / "qwen2.py").read_text())
    golden = (FIXTURES / "expected" / "qwen2.py").read_text()
    code, out, err = _adapter_gen([str(source), "--dialect", "sglang"], capsys)
    assert code == 0 and out.startswith("--- a/qwen2.py\n+++ b/qwen2.py") and "Qwen2Model: adapted (list" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen2.py"]
    assert _adapter_gen([str(source), "--dialect", "sglang", "--check"], capsys)[0] == 1
    out_file = tmp_path / "out.py"
    assert _adapter_gen([str(source), "--dialect", "sglang", "--out", str(out_file)], capsys)[0] == 0
    assert out_file.read_text() == golden
    assert _adapter_gen([str(source), "--dialect", "sglang", "--check", "--out", str(out_file)], capsys)[0] == 0
    assert _adapter_gen([str(source), "--dialect", "sglang", "--in-place"], capsys)[0] == 0
    assert source.read_text() == golden
    assert _adapter_gen([str(source), "--dialect", "sglang", "--check"], capsys)[0] == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["{dir}/missing.py"], "missing.py: source file does not exist"),
    (["{dir}/qwen2.py", "--out", "{dir}/no/such/out.py"], "--out {dir}/no/such/out.py: directory {dir}/no/such does not exist"),
    (["{dir}/qwen2.py", "--class", "Nope"], "--class Nope: no such class with a pipeline layer loop"),
    (["{dir}/qwen2.py", "--residual-rule", "reads"], "--residual-rule does not apply to --dialect sglang"),
    (["{dir}/qwen2.py", "--in-place", "--check"], "--in-place and --check cannot be combined"),
    (["{dir}/plain.py"], "plain.py: no decoder with a pipeline layer loop"),
    (["{dir}/broken.py"], "broken.py: line 1: not valid Python"),
])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          argv: list[str], message: str) -> None:
    """Each wrong input: exit 2, one line naming the file or flag and the fix, no file created or changed."""
    (tmp_path / "qwen2.py").write_text((FIXTURES / "qwen2.py").read_text())
    (tmp_path / "plain.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, err = _adapter_gen([a.format(dir=tmp_path) for a in argv] + ["--dialect", "sglang"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message.format(dir=tmp_path) in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_cli_declined_file_is_written_nowhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A declined decoder: the reason on stderr, exit 1, --out not created."""
    source = tmp_path / "m.py"
    source.write_text(HEADER + "\n\nclass M:\n    def forward(self, h, forward_batch, pp_proxy_tensors=None):\n"
                      "        for i in range(self.start_layer, self.end_layer):\n            h = self.layers[i](h)\n"
                      "        return h\n")
    code, out, err = _adapter_gen([str(source), "--dialect", "sglang", "--out", str(tmp_path / "o.py")], capsys)
    assert code == 1 and "M: declined (none): captures no aux states" in err
    assert not (tmp_path / "o.py").exists()
