"""A stage process's phases, one module each (``pipespec.engine.worker.stage_main`` runs them in order).

``settings`` (threads, cuDNN attention, EOS ids, the draft backlog), ``loading`` (the pre-check, the
stage's target and draft, the post-loading barrier), ``state`` (what every stage keeps per sequence and
per runner), ``drafting`` (the last stage's draft calls and backlog), ``rounds`` (one forward, one round,
the schedule), ``captures`` (warm-up and CUDA-graph captures), ``runner`` (``StageRunner``: the decoding
loop), ``stats`` (what a stage reports). Imports the engine's pieces, ``pipespec.pp`` and the contract;
must not import the CLI or vllm.
"""
