"""pipespec's benchmarks: one module per benchmark, run by ``pipespec bench NAME`` (``all``: every one).

Each benchmark module defines ``NAME``, ``DESCRIPTION``, ``CPU_FEASIBLE`` and ``run(quick, device,
command)`` returning ``common.Result`` rows. ``p3_speedup``, ``pipeline_microbatches`` and ``phases``
also run as ``python -m pipespec.bench.MODULE`` for sweeps outside the goals' cases.

The benchmarks sit above the CLI: they run its commands (``common.cli_json``), and the CLI loads them by
name only when ``pipespec bench`` runs. Nothing else in pipespec imports them. Training the demo pair
(``bench/train_demo.py``) is a script of the source repository, not part of the package; it reads its
corpus from ``corpus`` here.
"""
