"""Adapt vLLM model files to vLLM's own EAGLE3-over-PP contract (vLLM >= 0.32), as its llama.py does.

``adapt_vllm_module(code, label=...)`` rewrites every PP decoder stack in a vLLM model file (or the ones
named) so that it runs in vLLM unchanged:

* the decoder inherits vLLM's ``EagleModelMixin`` and sets ``supports_aux_hidden_states_over_pp = True``
  on itself (plus ``pipespec_generated_by``, a plain string naming source, generator and version);
* ``forward`` calls ``collect_remote_aux_hidden_states(intermediate_tensors)`` before the layer loop,
  captures id ``self.start_layer`` on the first rank and ``idx + 1`` (global index) after each layer with
  ``_maybe_add_hidden_state``, packs ``**self.pack_local_aux_hidden_states(aux)`` into the non-last
  ``IntermediateTensors`` and returns ``(hidden, remote + local)`` on the last rank when there are any;
  an existing PP=1-only capture is replaced by this one; ``get_pp_group()`` rank checks stay;
* an embedding built on the first rank only is also built where ``spec_decode_needs_target_embed``
  says (the last rank, for an EAGLE drafter), and is reachable as ``embed_tokens`` for vLLM's drafter;
* the ``*ForCausalLM`` classes holding the decoder get ``SupportsEagle3`` and, where vLLM's protocol
  defaults cannot find the decoder (not at ``.model``), ``set_aux_hidden_state_layers`` /
  ``get_eagle3_default_aux_hidden_state_layers`` and a ``model`` property.

Files already PP-correct come back byte-identical (status ``unchanged``); a decoder this cannot rewrite
safely is ``declined`` with the construct and its line. Running on its own output changes nothing. The
generated code imports only vLLM and torch. The work is done by the passes of ``vllm_native_passes``
(one libcst ``Codemod`` per concern, ``PASSES`` in order), which share one ``CodemodContext``. This module
parses source only: it never imports vLLM nor
executes the code it reads.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

import libcst as cst

from pipespec.codemods.vllm_native_index import ModuleReader, default_reader
from pipespec.codemods.vllm_native_names import GENERATOR, GENERATOR_VERSION, PP_DECODER
from pipespec.codemods.vllm_native_passes import DecoderRun, NativeRun, run_passes
from pipespec.codemods.vllm_native_status import DecoderStatus
from pipespec.contract.spec import AdapterSpec
from pipespec.errors import UsageError


@dataclass(frozen=True)
class DecoderOutcome:
    """What happened to one decoder stack of the file."""

    class_name: str
    status: DecoderStatus
    reason: str  # "" when adapted; for declined: the construct and its line ("line 412: ...")
    causal_lm: tuple[str, ...]  # top-level classes of the file that hold this decoder
    decoder_attr: str | None  # the attribute of the *ForCausalLM holding it ("model", "transformer", ...)


@dataclass(frozen=True)
class VllmAdaptation:
    """The new module source (== the input byte for byte when nothing was adapted) and each decoder's fate."""

    code: str
    decoders: tuple[DecoderOutcome, ...]



def adapt_vllm_module(code: str, *, label: str, classes: Sequence[str] | None = None,
                      spec: AdapterSpec | None = None, absolute_imports: bool | None = None,
                      read_module: ModuleReader | None = None, residual_rule: str | None = None) -> VllmAdaptation:
    """Rewrite the PP decoders of one vLLM model file to vLLM's EAGLE3-over-PP contract.

    ``classes`` names decoders or the ``*ForCausalLM`` classes holding them (default: every PP decoder).
    ``absolute_imports``: the imports it adds are ``vllm.model_executor.models.*`` (True), ``.interfaces``
    style (False), or follow the file (None). Raises ``UsageError`` for a file without a PP decoder or an
    unknown class. ``read_module(dotted)`` returns the source of a module the file imports from
    (``"qwen3_moe"`` for ``from .qwen3_moe import``, or ``"vllm.model_executor.models.qwen3_moe"``), or
    None; it is how a layer class defined elsewhere is read. Default: the file's siblings where ``label``
    is a path, else the installed vLLM's source where ``label`` is a path inside it (``vllm/...``); pass
    ``ModuleSources(path)`` to resolve from a file's real place (its package, the vLLM tree it is in).
    ``residual_rule`` (``"reads"`` | ``"rebinds"``, else the spec's ``residual_rule``) says whether a layer
    reads the residual it is given, where the layer classes cannot be found from the source.
    Example::

        out = adapt_vllm_module(Path("gemma2.py").read_text(), label="gemma2.py")
        [(d.class_name, d.status) for d in out.decoders]   # [("Gemma2Model", DecoderStatus.ADAPTED)]
    """
    if "intermediate_tensors" not in code:  # no forward can take it: skip libcst's (slow) parse
        try:
            tree = ast.parse(code)
        except SyntaxError:
            pass  # libcst's parse below words the error
        else:
            present = ", ".join(s.name for s in tree.body if isinstance(s, ast.ClassDef)) or "none"
            raise UsageError(f"{label}: no PP decoder here ({PP_DECODER}; classes here: {present}); "
                             "pass a vLLM model file with one")
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        raise UsageError(f"{label}:{exc.raw_line}: cannot parse this source: {exc.message}; adapter-gen reads valid Python only") from None
    run = NativeRun(module, code, label, read_module if read_module is not None else default_reader(label),
                    classes=classes, spec=spec, absolute_imports=absolute_imports,
                    rule=residual_rule if residual_rule is not None else (spec.residual_rule if spec is not None else None))
    new_module, _ = run_passes(run)  # vllm_native_passes.PASSES, in order
    return VllmAdaptation(new_module.code if run.replace else code, tuple(_outcome(d) for d in run.decoders))


def _outcome(dec: DecoderRun) -> DecoderOutcome:
    assert dec.status is not None, f"{dec.name} was never judged"  # JudgeDecodersCommand judges every decoder
    return DecoderOutcome(dec.name, dec.status, "" if dec.status is DecoderStatus.ADAPTED else dec.reason,
                          tuple(h.cls.name.value for h in dec.holders), dec.holders[0].attr if dec.holders else None)


__all__ = ["DecoderOutcome", "VllmAdaptation", "adapt_vllm_module", "GENERATOR", "GENERATOR_VERSION"]
