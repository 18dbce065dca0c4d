"""``num_valid`` of ``propose``/``extend``/``DraftKVCache.write``: per-row counts of real positions, parsed once.

Host integers are validated and copied to the device once (pinned on CUDA); a device tensor is used as is.
Imports torch only; must not import the draft's modules (they import this).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch


def long_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers as an int64 tensor on ``device``; to CUDA via pinned memory without a stream sync."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class Counts(NamedTuple):
    """A parsed ``num_valid``.

    ``device``: the per-row counts on the cache's device, or None when every row counts all ``T`` new
    positions (known on the host: nothing to copy, the lengths advance by ``T``). ``host``: the same counts
    as host integers when known. ``last``: when asked for and the counts are ragged host integers, the
    flat index ``b·T + n_b − 1`` of each row's last valid position (copied to the device with the counts).
    """

    device: torch.Tensor | None
    host: list[int] | None
    last: torch.Tensor | None


def valid_counts(
    num_valid: torch.Tensor | Sequence[int] | None, batch: int, steps: int, device: torch.device, *, minimum: int,
    want_last: bool = False,
) -> Counts | None:
    """Parse ``num_valid``; host values are checked against ``[minimum, steps]``, a device tensor is used as is."""
    if num_valid is None:
        return None
    if isinstance(num_valid, torch.Tensor) and num_valid.device.type != "cpu":
        if tuple(num_valid.shape) != (batch,):
            raise ValueError(f"num_valid has shape {tuple(num_valid.shape)}, expected ({batch},): one count per row")
        counts = num_valid if num_valid.dtype == torch.long else num_valid.long()
        return Counts(counts if counts.device == device else counts.to(device), None, None)
    if isinstance(num_valid, torch.Tensor):
        if num_valid.dim() != 1:
            raise ValueError(f"num_valid has shape {tuple(num_valid.shape)}, expected ({batch},): one count per row")
        host = [int(n) for n in num_valid.tolist()]  # host memory: no device synchronisation
    else:
        host = [operator.index(n) for n in num_valid]
    if len(host) != batch:
        raise ValueError(f"num_valid has {len(host)} entries, expected {batch}: one count per row")
    if any(not minimum <= n <= steps for n in host):
        raise ValueError(f"num_valid {host} must lie in [{minimum}, {steps}] for every row ({steps} new positions)")
    if all(n == steps for n in host):
        return Counts(None, host, None)
    if not want_last:
        return Counts(long_on(host, device), host, None)
    both = long_on(host + [b * steps + n - 1 for b, n in enumerate(host)], device)
    return Counts(both[:batch], host, both[batch:])
