"""The reference engine: EAGLE3 speculative decoding over a pipeline of stage processes.

``python -m pipespec.engine ...`` (the same flags as ``pipespec generate``) runs one stage per process
under ``torchrun``; ``pipespec generate`` starts the stage processes itself. How a step flows and the
packed message layouts: docs/engine.md.

Where things live: ``worker`` (``stage_main``, a stage process phase after phase) and ``stage/`` (the
phases: settings, loading, rounds, drafting, captures, runner, stats); ``target`` (the stage's target
layers), ``job`` (what every stage is told), ``step`` (the round message), ``microbatch`` (the
schedule), ``row_batch`` (a micro-batch's rows in one KV cache), ``spec_policy`` (drafting or plain per
round), ``phases`` (timing); ``draft/`` (the EAGLE3 draft) and ``draft_checkpoint/`` (its Format A/B
checkpoints); ``slot_cache``, ``cuda_graphs``, ``draft_graph`` (fixed buffers and CUDA graphs);
``tiny_checkpoints`` and ``reference`` (tiny checkpoints and the single-process oracle for tests, the
demo and benchmarks). The engine sits above the contract, the integrations and ``pipespec.pp``; it must
not import the CLI (``__main__`` excepted) or vllm.
"""
