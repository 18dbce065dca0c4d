"""Integrations: pipespec's contract plugged into the engines people serve with.

``pipespec.integrations.vllm`` runs inside vLLM (its CPU or GPU build, >= 0.32): the vLLM-native
verifier, the zoo over vLLM's decoders and the general plugin. Nothing below ``pipespec.integrations``
is imported by the contract layers (spec, layout, registry, verify, mixin) or by the reference engine.
"""
