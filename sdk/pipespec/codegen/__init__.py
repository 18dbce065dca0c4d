"""The ``adapter-gen`` runner: source file → adapted source, through the dialect's libcst codemod.

One function per step, so the CLI, tests and other tools compose them, each step in its own module:

* ``source`` — ``load_target`` reads a file (or, for ``--hf MODEL_TYPE``, ``load_hf_target`` the installed
  transformers modeling module) and parses it; a syntax error is a ``UsageError`` naming file and line;
* ``decide`` — ``detect_dialect`` tells vLLM-style from HF-style code by the decoder's ``forward``
  signature; ``vllm_contract_source`` finds the vLLM a file is adapted for and refuses one older than 0.32;
  ``resolve_spec`` picks the adapter spec: ``--spec FILE``, else the registry, else inferred;
* ``transform`` — ``adapt_target`` runs the dialect's codemod (``vllm``: ``adapt_vllm_module``;
  ``pipespec``: ``AdaptVllmForwardCommand``; ``hf``: ``AdaptHFStageForwardCommand``) and stamps the
  module header naming source, spec and generator version;
* ``write`` — ``unified_diff`` and ``write_atomic`` (temp file in the same directory + ``os.replace``: a
  failure leaves the original byte-identical) produce the output;
* ``scaffold`` — ``adapter-gen new MODEL_TYPE``: a new adapter's spec and test from jinja2 templates.

Nothing here imports or executes the code it adapts, nor torch or vLLM at import time; only ``--hf`` and
``new`` import the installed transformers, to find which module and class a model type uses.
"""

from __future__ import annotations

from pipespec.atomic_write import write_atomic
from pipespec.codegen.decide import (
    VLLM_CONTRACT,
    detect_dialect,
    detect_module_dialect,
    is_adapted,
    resolve_spec,
    spec_label,
    vllm_contract_source,
)
from pipespec.codegen.scaffold import TINY, Scaffold, scaffold_adapter, tiny_config_kwargs
from pipespec.codegen.source import (
    Target,
    class_names,
    find_class,
    load_hf_target,
    load_target,
    parse_source,
    project_label,
    read_text,
)
from pipespec.codegen.transform import HEADER_FIRST, Outcome, absolutize_imports, adapt_target, stamp_header
from pipespec.codegen.write import unified_diff

__all__ = [
    "HEADER_FIRST",
    "TINY",
    "VLLM_CONTRACT",
    "Outcome",
    "Scaffold",
    "Target",
    "absolutize_imports",
    "adapt_target",
    "class_names",
    "detect_dialect",
    "detect_module_dialect",
    "find_class",
    "is_adapted",
    "load_hf_target",
    "load_target",
    "parse_source",
    "project_label",
    "read_text",
    "resolve_spec",
    "scaffold_adapter",
    "spec_label",
    "stamp_header",
    "tiny_config_kwargs",
    "unified_diff",
    "vllm_contract_source",
    "write_atomic",
]
