"""``torchrun --nproc-per-node P [--nnodes ...] -m pipespec.engine <pipespec generate flags>``.

One process per stage, ``env://`` rendezvous (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK; the GPU of a stage is its LOCAL_RANK). ``--pp`` defaults to torchrun's WORLD_SIZE (one stage
per process). After decoding, the stages' small stats are gathered on the last rank, which prints the
same output as ``pipespec generate``. Errors: one line on stderr naming the stage, exit 1 (2 for usage
errors); a flag error, the same on every rank, is said once per node (by its LOCAL_RANK 0). torchrun
then stops the other ranks and, for any non-zero exit of a worker, raises its own ``ChildFailedError``
with a report (torchrun's, not the worker's: a worker cannot silence it).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from pipespec.cli import Parser, generate
from pipespec.errors import PipespecError, UsageError

#: Seconds a worker that does not report a flag error waits before exiting (see ``main``).
QUIET_EXIT_DELAY_S = 5.0


def _stage(ctx: Any, job: Any) -> Any:
    import torch.distributed as dist

    from pipespec.engine.worker import stage_main

    result = stage_main(ctx, job)
    gathered: list[Any] = [None] * ctx.world_size
    with ctx.waiting("gathering stage stats"):
        dist.all_gather_object(gathered, result)
    return gathered if ctx.is_last else None


def world_size_or_one() -> int:
    """torchrun's WORLD_SIZE (1 when it is unset or not a positive integer: the launcher then says why)."""
    text = os.environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def reports_flag_errors() -> bool:
    """Whether this worker prints a flag error: the first on its node (one line per node, not per rank)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def check_world_size(pp: int) -> None:
    """``--pp`` equals the number of processes torchrun started (before the job is read or a weight loaded)."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) != pp:
        raise UsageError(f"--pp {pp} does not match the {world} processes torchrun started (--nproc-per-node "
                         "times --nnodes): drop --pp (it defaults to that number) or start one process per stage")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m pipespec.engine", description=generate.HELP)
    generate.add_arguments(parser, pp_help="pipeline stages (default: torchrun's WORLD_SIZE, one stage per process)")
    parser.set_defaults(pp=None)
    args = parser.parse_args(argv)
    if args.pp is None:  # torchrun already says how many stages there are
        args.pp = world_size_or_one()
    from pipespec.pp.launch import run_under_torchrun

    rank, started = os.environ.get("RANK", "?"), False
    try:
        check_world_size(args.pp)
        job = generate.job_from_args(args)
        started = True
        gathered = run_under_torchrun(_stage, job, device_type=job.device, timeout_s=job.timeout_s,
                                      load_timeout_s=job.load_timeout_s, verbose=job.verbose)
        if gathered is not None:
            batch = args.prompts_file is not None
            result = generate.compose_output(job, gathered, batch)
            generate.announce_convention(result)
            generate.print_result(result, args.json, batch)
        return 0
    except PipespecError as exc:
        if started or reports_flag_errors():
            print(f"pipespec.engine: error: stage {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            # The same flag error on every rank: the node's first worker says it. This one exits after it,
            # so that torchrun (which stops every worker once one exits non-zero) has not stopped the
            # reporter before its line is out.
            time.sleep(QUIET_EXIT_DELAY_S)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"pipespec.engine: stage {rank} interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
