"""What a measuring cycle leaves behind, per load: the round-cost ratio ρ and a plain round's time.

ρ is a drafting round's seconds per row over a plain round's. Drafting beats plain decoding exactly when
its acceptance τ (tokens per row and round) exceeds ρ, and ρ does not grow as the rows shrink (fewer rows
make the k + 1 verified positions cheaper relative to one, never dearer: a forward moves from compute-
towards weights- and launch-bound). So the ρ measured at a load bounds ρ at every smaller load.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadRatios:
    """Per measured load (running sequences): ρ (``ratio``) and a plain round's seconds (``plain_round``)."""

    ratio: dict[int, float] = field(default_factory=dict)
    plain_round: dict[int, float] = field(default_factory=dict)

    def keep(self, load: int, spec_seconds: float, spec_rows: int, plain_seconds: float, plain_rows: int,
             plain_rounds: int) -> None:
        """A cycle at ``load`` measured both modes: drafting's window (seconds, rows) and plain decoding's
        (seconds, rows, rounds)."""
        self.ratio[load] = (spec_seconds / spec_rows) / (plain_seconds / plain_rows)
        self.plain_round[load] = plain_seconds / plain_rounds

    def carried(self, load: int) -> tuple[float, int] | None:
        """ρ measured at the smallest load at or above ``load`` (an upper bound on ρ at ``load``), and that
        load; None when none was measured."""
        above = [measured for measured in self.ratio if measured >= load]
        if not above:
            return None
        at = min(above)
        return self.ratio[at], at

    def bound(self, ratio: float, at: int, drafting_round: float | None) -> float:
        """What drafting's acceptance must beat at a new load: ``ratio`` carried from load ``at``, or, when
        larger, drafting's round now (``drafting_round`` seconds) over a plain round at ``at``. The second
        assumes nothing of drafting's cost: a plain round with fewer rows costs at most what it cost with
        more. It catches a drafting round that got dearer as the rows left (on one H200 at c = 32: 4.5 ms at
        32 rows, 6.3-7.1 ms in the tail, against 2.9-3.4 ms plain at any load)."""
        plain_round = self.plain_round.get(at)
        if plain_round and drafting_round is not None:
            return max(ratio, drafting_round / plain_round)
        return ratio
