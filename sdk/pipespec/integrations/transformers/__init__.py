"""pipespec for HF transformers models: runtime adaptation of installed classes, spec inference, the
per-stage KV cache, and the zoo over every causal-LM type of the installed transformers.

Imports point down to ``pipespec.contract`` and ``pipespec.codemods``; nothing here imports vllm or
the reference engine.
"""
