"""pipespec benchmarks: one module per benchmark, driven by `pipespec bench NAME`."""
