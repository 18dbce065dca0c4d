"""The zoo's stages: an adapted decoder as P in-process stage instances, handing tensors across.

Each stage is its own instance configured with ``set_pipeline_stage(rank, P, partition)`` (uneven for
P >= 2, ``uneven_partition``) and aux ids that include 0, every stage boundary and N (``zoo_aux_ids``);
stage 0 takes ``input_ids``, every later stage only the ``IntermediateTensors`` the previous one returned
(copied, as a transport would), whose keys must be exactly the hop's keys of the layout plan.

No processes and no torch.distributed: the engine's transport is not under test here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipespec.contract.intermediate import IntermediateTensors
from pipespec.contract.layout import eagle3_default_aux_ids, plan_layout
from pipespec.contract.mixin import hop_keys
from pipespec.integrations.transformers.zoo.compare import Mismatch
from pipespec.integrations.transformers.zoo.reference import first_tensor, forward_kwargs

__all__ = ["InProcessPipeline", "uneven_partition", "zoo_aux_ids"]


def uneven_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layer counts growing with the rank (1 : 2 : ... : P), every stage at least one layer.

    Uneven on purpose: vLLM only tested even splits, and off-by-one bugs hide in uneven ones.

    >>> uneven_partition(6, 3), uneven_partition(6, 2), uneven_partition(6, 1)
    ([1, 2, 3], [2, 4], [6])
    """
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {pp_size} stages")
    total = pp_size * (pp_size + 1) // 2
    counts = [max(1, (num_layers * (r + 1)) // total) for r in range(pp_size)]
    r = pp_size - 1
    while sum(counts) < num_layers:
        counts[r] += 1
        r = r - 1 if r > 0 else pp_size - 1
    while sum(counts) > num_layers:
        r = max(range(pp_size), key=lambda i: counts[i])
        counts[r] -= 1
    return counts


def zoo_aux_ids(num_layers: int, partition: Sequence[int]) -> list[int]:
    """0, N, every stage boundary (ids that belong to the upstream stage) and EAGLE3's defaults."""
    ids = {0, num_layers, *eagle3_default_aux_ids(num_layers)}
    bound = 0
    for count in partition[:-1]:
        bound += count
        ids.add(bound)
    return sorted(ids)

def _transport(tensors: Mapping[str, torch.Tensor]) -> IntermediateTensors:
    """What a real hop delivers: fresh tensors with the same values, no shared storage or autograd."""
    return IntermediateTensors({k: v.detach().clone() for k, v in tensors.items()})


class InProcessPipeline:
    """An adapted decoder as ``pp_size`` stage instances in one process, handing tensors across.

    Each stage is its own instance (built by ``make_stage``), configured as the engine configures a stage
    process; with ``cache_kwarg`` each also gets its own ``pipespec.integrations.transformers.stage_cache`` cache, so successive
    ``forward`` calls are prefill then decode steps. Every hop is checked against the layout plan: a
    non-last stage must return ``IntermediateTensors`` with exactly the hop's keys.
    """

    def __init__(
        self,
        make_stage: Callable[[], torch.nn.Module],
        pp_size: int,
        partition: Sequence[int],
        aux_ids: Sequence[int],
        has_residual: bool = False,
        cache_kwarg: str | None = None,
    ) -> None:
        self.plan = plan_layout(sum(partition), pp_size, aux_layers=aux_ids, partition=partition)
        self.pp_size = pp_size
        self.has_residual = has_residual
        self.cache_kwarg = cache_kwarg
        self.stages: list[torch.nn.Module] = []
        self.caches: list[Any] = []
        for rank in range(pp_size):
            stage = make_stage()
            stage.set_pipeline_stage(rank, pp_size, list(partition))  # type: ignore[operator]
            stage.set_aux_hidden_state_layers(aux_ids)  # type: ignore[operator]
            self.stages.append(stage)
            if cache_kwarg is not None:
                from pipespec.integrations.transformers.stage_cache import new_stage_cache

                self.caches.append(new_stage_cache(stage))

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every stage on ``input_ids``; return the last stage's (final hidden, aux list)."""
        received: IntermediateTensors | None = None
        out: Any = None
        for rank, stage in enumerate(self.stages):
            kwargs = forward_kwargs(stage)
            if self.cache_kwarg is not None:
                kwargs.update({"use_cache": True, self.cache_kwarg: self.caches[rank]})
            with torch.no_grad():
                out = stage(input_ids=input_ids if rank == 0 else None, intermediate_tensors=received, **kwargs)
            if rank < self.pp_size - 1:
                if not isinstance(out, IntermediateTensors):
                    raise Mismatch(f"stage {rank} of {self.pp_size} returned {type(out).__name__}, not IntermediateTensors")
                expected = set(hop_keys(self.plan.stage(rank), self.has_residual))
                if set(out.keys()) != expected:
                    raise Mismatch(
                        f"stage {rank} of {self.pp_size} sent keys {sorted(out.keys())}, the layout plan says {sorted(expected)}"
                    )
                received = _transport(out)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple))):
            raise Mismatch(f"last stage returned {type(out).__name__}, not (output, aux_list)")
        output, aux_list = out
        final = getattr(output, "last_hidden_state", None)
        if final is None:
            final = first_tensor(output)
        if final is None:
            raise Mismatch(f"last stage output {type(output).__name__} has no last hidden state")
        return final, list(aux_list)
