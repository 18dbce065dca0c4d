"""The reference engine: EAGLE3 speculative decoding over a pipeline of stage processes.

``python -m pipespec.engine ...`` (the same flags as ``pipespec generate``) runs one stage per process
under ``torchrun``; ``pipespec generate`` starts the stage processes itself. How a step flows and the
packed message layouts: docs/engine.md.
"""
