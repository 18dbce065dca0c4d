"""The order a benchmark runs its variants in: each variant at each place of a repeat, and after each other
variant, equally often.

Runs of a whole engine move with what ran just before them (on one H200, a variant that always ran third
of three measured ~10 % slower in every repeat, the same rounds, every phase slower; on the 2-core CPU a
variant that always followed one other measured 0.86x it on the same rounds). The order below spreads
both effects over every variant alike: a *carry-over balanced* sequence of permutations, one per repeat,
run back to back, after one unmeasured run (``lead_in``) so that the first measured run has a predecessor
too.

For ``n`` variants (3 to 5) and ``repeats`` permutations, each variant holds each place at most
⌈repeats / n⌉ times (exactly repeats / n when n divides it), no variant follows itself, and when
``repeats`` is a multiple of n (n − 1) (6 for three variants, 12 for four) each ordered pair of distinct
variants is adjacent equally often, the lead-in's pair included. The cycle behind it is found once per n
by a depth-first search over permutations (least-used pairs first; well under a second for n = 5); a
longer sequence repeats it, and a shorter one is its start, where no pair count is more than 3 from
another's. Below 3 or above 5 variants the order is a rotation per repeat that reverses every n repeats
(balanced for places, not for predecessors; searching 720 permutations a node is too slow).
"""

from __future__ import annotations

import functools
import itertools

SEARCH_NODES = 20_000  # the depth-first search's budget (n = 3 to 5 need far fewer)
MAX_SEARCHED = 5  # more variants: 720+ permutations a node, too slow to search; the rotation is used


def rotation_order(n: int, repeats: int) -> list[tuple[int, ...]]:
    """``repeats`` permutations of ``range(n)``: rotated by one place per repeat, reversed every ``n``."""
    base = list(range(n))
    orders = []
    for i in range(repeats):
        turn = base if (i // n) % 2 == 0 else base[::-1]
        shift = i % n
        orders.append(tuple(turn[shift:] + turn[:shift]))
    return orders


@functools.cache
def balanced_cycle(n: int) -> tuple[tuple[int, ...], ...] | None:
    """``n (n − 1)`` permutations of ``range(n)`` read as a cycle, in groups of ``n`` that are Latin squares
    (every variant at every place once in a group), every ordered pair of distinct variants adjacent
    (across permutations too, and from the last back to the first) exactly ``n`` times, and each prefix
    of ``j`` permutations with no pair more than ⌈j / (n − 1)⌉ + 1 times. None when the search runs out of
    its budget."""
    if n < 3 or n > MAX_SEARCHED:
        return None
    length = n * (n - 1)
    perms = list(itertools.permutations(range(n)))
    pairs = [[0] * n for _ in range(n)]
    chosen: list[tuple[int, ...]] = []
    nodes = 0

    def arcs(prev: int | None, perm: tuple[int, ...]) -> list[tuple[int, int]]:
        return ([] if prev is None else [(prev, perm[0])]) + list(zip(perm, perm[1:]))

    def search() -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > SEARCH_NODES:
            return False
        if len(chosen) == length:
            last, first = chosen[-1][-1], chosen[0][0]
            return last != first and pairs[last][first] < n
        prev = chosen[-1][-1] if chosen else None
        group = chosen[len(chosen) - len(chosen) % n:]  # this group's permutations so far
        taken = {(v, i) for perm in group for i, v in enumerate(perm)}
        cap = min(n, -(-(len(chosen) + 1) // (n - 1)) + 1)  # ⌈permutations / (n − 1)⌉ + 1, n at the end

        def fits(perm: tuple[int, ...]) -> bool:  # a permutation's own arcs are distinct
            return (not any((v, i) in taken for i, v in enumerate(perm))
                    and all(a != b and pairs[a][b] < cap for a, b in arcs(prev, perm)))

        for perm in sorted(filter(fits, perms), key=lambda p: sum(pairs[a][b] for a, b in arcs(prev, p))):
            new = arcs(prev, perm)
            for a, b in new:
                pairs[a][b] += 1
            chosen.append(perm)
            if search():
                return True
            chosen.pop()
            for a, b in new:
                pairs[a][b] -= 1
        return False

    return tuple(chosen) if search() else None


def balanced_order(n: int, repeats: int) -> list[tuple[int, ...]]:
    """``repeats`` permutations of ``range(n)`` to run the variants in (see the module docstring)."""
    if n < 1 or repeats < 0:
        raise ValueError(f"need n >= 1 variants and repeats >= 0, got {n} and {repeats}")
    cycle = balanced_cycle(n)
    if cycle is None:
        return rotation_order(n, repeats)
    return [cycle[i % len(cycle)] for i in range(repeats)]


def lead_in(order: list[tuple[int, ...]]) -> int:
    """The variant to run, unmeasured, before ``order``: the one that has preceded the first measured
    variant least often in it (the last one, closing the cycle, where that ties), never that variant itself."""
    runs = [v for perm in order for v in perm]
    first, n = runs[0], len(order[0])
    if n == 1:
        return first
    before = {v: 0 for v in range(n) if v != first}
    for a, b in zip(runs, runs[1:]):
        if b == first and a != first:
            before[a] += 1
    fewest = min(before.values())
    return runs[-1] if before.get(runs[-1]) == fewest else min(v for v, m in before.items() if m == fewest)
