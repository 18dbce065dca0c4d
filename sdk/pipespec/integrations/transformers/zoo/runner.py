"""The zoo's orchestration: ``run_type`` over every causal-LM type, in this process or in worker processes.

One torch thread per process (tiny tensors: one thread is fastest, and the zoo does not fight other
processes for cores); ``jobs > 1`` spawns that many workers, each paying the imports once. What one
type's check is lives in ``check``; how results are shown lives in ``report``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from pipespec.integrations.transformers.zoo.check import ZooResult, ZooStatus, run_type, short_error
from pipespec.integrations.transformers.zoo.tiny import causal_lm_model_types

__all__ = ["run_zoo"]


def run_zoo(
    model_types: Iterable[str] | None = None,
    pp_sizes: Sequence[int] = (1, 2, 3),
    progress: Callable[[int, int, ZooResult], None] | None = None,
    jobs: int = 1,
    decode_steps: int = 0,
) -> list[ZooResult]:
    """Run ``run_type`` over ``model_types`` (default: every causal-LM type installed); results in order.

    ``jobs > 1`` spreads the types over that many worker processes (spawned, one torch thread each);
    each worker pays the imports once.
    """
    types = list(model_types) if model_types is not None else causal_lm_model_types()
    if jobs > 1 and len(types) > 1:
        return _run_parallel(types, tuple(pp_sizes), progress, min(jobs, len(types)), decode_steps)
    results = []
    threads = torch.get_num_threads()
    # Tiny tensors: one thread is fastest, and it keeps the zoo from fighting other processes for cores.
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for i, model_type in enumerate(types):
                result = run_type(model_type, pp_sizes, decode_steps=decode_steps)
                results.append(result)
                if progress is not None:
                    progress(i + 1, len(types), result)
    finally:
        torch.set_num_threads(threads)
    return results


def _worker_init() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)


def _run_parallel(
    types: list[str], pp_sizes: tuple[int, ...], progress: Callable[[int, int, ZooResult], None] | None, jobs: int,
    decode_steps: int,
) -> list[ZooResult]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: dict[int, ZooResult] = {}
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
    try:
        futures = {pool.submit(run_type, t, pp_sizes, 0, decode_steps): i for i, t in enumerate(types)}
        for done, future in enumerate(as_completed(futures), start=1):
            i = futures[future]
            try:
                results[i] = future.result()
            except Exception as exc:  # noqa: BLE001 - a worker died (e.g. killed for memory): that type failed
                results[i] = ZooResult(model_type=types[i], status=ZooStatus.FAILED, reason=f"zoo worker died: {short_error(exc)}")
            if progress is not None:
                progress(done, len(types), results[i])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [results[i] for i in range(len(types))]
