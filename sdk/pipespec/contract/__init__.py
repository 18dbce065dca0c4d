"""The contract: what an aux id means, which stage produces which slot, and what a model must do.

``names`` (the flag, key prefix and attribute names, each spelled once) → ``spec`` (adapter specs) →
``layout`` (pure arithmetic: partitions, producers, slots, keys) → ``intermediate`` (the named tensors
between stages) → ``mixin`` / ``verify`` / ``registry`` / ``decorator`` / ``embed`` (what an adapted
model calls, what is refused, where specs come from).
Nothing here imports the integrations, the engine or the CLI.
"""
