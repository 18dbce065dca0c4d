"""Scripts of the source repository: training the demo pair (``train_demo.py``, ``demo_training/``), the
GPU session, probes and surveys. The benchmarks a user runs live in the package (``pipespec.bench``)."""
