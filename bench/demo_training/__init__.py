"""The pieces of ``bench/train_demo.py``, one concept per module; ``bench/train_demo.py`` is the command.

- ``presets``: every size and step count (``Preset``, ``PRESETS``) and ``--retrain-draft``'s recipe;
- the stdlib corpus, its train / held-out split and the prompts drawn from it are ``pipespec.bench.corpus``
  (the benchmarks draw their held-out prompts from it too);
- ``tokenizer``: the byte-level BPE tokenizer and the token stream;
- ``loop``: what both training loops share (LR schedule, optimizer, wall-time cap, the step loop);
- ``target_training``: the Llama target and its next-token training;
- ``draft_model``: the EAGLE3 draft's construction, pruning, and the test-time-training forward;
- ``generations``: the target's greedy generations and their aux states (``--retrain-draft``'s data);
- ``heldout``: acceptance replayed on held-out generations (what inference will measure);
- ``draft_training``: the one draft training loop, over corpus windows or over generations;
- ``export``: writing the checkpoints and reading them back;
- ``evaluate``: speculative decoding of the written checkpoints, and ``--eval-only``;
- ``record``: ``metrics.json``: where and how a figure was made, and writing it;
- ``pair``: the main flow (corpus to shipped pair); ``retrain``: ``--retrain-draft``.

Bench code: it may import pipespec, torch and transformers, never vllm; pipespec never imports it.
"""
