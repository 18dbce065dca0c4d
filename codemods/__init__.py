"""libcst codemods that adapt model forwards for aux hidden states over PP (see docs/codemods.md).

One codemod a file, each with its analysis beside it:

* ``adapt_vllm_native`` (``adapt_vllm_module``): the ``vllm`` dialect, vLLM's own EAGLE3-over-PP contract;
  what it reads is ``vllm_native_shape`` (entry point) and the other ``vllm_native_*`` modules.
* ``adapt_vllm_forward`` (``AdaptVllmForwardCommand``): the ``pipespec`` dialect, vLLM-style source on
  pipespec's runtime; what it reads is ``vllm_forward_shape``.
* ``adapt_hf_stage_forward`` (``AdaptHFStageForwardCommand``): the ``hf`` dialect, HF transformers
  modeling code; what it reads is ``hf_forward_shape`` (entry point) with ``hf_layer_loop``,
  ``hf_first_stage``, ``hf_stage_boundary``, ``hf_names`` and ``hf_decline``.
* shared: ``scope`` (a function's own code for visitors and transformers), ``import_edits`` (isort-style
  import edits).

Every module here parses source only: none imports torch, transformers or vllm, or runs what it reads
(``tests/test_security.py``). From pipespec they import only ``pipespec.contract``, ``pipespec.errors``,
``pipespec.str_enum`` (their statuses) and the version string.
"""
