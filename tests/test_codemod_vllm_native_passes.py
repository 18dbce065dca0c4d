"""The vLLM-native codemod pass by pass (``codemods/vllm_native_passes.py``), as examples.

Fixit's style: each pass has ``VALID`` examples (the pass finds the decoder as it is, or leaves it alone)
and ``INVALID`` ones (what it decides or writes instead), small vLLM-style modules run through the passes
up to the one under test, its effect read off the run's state in the ``CodemodContext``. The whole
rewrite of real vLLM files is tests/test_codemod_vllm_native.py; here each concern stands alone.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from pipespec.codemods.adapt_vllm_native import adapt_vllm_module
from pipespec.codemods.vllm_native_branches import Branches
from pipespec.codemods.vllm_native_loop import ForwardPlan
from pipespec.codemods.vllm_native_names import flat_source_of, source_of
from pipespec.codemods.vllm_native_passes import (
    PASSES,
    RUN,
    AddContractImportsCommand,
    DecoderRun,
    FindDecodersCommand,
    JudgeDecodersCommand,
    NativePass,
    NativeRun,
    PlanForwardCommand,
    ReadResidualHandoffCommand,
    ReplaceClassesCommand,
    RewriteDecodersCommand,
    RewriteHoldersCommand,
    StampHeaderCommand,
    run_passes,
)
from pipespec.codemods.vllm_native_qualified import VllmNames
from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import UsageError

MODULE = '''\
from itertools import islice

from torch import nn

from vllm.distributed import get_pp_group
from vllm.sequence import IntermediateTensors

from .interfaces import SupportsPP


class ToyLayer(nn.Module):
    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class ToyModel(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.start_layer, self.end_layer, self.layers = make_layers(4, lambda prefix: ToyLayer(prefix), prefix)

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class ToyForCausalLM(nn.Module, SupportsPP):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.model = ToyModel(vllm_config=vllm_config, prefix=prefix)
'''

LOOP = "        for layer in islice(self.layers, self.start_layer, self.end_layer):\n"
NONLAST = '            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})\n'
FLAG_TRUE = "class ToyModel(nn.Module):\n    supports_aux_hidden_states_over_pp = True\n"
CONTRACT_FORWARD = (
    "        remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)\n" + LOOP,
    NONLAST.replace('"residual": residual}', '"residual": residual, **self.pack_local_aux_hidden_states([])}'),
)


def _edit(*changes: tuple[str, str]) -> str:
    code = MODULE
    for old, new in changes:
        assert old in code, old
        code = code.replace(old, new, 1)
    return code


def _run(code: str, upto: type[NativePass], **options: object) -> NativeRun:
    """The run's state after the passes up to and including ``upto``."""
    run = NativeRun(cst.parse_module(code), code, "toy.py", lambda dotted: None, **options)  # type: ignore[arg-type]
    _, context = run_passes(run, PASSES[: PASSES.index(upto) + 1])
    assert context.scratch[RUN] is run
    return run


def _only(run: NativeRun) -> DecoderRun:
    assert [d.name for d in run.decoders] == ["ToyModel"]
    return run.decoders[0]


def test_passes_run_in_the_documented_order_each_with_a_one_line_description() -> None:
    """The order adapt_vllm_module runs them in; every pass says what it does in one line."""
    assert [p.__name__ for p in PASSES] == [
        "FindDecodersCommand", "JudgeDecodersCommand", "PlanForwardCommand", "ReadResidualHandoffCommand",
        "RewriteDecodersCommand", "RewriteHoldersCommand", "ReplaceClassesCommand", "AddContractImportsCommand",
        "StampHeaderCommand"]
    for p in PASSES:
        assert p.DESCRIPTION and "\n" not in p.DESCRIPTION and p.DESCRIPTION.endswith("."), p.__name__


# ------------------------------------------------------------------------------------------- find decoders
FIND_VALID: dict[str, tuple[str, dict[str, object], list[tuple[str, list[tuple[str, str]]]]]] = {
    "a decoder and its causal LM": (MODULE, {}, [("ToyModel", [("ToyForCausalLM", "model")])]),
    "--class names the holder": (MODULE, {"classes": ["ToyForCausalLM"]}, [("ToyModel", [("ToyForCausalLM", "model")])]),
    "a decoder nothing holds": (_edit(("        self.model = ToyModel(", "        self.inner = Other(")), {}, [("ToyModel", [])]),
    "a range loop over self.layers[i]": (_edit(
        (LOOP, "        for i in range(self.start_layer, self.end_layer):\n"),
        ("            hidden_states, residual = layer(", "            hidden_states, residual = self.layers[i]("),
    ), {}, [("ToyModel", [("ToyForCausalLM", "model")])]),
}
FIND_INVALID: dict[str, tuple[str, dict[str, object], str]] = {
    "no intermediate_tensors": (_edit(("positions, intermediate_tensors, inputs_embeds", "positions, inputs_embeds")), {},
                                "toy.py: no PP decoder here"),
    "a loop over every layer": (_edit((LOOP, "        for layer in self.layers:\n")), {}, "toy.py: no PP decoder here"),
    "--class names no class": (MODULE, {"classes": ["Toy"]},
                               "no top-level class 'Toy' (classes here: ToyLayer, ToyModel, ToyForCausalLM)"),
    "--class names the layer": (MODULE, {"classes": ["ToyLayer"]},
                                "class 'ToyLayer' is neither a PP decoder nor a class holding one (PP decoders here: ToyModel)"),
    "an unknown residual rule": (MODULE, {"rule": "maybe"}, "residual rule 'maybe' is unknown: use one of"),
}


@pytest.mark.parametrize("case", FIND_VALID)
def test_find_decoders_valid(case: str) -> None:
    code, options, expected = FIND_VALID[case]
    run = _run(code, FindDecodersCommand, **options)
    assert [(d.name, [(h.cls.name.value, h.attr) for h in d.holders]) for d in run.decoders] == expected
    assert all(d.status is None for d in run.decoders)  # found, not judged yet


@pytest.mark.parametrize("case", FIND_INVALID)
def test_find_decoders_invalid(case: str) -> None:
    code, options, fragment = FIND_INVALID[case]
    with pytest.raises(UsageError) as err:
        _run(code, FindDecodersCommand, **options)
    assert fragment in str(err.value)


# ------------------------------------------------------------------------------------------------- judge
JUDGE: dict[str, tuple[str, DecoderStatus, str]] = {
    "VALID: captures nothing yet": (MODULE, DecoderStatus.ADAPTED, ""),
    "VALID: flag True over a forward that does not collect": (
        _edit(("class ToyModel(nn.Module):\n", FLAG_TRUE)), DecoderStatus.ADAPTED, ""),
    "INVALID: already follows the contract": (
        _edit(("class ToyModel(nn.Module):\n", FLAG_TRUE), (LOOP, CONTRACT_FORWARD[0]), (NONLAST, CONTRACT_FORWARD[1])),
        DecoderStatus.UNCHANGED, "already follows vLLM's contract: it sets supports_aux_hidden_states_over_pp = True itself"),
    "INVALID: an opt-out by hand": (
        _edit(("class ToyModel(nn.Module):\n", "class ToyModel(nn.Module):\n    supports_aux_hidden_states_over_pp = False\n")),
        DecoderStatus.DECLINED, "line 22: ToyModel opts out by hand: `supports_aux_hidden_states_over_pp = False`"),
    "INVALID: collects and packs with no flag anywhere": (
        _edit((LOOP, CONTRACT_FORWARD[0]), (NONLAST, CONTRACT_FORWARD[1])), DecoderStatus.DECLINED,
        "but ToyModel does not set supports_aux_hidden_states_over_pp and no base class sets it"),
}


@pytest.mark.parametrize("case", JUDGE)
def test_judge_decoders(case: str) -> None:
    code, status, reason = JUDGE[case]
    dec = _only(_run(code, JudgeDecodersCommand))
    assert dec.status is status
    assert reason in dec.reason if reason else dec.reason == ""


# ---------------------------------------------------------------------------------- plan: loop + captures
PLAN: dict[str, tuple[str, str | None]] = {  # case -> (module, the aux id after a layer | None: declined)
    "VALID: islice made enumerate": (MODULE, "idx + 1"),
    "VALID: enumerate from start_layer": (_edit((LOOP, "        for i, layer in enumerate(\n"
                                                  "            islice(self.layers, self.start_layer, self.end_layer),"
                                                  " start=self.start_layer\n        ):\n")), "i + 1"),
    "VALID: enumerate counting from 0 on every stage": (
        _edit((LOOP, "        for i, layer in enumerate(self.layers[self.start_layer : self.end_layer]):\n")),
        "self.start_layer + i + 1"),
    "INVALID: a hand-off that is not IntermediateTensors({...})": (
        _edit((NONLAST, "            return self.pack(hidden_states, residual)\n")), None),
    "INVALID: a second loop over the stage's layers": (
        _edit(("        if not get_pp_group().is_last_rank:\n",
               LOOP + "            hidden_states = layer.refine(hidden_states)\n"
               "        if not get_pp_group().is_last_rank:\n")), None),
}


@pytest.mark.parametrize("case", PLAN)
def test_plan_forward(case: str) -> None:
    code, next_id = PLAN[case]
    dec = _only(_run(code, PlanForwardCommand))
    if next_id is None:
        assert dec.status is DecoderStatus.DECLINED and dec.reason.startswith("line "), dec.reason
        assert dec.plan is None
        return
    assert dec.status is DecoderStatus.ADAPTED and isinstance(dec.plan, ForwardPlan)
    assert flat_source_of(dec.plan.loop.next_id) == next_id
    assert (dec.plan.hidden, dec.plan.residual) == ("hidden_states", "residual")


def test_plan_forward_one_loop_per_config_branch() -> None:
    """Two loops, each in a config branch that ends in its return: one plan per branch."""
    body = LOOP + "            hidden_states, residual = layer(positions, hidden_states, residual)\n"
    code = _edit((body, "        if self.fast:\n" + textwrap.indent(body, "    ")
                  + "            if not get_pp_group().is_last_rank:\n    " + NONLAST
                  + "            return hidden_states\n" + body))
    dec = _only(_run(code, PlanForwardCommand))
    assert dec.status is DecoderStatus.ADAPTED and isinstance(dec.plan, Branches)
    assert len(dec.plan.plans) == 2


# ------------------------------------------------------------------------------------ residual hand-off
REBINDS = ("        if residual is None:\n            residual = hidden_states\n"
           "            hidden_states = self.input_layernorm(hidden_states)\n"
           "        else:\n            hidden_states, residual = self.input_layernorm(hidden_states, residual)\n",
           "        residual = hidden_states\n        hidden_states = self.input_layernorm(hidden_states)\n")
RESIDUAL: dict[str, tuple[str, dict[str, object], bool | None]] = {  # -> the plan's stale_residual (None: declined)
    "VALID: the layer reads the residual it is given": (MODULE, {}, False),
    "INVALID: the layer rebinds it first (post-norm)": (_edit(REBINDS), {}, True),
    "INVALID: a stated rule the layer classes contradict": (MODULE, {"rule": "rebinds"}, None),
    "VALID: layer classes that cannot be found, rule stated": (
        _edit(("lambda prefix: ToyLayer(prefix)", "layer_factory")), {"rule": "rebinds"}, True),
    "INVALID: layer classes that cannot be found, no rule": (
        _edit(("lambda prefix: ToyLayer(prefix)", "layer_factory")), {}, None),
}


@pytest.mark.parametrize("case", RESIDUAL)
def test_read_residual_handoff(case: str) -> None:
    code, options, stale = RESIDUAL[case]
    before = _only(_run(code, PlanForwardCommand, **options))
    assert isinstance(before.plan, ForwardPlan) and not before.plan.stale_residual  # the plan alone does not know
    dec = _only(_run(code, ReadResidualHandoffCommand, **options))
    if stale is None:
        assert dec.status is DecoderStatus.DECLINED and "residual" in dec.reason, dec.reason
        return
    assert dec.status is DecoderStatus.ADAPTED and isinstance(dec.plan, ForwardPlan), dec.reason
    assert dec.plan.stale_residual is stale


# ------------------------------------------------------------------------- rewrite decoders and holders
def test_rewrite_decoders_writes_the_contract_on_the_decoder_only() -> None:
    """The decoder's rewrite is kept on its run; nothing replaces a class of the module yet."""
    run = _run(MODULE, RewriteDecodersCommand)
    dec = _only(run)
    assert dec.rewritten is not None and run.replace == {}
    text = source_of(dec.rewritten).lstrip("\n")  # its leading blank lines are the original's
    assert text.startswith("class ToyModel(nn.Module, EagleModelMixin):\n    supports_aux_hidden_states_over_pp = True\n")
    for call in ("self.collect_remote_aux_hidden_states(intermediate_tensors)", "**self.pack_local_aux_hidden_states(",
                 "self._maybe_add_hidden_state(", "for idx, layer in enumerate("):
        assert call in text, call
    assert dec.imports == {"EagleModelMixin"}


def test_rewrite_decoders_declines_a_spec_that_disagrees_with_the_source() -> None:
    spec = AdapterSpec(name="toy", decoder_class="toy:ToyModel", dialect="vllm", layers_attr="blocks")
    dec = _only(_run(MODULE, RewriteDecodersCommand, spec=spec))
    assert dec.status is DecoderStatus.DECLINED and dec.rewritten is None
    assert "the loop runs self.layers but spec toy" in dec.reason and "model.layers_attr = 'blocks'" in dec.reason


HOLDERS: dict[str, tuple[str, str]] = {  # -> the holder's first line after the pass
    "INVALID: a causal LM without SupportsEagle3": (MODULE, "class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):"),
    "VALID: a causal LM that has it": (
        _edit(("class ToyForCausalLM(nn.Module, SupportsPP):", "class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):")),
        "class ToyForCausalLM(nn.Module, SupportsPP, SupportsEagle3):"),
}


@pytest.mark.parametrize("case", HOLDERS)
def test_rewrite_holders(case: str) -> None:
    code, first_line = HOLDERS[case]
    run = _run(code, RewriteHoldersCommand)
    dec = _only(run)
    holder = dec.holders[0].cls
    assert source_of(run.replace[holder]).lstrip("\n").splitlines()[0] == first_line
    assert run.replace[dec.cls] is dec.rewritten
    assert run.adapted_names == ["ToyModel", "ToyForCausalLM"]
    assert ("SupportsEagle3" in run.needed) is case.startswith("INVALID")


# --------------------------------------------------------------------------- module: replace, imports, header
def _module_after(code: str, upto: type[NativePass]) -> str:
    run = NativeRun(cst.parse_module(code), code, "toy.py", lambda dotted: None)
    tree, _ = run_passes(run, PASSES[: PASSES.index(upto) + 1])
    return tree.code


def test_replace_classes_puts_the_rewrites_in_place_and_nothing_else() -> None:
    out = _module_after(MODULE, ReplaceClassesCommand)
    assert out.startswith(MODULE[: MODULE.index("class ToyModel")])  # imports and the layer class as they were
    assert "class ToyModel(nn.Module, EagleModelMixin):" in out and "from .interfaces import SupportsPP\n" in out


IMPORTS: dict[str, tuple[str, str]] = {  # the file's own interfaces import -> the same line after the pass
    "INVALID: names merged, sorted": ("from .interfaces import SupportsPP\n",
                                      "from .interfaces import EagleModelMixin, SupportsEagle3, SupportsPP\n"),
    "INVALID: wrapped where the line grows past 88": (
        "from .interfaces import SupportsLoRA, SupportsMultiModal, SupportsPP, SupportsQuant\n",
        "from .interfaces import (\n    EagleModelMixin,\n    SupportsEagle3,\n    SupportsLoRA,\n"
        "    SupportsMultiModal,\n    SupportsPP,\n    SupportsQuant,\n)\n"),
    "VALID: already imported": ("from .interfaces import EagleModelMixin, SupportsEagle3, SupportsPP\n",
                                "from .interfaces import EagleModelMixin, SupportsEagle3, SupportsPP\n"),
}


@pytest.mark.parametrize("case", IMPORTS)
def test_add_contract_imports(case: str) -> None:
    line, after = IMPORTS[case]
    code = _edit(("from .interfaces import SupportsPP\n", line))
    before = _module_after(code, ReplaceClassesCommand)
    out = _module_after(code, AddContractImportsCommand)
    assert out == before.replace(line, after)


def test_stamp_header_once_after_the_files_own_leading_comments() -> None:
    code = "# SPDX-License-Identifier: Apache-2.0\n\n" + MODULE
    out = _module_after(code, StampHeaderCommand)
    assert out.startswith("# SPDX-License-Identifier: Apache-2.0\n\n"
                          "# Generated by pipespec (adapt_vllm_native v2) from toy.py.\n"
                          "# Adapted to vLLM's EAGLE3-over-PP contract (EagleModelMixin, SupportsEagle3):\n"
                          "# ToyModel, ToyForCausalLM.\n"
                          "# Do not edit those classes by hand; regenerate them with\n"
                          "#     adapter-gen toy.py --dialect vllm\n\nfrom itertools import islice\n")
    assert adapt_vllm_module(out, label="toy.py").code == out  # the output is a fixed point


def test_nothing_adapted_leaves_the_module_untouched_by_every_module_pass() -> None:
    code = JUDGE["INVALID: an opt-out by hand"][0]
    run = NativeRun(cst.parse_module(code), code, "toy.py", lambda dotted: None)
    tree, _ = run_passes(run)
    assert run.replace == {} and tree.code == code



# ------------------------------------------------------------------- vLLM's names, by what they are bound to
NAMES: dict[str, tuple[str, str, frozenset[str]]] = {  # case -> (imports, vLLM's name, the file's names for it)
    "VALID: imported where vLLM defines it": ("from vllm.sequence import IntermediateTensors\n",
                                              "IntermediateTensors", frozenset({"IntermediateTensors"})),
    "VALID: under an alias": ("from vllm.sequence import IntermediateTensors as IT\n",
                              "IntermediateTensors", frozenset({"IT"})),
    "VALID: vLLM's re-export, relative": ("from .utils import IntermediateTensors\n",
                                          "IntermediateTensors", frozenset({"IntermediateTensors"})),
    "VALID: bound to nothing (a snippet)": ("import torch\n", "get_pp_group", frozenset({"get_pp_group"})),
    "INVALID: the same spelling from another package": ("from mypkg.tensors import IntermediateTensors\n",
                                                        "IntermediateTensors", frozenset()),
    "INVALID: a class of the file": ("class PPMissingLayer:\n    pass\n", "PPMissingLayer", frozenset()),
}


@pytest.mark.parametrize("case", NAMES)
def test_vllm_names_are_read_from_the_files_imports(case: str) -> None:
    code, name, expected = NAMES[case]
    assert VllmNames.of(cst.parse_module(code)).spellings(name) == expected


def test_an_aliased_intermediate_tensors_is_the_non_last_hand_off() -> None:
    """``IT({...})`` is vLLM's IntermediateTensors when the file imports it so: the decoder is planned and adapted."""
    code = _edit(("from vllm.sequence import IntermediateTensors\n", "from vllm.sequence import IntermediateTensors as IT\n"),
                 (NONLAST, NONLAST.replace("IntermediateTensors(", "IT(")))
    dec = _only(_run(code, PlanForwardCommand))
    assert dec.status is DecoderStatus.ADAPTED and isinstance(dec.plan, ForwardPlan)
    assert [flat_source_of(r) for r in dec.plan.nonlast] == [NONLAST.strip().replace("IntermediateTensors(", "IT(")]


def test_a_look_alike_intermediate_tensors_is_not_the_hand_off() -> None:
    """The spelling alone is not enough: a file's own IntermediateTensors is not what vLLM's runner sends on."""
    code = _edit(("from vllm.sequence import IntermediateTensors\n", "from mypkg.tensors import IntermediateTensors\n"))
    dec = _only(_run(code, PlanForwardCommand))
    assert dec.status is DecoderStatus.DECLINED
    assert "forward never returns IntermediateTensors({...}) for non-last ranks" in dec.reason


def test_an_aliased_mixin_is_not_added_twice() -> None:
    """A decoder that already inherits vLLM's EagleModelMixin under another name keeps its bases and imports."""
    code = _edit(("from .interfaces import SupportsPP\n", "from .interfaces import EagleModelMixin as Mixin, SupportsPP\n"),
                 ("class ToyModel(nn.Module):\n", "class ToyModel(nn.Module, Mixin):\n"))
    run = _run(code, RewriteDecodersCommand)
    dec = _only(run)
    assert dec.rewritten is not None
    assert source_of(dec.rewritten).lstrip("\n").startswith("class ToyModel(nn.Module, Mixin):\n")
    assert dec.imports == set()
