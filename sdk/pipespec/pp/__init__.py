"""The pipeline-parallel runtime: launching stage processes, the packed transport, stage-scoped loading.

* ``pipespec.pp.launch``    — start P stage processes (or join a ``torchrun`` world), rendezvous on a
  free port, watchdogs, and turning one stage's failure into one message that names the stage;
* ``pipespec.pp.transport`` — one packed message per hop into preallocated buffers, one broadcast per
  decoding step;
* ``pipespec.pp.loading``   — read only this stage's tensors from an HF safetensors checkpoint.

Nothing here knows about speculative decoding; ``pipespec.engine`` builds on it.
"""
