"""The `pipespec` dialect (vLLM-style source run by pipespec's own runtime; formerly `--dialect vllm`):
before/after, declines with their reasons, idempotency, golden fixtures, and
numbers — adapted fixture models run as P = 1, 2, 3 in-process stages must hand the last stage exactly
the aux states (and final hidden state) that the unadapted model computes in one piece.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch
from libcst.codemod import CodemodContext, CodemodTest, TransformSkip, TransformSuccess, transform_module

from pipespec.cli.adapter_gen import main as adapter_gen_main
from pipespec.codegen.source import load_target
from pipespec.codegen.transform import AdaptStatus, adapt_target
from pipespec.codemods.adapt_vllm_forward import ALREADY_ADAPTED, AdaptVllmForwardCommand
from pipespec.contract.mixin import hop_keys
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import LayoutError

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_style"
if str(FIXTURES) not in sys.path:  # the fixture model files import their toy runtime as `toy_vllm`
    sys.path.insert(0, str(FIXTURES))

import toy_vllm  # noqa: E402

HEAD = """\
from itertools import islice

from vllm.distributed import get_pp_group
from vllm.sequence import IntermediateTensors


class Model(nn.Module):
    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
"""
TAIL = """\
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
"""
LOOP = """\
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
"""


def vllm_model(loop: str = LOOP, head: str = HEAD, tail: str = TAIL) -> str:
    return head + loop + tail


ADAPTED = '''\
from itertools import islice

from vllm.sequence import IntermediateTensors

from pipespec.contract.mixin import AuxHiddenStatesMixin


class Model(AuxHiddenStatesMixin, nn.Module):
    supports_aux_hidden_states_over_pp = True  # pipespec: this class's own forward handles aux hidden states
    pipespec_has_residual = True
    pipespec_generated_by = "adapt_vllm_forward v1; source model.py:Model; spec detected from source"

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        # pipespec: aux states from upstream stages (last stage only; elsewhere [])
        remote_aux_hidden_states = self.collect_remote_aux_hidden_states(intermediate_tensors)
        aux_hidden_states = []  # pipespec: this stage's own aux states, in id order
        if self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        if self.aux_capture_input:  # pipespec: aux id 0 (what enters layer 0), first stage
            self.capture_aux_hidden_state(aux_hidden_states, hidden_states if residual is None else hidden_states + residual)
{loop}        if not self.is_last_stage:
            return self.relay_aux_hidden_states(
                intermediate_tensors,
                IntermediateTensors({{
                    "hidden_states": hidden_states,
                    "residual": residual,
                    **self.pack_local_aux_hidden_states(aux_hidden_states),
                }}),
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        if self.aux_hidden_state_layers:
            return hidden_states, remote_aux_hidden_states + aux_hidden_states
        return hidden_states
'''
ADAPTED_LOOP = """\
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
            if idx in self.aux_capture_after_layers:  # pipespec: aux id idx + 1
                self.capture_aux_hidden_state(aux_hidden_states, hidden_states + residual)
"""


def run_codemod(code: str, class_name: str = "Model", spec: AdapterSpec | None = None):
    return transform_module(AdaptVllmForwardCommand(CodemodContext(), class_name, spec, source=f"model.py:{class_name}"), code)


def skip_reason(code: str, class_name: str = "Model", spec: AdapterSpec | None = None) -> str:
    result = run_codemod(code, class_name, spec)
    assert isinstance(result, TransformSkip), f"expected a skip, got {type(result).__name__}"
    return result.skip_description


class TestAdaptVllmForward(CodemodTest):
    TRANSFORM = AdaptVllmForwardCommand

    def test_islice_loop_with_residual_gets_collect_capture_pack_and_aux_return(self) -> None:
        """The reference shape: every piece of the adaptation, and get_pp_group's now-unused import goes."""
        self.assertCodemod(
            vllm_model(), ADAPTED.format(loop=ADAPTED_LOOP), "Model", source="model.py:Model",
            expected_warnings=["line 9, 17: forward's get_pp_group() rank checks now read the stage plan "
                               "(self.is_first_stage / self.is_last_stage)"],
        )

    def test_slice_of_the_layer_list_is_the_same_loop(self) -> None:
        """``self.layers[self.start_layer:self.end_layer]`` is treated like ``islice``."""
        loop = LOOP.replace("islice(self.layers, self.start_layer, self.end_layer)", "self.layers[self.start_layer:self.end_layer]")
        after_loop = ADAPTED_LOOP.replace("islice(self.layers, self.start_layer, self.end_layer)",
                                          "self.layers[self.start_layer:self.end_layer]")
        self.assertCodemod(vllm_model(loop), ADAPTED.format(loop=after_loop), "Model", source="model.py:Model")

    def test_range_loop_keeps_its_absolute_index(self) -> None:
        """``for i in range(self.start_layer, self.end_layer)`` is already global: only the capture is added."""
        loop = """\
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, residual)
"""
        after_loop = """\
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, residual)
            if i in self.aux_capture_after_layers:  # pipespec: aux id i + 1
                self.capture_aux_hidden_state(aux_hidden_states, hidden_states + residual)
"""
        self.assertCodemod(vllm_model(loop), ADAPTED.format(loop=after_loop), "Model", source="model.py:Model")

    def test_enumerate_without_start_becomes_global_when_the_body_ignores_the_index(self) -> None:
        """A relative index nobody reads is made absolute (with a warning naming the line)."""
        loop = LOOP.replace("for layer in islice(self.layers, self.start_layer, self.end_layer)",
                            "for n, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer))")
        after_loop = ADAPTED_LOOP.replace("idx", "n")
        self.assertCodemod(
            vllm_model(loop), ADAPTED.format(loop=after_loop), "Model", source="model.py:Model",
            expected_warnings=["line 15: the loop index `n` now counts layers globally (start=self.start_layer)",
                               "line 9, 17: forward's get_pp_group() rank checks now read the stage plan "
                               "(self.is_first_stage / self.is_last_stage)"],
        )

    def test_no_residual_captures_the_hidden_stream(self) -> None:
        """``hidden_states = layer(...)``: the captured value is ``hidden_states`` itself."""
        before = vllm_model(
            loop="""\
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states = layer(positions, hidden_states)
""",
            head=HEAD.replace('            residual = None\n', "").replace('            residual = intermediate_tensors["residual"]\n', ""),
            tail="""\
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states})
        return self.norm(hidden_states)
""",
        )
        result = run_codemod(before)
        assert isinstance(result, TransformSuccess)
        assert "pipespec_has_residual = False" in result.code
        assert "self.capture_aux_hidden_state(aux_hidden_states, hidden_states)\n" in result.code
        assert "residual" not in result.code.replace("pipespec_has_residual", "")
        assert "            return self.norm(hidden_states), remote_aux_hidden_states + aux_hidden_states\n" in result.code

    def test_adapted_output_is_skipped_so_a_second_run_changes_nothing(self) -> None:
        """T(T(x)) == T(x): the marker makes the second run a skip with the input unchanged."""
        once = ADAPTED.format(loop=ADAPTED_LOOP)
        self.assertCodemod(once, once, "Model", expected_skip=True)
        assert skip_reason(once).startswith(ALREADY_ADAPTED)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (vllm_model(LOOP.replace("for layer in islice(self.layers, self.start_layer, self.end_layer)",
                                 "for i, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer))")
                        .replace("layer(positions, hidden_states, residual)", "layer(positions, hidden_states, residual, i)")),
         "the loop index `i` counts from 0 on every stage"),
        (vllm_model(LOOP.replace("hidden_states, residual = layer", "hidden_states, residual, state = layer")),
         "the layer call assigns `hidden_states, residual, state`"),
        (vllm_model(LOOP.replace("islice(self.layers, self.start_layer, self.end_layer)", "self.layers")),
         "loop `for ... in self.layers` is not over this stage's layers"),
        (vllm_model(LOOP + "            break\n"), "forward breaks, continues or yields"),
        (vllm_model(head=HEAD.replace("        if get_pp_group().is_first_rank:\n",
                                 "        if input_ids is None:\n            return None\n        if get_pp_group().is_first_rank:\n")),
         "forward returns before its layer loop ends"),
        (vllm_model().replace("intermediate_tensors, inputs_embeds=None", "inputs_embeds=None"),
         "forward has no `intermediate_tensors` parameter"),
        (vllm_model(tail="        hidden_states, _ = self.norm(hidden_states, residual)\n        return hidden_states\n"),
         "never returns `IntermediateTensors({...})` for non-last ranks"),
        (vllm_model(LOOP + "        aux_hidden_states = []\n"), "forward already uses `aux_hidden_states`"),
        (vllm_model().replace("    def forward", "    def __init__(self):\n        self.aux_hidden_state_layers = ()\n\n    def forward"),
         "assigns self.aux_hidden_state_layers, which the mixin owns"),
        (vllm_model().replace("(nn.Module)", "(AuxHiddenStatesMixin, nn.Module)"), "inherits AuxHiddenStatesMixin but has no"),
        (vllm_model(LOOP + LOOP), "forward has more than one layer loop"),
        # inkling: the second value is a deferred add, not the residual the next stage receives
        (vllm_model(LOOP.replace("hidden_states, residual = layer", "hidden_states, pending = layer"),
                    tail=TAIL.replace(', "residual": residual', "")),
         "the layer call assigns `hidden_states, pending` but the next stage receives hidden_states and no residual"),
        # hy_v4 with enable_ihc: one branch hands on a reshaped stream without residual
        (vllm_model(tail=TAIL.replace("        if not get_pp_group().is_last_rank:\n",
                                      "        if not get_pp_group().is_last_rank:\n            if self.enable_ihc:\n"
                                      '                return IntermediateTensors({"hidden_states": hidden_states.flatten(1)})\n')),
         'a non-last-rank return sends `hidden_states.flatten(1)` as "hidden_states"'),
    ],
    ids=["relative-index", "recurrent-state", "all-layers", "break", "early-return", "no-intermediate-tensors",
         "no-pp-return", "hand-adapted", "assigns-mixin-property", "mixin-without-marker", "two-loops",
         "carried-not-sent", "reshaped-branch"],
)
def test_unrecognised_shapes_are_declined_with_the_reason(code: str, reason: str) -> None:
    assert reason in skip_reason(code)


def test_missing_class_names_the_classes_present() -> None:
    assert "no top-level class 'Nope'; classes here: Model" in skip_reason(vllm_model(), "Nope")


def spec_for(**fields: object) -> AdapterSpec:
    return AdapterSpec(name="toy", decoder_class="model:Model", dialect="pipespec", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (spec_for(residual=False), "the loop carries a residual (`residual`) but spec toy (<code>) says model.residual = false"),
        (spec_for(residual=True, capture="hidden + residual", layers_attr="h"), "the loop runs self.layers but spec toy"),
        (AdapterSpec(name="toy", decoder_class="model:Model", dialect="hf"), "is for the hf dialect"),
        (spec_for(supported=False, reason="recurrent state"), "marks it unsupported: recurrent state"),
    ],
    ids=["residual-mismatch", "layers-attr-mismatch", "wrong-dialect", "unsupported"],
)
def test_a_spec_that_contradicts_the_source_is_declined(spec: AdapterSpec, reason: str) -> None:
    assert reason in skip_reason(vllm_model(), spec=spec)


def test_spec_capture_hidden_only_captures_the_hidden_stream() -> None:
    result = run_codemod(vllm_model(), spec=spec_for(residual=True, capture="hidden"))
    assert isinstance(result, TransformSuccess)
    assert "self.capture_aux_hidden_state(aux_hidden_states, hidden_states)\n" in result.code


def test_spec_layer_count_key_and_boundary_rule_become_class_attributes() -> None:
    """A Kimi-K3-style spec (ids may not end a non-last stage) is enforced by the class's own plan."""
    spec = spec_for(residual=True, capture="hidden + residual", num_layers_key="n_layers",
                    boundary_rule="reject-at-stage-end")
    result = run_codemod(vllm_model(), spec=spec)
    assert isinstance(result, TransformSuccess)
    assert '    pipespec_num_layers_key = "n_layers"\n    _pipespec_boundary_rule = "reject-at-stage-end"\n' in result.code


def test_make_layers_range_is_kept_under_a_name_the_mixin_checks() -> None:
    code = vllm_model().replace("    def forward", """\
    def __init__(self, config):
        self.start_layer, self.end_layer, self.layers = make_layers(config.num_hidden_layers, Layer)

    def forward""")
    result = run_codemod(code)
    assert isinstance(result, TransformSuccess)
    assert ("        built_start_layer, built_end_layer, self.layers = make_layers(config.num_hidden_layers, Layer)\n"
            "        self.pipespec_built_layer_range = (built_start_layer, built_end_layer)\n") in result.code


# ----------------------------------------------------------------------------------- fixture files
GOLDEN = {"llama_residual": "LlamaStyleModel", "gpt_plain": "GPTStyleModel", "enumerate_scaled": "ScaledModel"}
DECLINED = {"decline_relative_index": ("ScaledModel", "the loop index `i` counts from 0 on every stage"),
            "decline_recurrent": ("CarryModel", "the layer call assigns `hidden_states, residual, carry`")}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_fixture_output_matches_the_committed_golden_file(name: str) -> None:
    """`adapter-gen --check --out` regenerates each fixture and compares with expected/ byte for byte."""
    src, out = FIXTURES / f"{name}.py", FIXTURES / "expected" / f"{name}.py"
    assert adapter_gen_main([str(src), "--class", GOLDEN[name], "--dialect", "pipespec", "--check", "--out", str(out)]) == 0


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_output_is_already_adapted(name: str) -> None:
    """Idempotency on real files: adapting the adapted file is a no-op (status unchanged, same text)."""
    target = load_target(FIXTURES / "expected" / f"{name}.py", GOLDEN[name])
    outcome = adapt_target(target, "pipespec")
    assert outcome.status is AdaptStatus.UNCHANGED and outcome.code == target.code
    assert skip_reason(target.code, GOLDEN[name]).startswith(ALREADY_ADAPTED)


def test_hand_adapted_fixture_is_left_alone() -> None:
    code = (FIXTURES / "already_adapted.py").read_text()
    assert skip_reason(code, "HandAdaptedModel").startswith(ALREADY_ADAPTED)


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_declined_fixture_gives_its_reason(name: str) -> None:
    class_name, reason = DECLINED[name]
    outcome = adapt_target(load_target(FIXTURES / f"{name}.py", class_name), "pipespec")
    assert outcome.status is AdaptStatus.SKIPPED and reason in outcome.reason


# ----------------------------------------------------------------------------------- numbers
def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # our own fixture code (and the codemod's output of it)
    return module


@pytest.fixture(scope="module")
def adapted_modules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ModuleType, ModuleType]]:
    """(original, freshly adapted) module of each golden fixture; the adapted one from the current codemod."""
    out_dir = tmp_path_factory.mktemp("adapted")
    modules = {}
    for name, class_name in GOLDEN.items():
        outcome = adapt_target(load_target(FIXTURES / f"{name}.py", class_name), "pipespec")
        assert outcome.status == "adapted", outcome.reason
        (out_dir / f"{name}.py").write_text(outcome.code)
        modules[name] = (load_module(FIXTURES / f"{name}.py", f"h3_original_{name}"),
                         load_module(out_dir / f"{name}.py", f"h3_adapted_{name}"))
    return modules


CONFIG = toy_vllm.ToyConfig(num_hidden_layers=6)
N = CONFIG.num_hidden_layers


def reference(original: ModuleType, class_name: str, input_ids: torch.Tensor, positions: torch.Tensor):
    """The unadapted model in one piece: state dict, final output, and aux id L for every L (hooks)."""
    torch.manual_seed(0)
    with toy_vllm.pp_group(0, 1):
        model = getattr(original, class_name)(CONFIG).eval()
    layers = model.h if hasattr(model, "h") else model.layers
    stream: dict[int, torch.Tensor] = {}

    def stream_of(out: object) -> torch.Tensor:
        return out[0] + out[1] if isinstance(out, tuple) else out  # type: ignore[index, return-value]

    def before_first(module: torch.nn.Module, args: tuple) -> None:
        hidden, residual = args[1], args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
        stream[0] = hidden if residual is None else hidden + residual

    hooks = [layers[0].register_forward_pre_hook(before_first)]
    hooks += [layer.register_forward_hook(lambda mod, a, out, i=i: stream.__setitem__(i + 1, stream_of(out)))
              for i, layer in enumerate(layers)]
    with torch.no_grad():
        final = model(input_ids, positions, None)
    for hook in hooks:
        hook.remove()
    return model.state_dict(), final, [stream[i] for i in range(N + 1)]


def run_stages(adapted: ModuleType, class_name: str, state: dict, partition: Sequence[int] | None, pp: int,
               ids: Sequence[int], input_ids: torch.Tensor, positions: torch.Tensor):
    """Build each stage as its own process would (only its layers), chain them, return the last output."""
    received = None
    sender = None
    for rank in range(pp):
        with toy_vllm.pp_group(rank, pp, tuple(partition) if partition else None):
            stage = getattr(adapted, class_name)(CONFIG).eval()
        missing, unexpected = stage.load_state_dict({k: v for k, v in state.items() if k in stage.state_dict()}, strict=False)
        assert not missing and not unexpected
        stage.set_pipeline_stage(rank, pp, partition)
        stage.set_aux_hidden_state_layers(ids)
        if rank > 0:
            # what the previous stage sent is exactly its hop (hidden, residual, relayed + own aux keys),
            # and the receive buffers this stage reserves have exactly those keys
            buffers = stage.make_empty_intermediate_tensors(received["hidden_states"].shape[:-1], torch.float32, "cpu")
            assert set(received.keys()) == set(hop_keys(sender.pipespec_stage, stage.pipespec_has_residual))
            assert set(buffers.keys()) == set(received.keys())
            for key in buffers:
                buffers[key].copy_(received[key])
            received = buffers
        with torch.no_grad():
            received = stage(input_ids if rank == 0 else None, positions, received)
        sender = stage
    return received


CASES = [
    (1, None, list(range(N + 1))),
    (2, None, list(range(N + 1))),
    (3, [1, 3, 2], list(range(N + 1))),
    (3, [2, 2, 2], [2, 3, 4]),  # ids on both stage boundaries (2 and 4) belong upstream
    (3, [1, 3, 2], [0, 6]),  # id 0 from stage 0, id N from the last stage, relayed through the middle
    (2, [5, 1], [1, 5]),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(GOLDEN))
@pytest.mark.parametrize(("pp", "partition", "ids"), CASES, ids=[f"P{p}-{part}-{ids}" for p, part, ids in CASES])
def test_pipeline_stages_hand_the_last_stage_the_single_stage_aux_states(adapted_modules, name, pp, partition, ids):
    original, adapted = adapted_modules[name]
    class_name = GOLDEN[name]
    input_ids = torch.tensor([3, 17, 5, 42, 8, 1, 29, 11])
    positions = torch.arange(len(input_ids))
    state, final, stream = reference(original, class_name, input_ids, positions)
    hidden, aux = run_stages(adapted, class_name, state, partition, pp, ids, input_ids, positions)
    torch.testing.assert_close(hidden, final, rtol=1e-5, atol=1e-6)
    assert len(aux) == len(ids)
    for layer_id, got in zip(ids, aux):
        torch.testing.assert_close(got, stream[layer_id], rtol=1e-5, atol=1e-6, msg=lambda m, i=layer_id: f"aux id {i}: {m}")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_without_aux_ids_the_adapted_model_returns_what_the_original_does(adapted_modules, name):
    original, adapted = adapted_modules[name]
    input_ids, positions = torch.tensor([4, 9, 2]), torch.arange(3)
    state, final, _ = reference(original, GOLDEN[name], input_ids, positions)
    out = run_stages(adapted, GOLDEN[name], state, None, 2, [], input_ids, positions)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, final, rtol=1e-5, atol=1e-6)


def test_boundary_rule_from_the_spec_is_enforced_by_the_generated_class(tmp_path):
    """Adapted with a reject-at-stage-end spec, the model refuses an id that ends a non-last stage."""
    spec = spec_for(residual=True, capture="hidden + residual", boundary_rule="reject-at-stage-end")
    outcome = adapt_target(load_target(FIXTURES / "llama_residual.py", "LlamaStyleModel"), "pipespec", spec=spec)
    (tmp_path / "kimi_like.py").write_text(outcome.code)
    module = load_module(tmp_path / "kimi_like.py", "h3_kimi_like")
    with toy_vllm.pp_group(0, 2):
        stage = module.LlamaStyleModel(CONFIG)
    stage.set_pipeline_stage(0, 2)
    with pytest.raises(LayoutError, match="aux layer id 3 ends stage 0"):
        stage.set_aux_hidden_state_layers([2, 3])
    stage.set_aux_hidden_state_layers([2, 4])


def test_a_stage_plan_that_disagrees_with_the_built_layers_is_refused(adapted_modules):
    _, adapted = adapted_modules["llama_residual"]
    with toy_vllm.pp_group(1, 3, (1, 3, 2)):
        stage = adapted.LlamaStyleModel(CONFIG)
    with pytest.raises(LayoutError, match=r"built with layers \[1, 4\) but stage 1 of 3 \(partition \[2, 2, 2\]\) owns \[2, 4\)"):
        stage.set_pipeline_stage(1, 3, [2, 2, 2])
    stage.set_pipeline_stage(1, 3, [1, 3, 2])
    assert (stage.start_layer, stage.end_layer) == (1, 4)
