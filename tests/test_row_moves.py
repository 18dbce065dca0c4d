"""``pipespec.engine.row_moves``: the order that fills a batch's gaps from its end, and the in-place copies it takes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipespec.engine.row_moves import fill_gaps_order, in_place_moves


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[int]]:
    size = draw(st.integers(0, 40))
    keep = sorted(draw(st.sets(st.integers(0, max(size - 1, 0)), max_size=size))) if size else []
    return size, keep


@given(batches())
def test_the_order_keeps_exactly_the_rows_and_moves_only_as_many_as_left(batch: tuple[int, list[int]]) -> None:
    size, keep = batch
    order = fill_gaps_order(size, keep)
    assert sorted(order) == keep
    assert all(row == i for i, row in enumerate(order) if row < len(order))  # rows below the new count stay
    moves = in_place_moves(order, size)
    assert moves is not None
    assert len(moves) <= size - len(keep)
    rows = [f"row {i}" for i in range(size)]  # applying the copies in place gives the order's rows
    for dst, src in moves:
        rows[dst] = rows[src]
    assert rows[: len(order)] == [f"row {i}" for i in order]


@given(st.permutations(list(range(6))), st.integers(1, 6))
def test_an_order_that_reads_a_row_it_overwrites_is_not_done_in_place(perm: list[int], count: int) -> None:
    order = perm[:count]
    moves = in_place_moves(order, 6)
    if any(src != dst and src < count for dst, src in enumerate(order)):
        assert moves is None
    else:
        assert moves == [(dst, src) for dst, src in enumerate(order) if src != dst]


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="not distinct rows of a batch of 3"):
        fill_gaps_order(3, [0, 0])
    with pytest.raises(ValueError, match="not distinct rows of a batch of 3"):
        fill_gaps_order(3, [3])
    with pytest.raises(ValueError, match="does not select rows of a batch of 2"):
        in_place_moves([0, 2], 2)
