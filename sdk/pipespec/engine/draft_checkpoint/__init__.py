"""EAGLE3 draft checkpoints: detect the format, read the aux ids in the right convention, validate, load, save.

Modules: ``formats`` (Format A/B: detection, tensor names, the config fields each reads and writes),
``conventions`` (aux-id conventions and their resolution), ``files`` (config.json, weight files, headers,
tensors), ``info`` (``TargetInfo``, ``DraftCheckpointInfo``, ``LoadedDraft``), ``read``
(``inspect_draft_checkpoint``), ``vocab`` (``d2t``/``t2d``), ``load`` (``load_draft_checkpoint``), ``write``
(``save_draft_checkpoint``). Imports the draft model, torch, safetensors and ``pipespec.contract``; must not
import the engine's loop, ``pipespec.pp`` or vllm.

Two on-disk formats exist in the wild (docs/draft-formats.md has the full field tables):

* **Format A** — EAGLE reference, SpecForge, ModelOpt: ``architectures`` ``LlamaForCausalLMEagle3``
  (vLLM also accepts ``Eagle3LlamaForCausalLM``), a flat Llama config, tensors ``fc``, ``midlayer.*``,
  ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``; aux ids in
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, which SpecForge and ModelOpt write in the
  *output-of-layer* convention (id j = output of layer j = input-index j + 1).
* **Format B** — speculators: ``architectures`` ``Eagle3Speculator``, ``layers.0.*`` instead of
  ``midlayer.*``, the layer's config under ``transformer_layer_config``, top-level
  ``eagle_aux_hidden_state_layer_ids`` in the *input-index* convention, ``speculators_config``.

The convention is never guessed silently: ``aux_convention`` is an explicit setting whose default is
documented per format (A → ``output``, B → ``input``) and whose value and source are returned so the
engine prints them in every run. With no ids in the config the EAGLE3 default ``(2, N//2, N-3)``
(input-index, as the EAGLE reference hard-codes them) is used, with a warning.

Two entry points, because under PP every stage needs the aux ids but only the last one needs weights:
``inspect_draft_checkpoint`` reads config.json and tensor *headers* only; ``load_draft_checkpoint``
materialises the draft on the last stage.
"""

from pipespec.engine.draft_checkpoint.conventions import DEFAULT_CONVENTION, AuxConvention, to_input_index
from pipespec.engine.draft_checkpoint.formats import (
    ARCHITECTURES_A,
    ARCHITECTURES_B,
    DraftFormat,
    detect_draft_format,
)
from pipespec.engine.draft_checkpoint.info import DraftCheckpointInfo, LoadedDraft, TargetInfo
from pipespec.engine.draft_checkpoint.load import load_draft_checkpoint
from pipespec.engine.draft_checkpoint.read import inspect_draft_checkpoint
from pipespec.engine.draft_checkpoint.write import save_draft_checkpoint

__all__ = [
    "ARCHITECTURES_A",
    "ARCHITECTURES_B",
    "DEFAULT_CONVENTION",
    "AuxConvention",
    "DraftCheckpointInfo",
    "DraftFormat",
    "LoadedDraft",
    "TargetInfo",
    "detect_draft_format",
    "inspect_draft_checkpoint",
    "load_draft_checkpoint",
    "save_draft_checkpoint",
    "to_input_index",
]
