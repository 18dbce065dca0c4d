"""``torchrun --nproc-per-node P [--nnodes ...] -m pipespec.engine <pipespec generate flags>``.

One process per stage, ``env://`` rendezvous (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK; the GPU of a stage is its LOCAL_RANK). After decoding, the stages' small stats are gathered
on the last rank, which prints the same output as ``pipespec generate``. Errors: one line on stderr
naming the stage, exit 1 (2 for usage errors); torchrun then stops the other ranks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipespec.cli import generate
from pipespec.errors import PipespecError


def _stage(ctx: Any, job: Any) -> Any:
    import torch.distributed as dist

    from pipespec.engine.worker import stage_main

    result = stage_main(ctx, job)
    gathered: list[Any] = [None] * ctx.world_size
    with ctx.waiting("gathering stage stats"):
        dist.all_gather_object(gathered, result)
    return gathered if ctx.is_last else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipespec.engine", description=generate.HELP)
    generate.add_arguments(parser)
    args = parser.parse_args(argv)
    from pipespec.pp.launch import run_under_torchrun

    rank = "?"
    try:
        import os

        rank = os.environ.get("RANK", "?")
        job = generate.job_from_args(args)
        gathered = run_under_torchrun(_stage, job, device_type=job.device, timeout_s=job.timeout_s,
                                      load_timeout_s=job.load_timeout_s, verbose=job.verbose)
        if gathered is not None:
            batch = args.prompts_file is not None
            result = generate.compose_output(job, gathered, batch)
            generate.announce_convention(result)
            generate.print_result(result, args.json, batch)
        return 0
    except PipespecError as exc:
        print(f"pipespec.engine: error: stage {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"pipespec.engine: stage {rank} interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
