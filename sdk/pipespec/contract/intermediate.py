"""``IntermediateTensors``: the named tensors one pipeline stage hands to the next.

One type for the engine, the transport and generated model code. It is a mapping ``key → tensor``
(``hidden_states``, ``residual`` where the model keeps one, ``aux_hidden_states_{slot}``) with ``|`` to
merge, so relaying upstream aux states is ``outgoing | {k: received[k] for k in relay_keys}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class IntermediateTensors(Mapping[str, torch.Tensor]):
    """Named tensors between stages.

    >>> t = IntermediateTensors({"hidden_states": torch.zeros(2, 4)})
    >>> sorted((t | {"aux_hidden_states_0": torch.ones(2, 4)}).keys())
    ['aux_hidden_states_0', 'hidden_states']
    """

    __slots__ = ("tensors",)

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in these intermediate tensors (keys present: {sorted(self.tensors)})") from None

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __or__(self, other: Mapping[str, torch.Tensor]) -> IntermediateTensors:
        merged = dict(self.tensors)
        merged.update(other)
        return IntermediateTensors(merged)

    def __ror__(self, other: Mapping[str, torch.Tensor]) -> IntermediateTensors:
        merged = dict(other)
        merged.update(self.tensors)
        return IntermediateTensors(merged)

    def __eq__(self, other: object) -> bool:
        """Exact equality: same keys, and every tensor equal in shape, dtype and values."""
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.allclose(other, rtol=0.0, atol=0.0, check_dtype=True)

    __hash__ = None  # type: ignore[assignment]

    def allclose(
        self, other: Mapping[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6, check_dtype: bool = False
    ) -> bool:
        """True when both have the same keys and each pair of tensors is close."""
        return not self.mismatches(other, rtol=rtol, atol=atol, check_dtype=check_dtype)

    def mismatches(
        self, other: Mapping[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6, check_dtype: bool = False
    ) -> list[str]:
        """Human-readable differences (for test failure messages); empty when they match."""
        problems = []
        mine, theirs = set(self.tensors), set(other.keys())
        if mine != theirs:
            problems.append(f"keys differ: only here {sorted(mine - theirs)}, only there {sorted(theirs - mine)}")
        for key in sorted(mine & theirs):
            a, b = self.tensors[key], other[key]
            if a.shape != b.shape:
                problems.append(f"{key}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            elif check_dtype and a.dtype != b.dtype:
                problems.append(f"{key}: dtype {a.dtype} != {b.dtype}")
            elif not torch.allclose(a.to(b.dtype), b, rtol=rtol, atol=atol):
                err = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()
                problems.append(f"{key}: values differ (max abs err {err:.3g})")
        return problems

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        return f"IntermediateTensors({{{body}}})"
