"""The ``adapter-gen`` runner: source file → adapted source, through the dialect's libcst codemod.

One function per step, so the CLI, tests and other tools compose them, each step in its own module
(import each name from its module; this package re-exports nothing):

* ``source`` — ``load_target`` reads a file (or, for ``--hf MODEL_TYPE``, ``load_hf_target`` the installed
  transformers modeling module) and parses it; a syntax error is a ``UsageError`` naming file and line;
* ``decide`` — ``detect_dialect`` tells vLLM-style from HF-style code by the decoder's ``forward``
  signature; ``vllm_contract_source`` finds the vLLM a file is adapted for and refuses one older than 0.32;
  ``resolve_spec`` picks the adapter spec: ``--spec FILE``, else the registry, else inferred;
* ``transform`` — ``adapt_target`` runs the dialect's codemod (``vllm``: ``adapt_vllm_module``;
  ``pipespec``: ``AdaptVllmForwardCommand``; ``hf``: ``AdaptHFStageForwardCommand``) and stamps the
  module header naming source, spec and generator version;
* ``write`` — ``unified_diff``; with ``pipespec.atomic_write.write_atomic`` (temp file in the same directory +
  ``os.replace``: a failure leaves the original byte-identical) it produces the output;
* ``scaffold`` — ``adapter-gen new MODEL_TYPE``: a new adapter's spec and test from jinja2 templates.

Nothing here imports or executes the code it adapts, nor torch or vLLM at import time; only ``--hf`` and
``new`` import the installed transformers, to find which module and class a model type uses.
"""
