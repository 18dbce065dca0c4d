"""Former home of the tiny checkpoints and the reference loop, kept only for the demo-training scripts
(``bench/demo_training/``).

Now ``pipespec.engine.tiny_checkpoints`` (tiny targets and drafts, the agreeing pair) and
``pipespec.engine.reference`` (the single-process oracle). Delete this module once bench/demo_training/
imports ``reference_speculative_generate`` and ``target_aux_states`` from ``pipespec.engine.reference``.
"""

from __future__ import annotations

from pipespec.engine.reference import reference_speculative_generate, target_aux_states

__all__ = ["reference_speculative_generate", "target_aux_states"]
