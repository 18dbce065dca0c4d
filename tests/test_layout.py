"""Layout arithmetic: default partition, ownership of ids, slots, sends/relays/collects, validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipespec.contract.layout import aux_key, default_partition, eagle3_default_aux_ids, plan_layout
from pipespec.errors import LayoutError


@st.composite
def layouts(draw):
    pp = draw(st.integers(1, 8))
    counts = draw(st.lists(st.integers(1, 6), min_size=pp, max_size=pp))
    n = sum(counts)
    bounds = [sum(counts[:i]) for i in range(pp + 1)]
    ids = draw(st.lists(st.one_of(st.integers(0, n), st.sampled_from(bounds)), min_size=1, max_size=8))
    return n, pp, counts, ids


def test_default_partition_matches_vllm_rule():
    """N//P each, remainder to stages before the last, from the second-to-last backwards."""
    assert default_partition(80, 4) == (20, 20, 20, 20)
    assert default_partition(10, 4) == (2, 3, 3, 2)
    assert default_partition(7, 3) == (2, 3, 2)
    assert default_partition(5, 5) == (1, 1, 1, 1, 1)
    assert default_partition(9, 2) == (5, 4)


@given(st.integers(1, 64), st.integers(1, 8))
def test_default_partition_is_a_partition(n, p):
    if p > n:
        with pytest.raises(LayoutError):
            default_partition(n, p)
        return
    counts = default_partition(n, p)
    assert sum(counts) == n and len(counts) == p and min(counts) >= 1
    assert max(counts) - min(counts) <= 1
    assert counts[-1] == n // p  # the last stage (lm_head, draft) never takes the remainder


@given(layouts())
def test_every_id_has_exactly_one_producer_and_slots_are_contiguous(case):
    n, pp, counts, ids = case
    plan = plan_layout(n, pp, ids, partition=counts)
    assert plan.aux_layers == tuple(sorted(set(ids)))
    produced = [i for s in plan.stages for i in s.produces]
    assert produced == list(plan.aux_layers)
    for s in plan.stages:
        for i in s.produces:
            assert (s.start_layer < i <= s.end_layer) or (s.rank == 0 and i == 0)
        # slot_base is the number of ids produced upstream
        assert s.slot_base == sum(len(t.produces) for t in plan.stages[: s.rank])
        assert s.own_keys == tuple(aux_key(s.slot_base + j) for j in range(len(s.produces)))


@given(layouts())
def test_sends_relays_collects_follow_the_contract(case):
    n, pp, counts, ids = case
    plan = plan_layout(n, pp, ids, partition=counts)
    last = plan.stages[-1]
    for s in plan.stages[:-1]:
        assert s.sends == s.relays + s.own_keys
        assert plan.stages[s.rank + 1].receives == s.sends  # receive slots == keys actually sent
        assert s.collects == ()
    assert last.sends == () and last.relays == ()
    assert last.collects == tuple(aux_key(i) for i in range(last.slot_base))
    assert plan.stages[0].relays == ()
    if pp <= 2:
        assert all(not s.relays for s in plan.stages)


def test_boundary_id_belongs_to_upstream_stage():
    plan = plan_layout(8, 2, [0, 4, 8])
    assert plan.stages[0].produces == (0, 4)
    assert plan.stages[1].produces == (8,)
    assert plan.stages[1].slot_base == 2


def test_hand_checked_32_layers_pp4():
    plan = plan_layout(32, 4, [2, 16, 29])
    assert plan.to_json_dict() == {
        "num_layers": 32,
        "aux_layers": [2, 16, 29],
        "stages": [
            {"rank": 0, "start_layer": 0, "end_layer": 8, "slot_base": 0, "produces": [2],
             "sends": ["aux_hidden_states_0"], "relays": [], "collects": []},
            {"rank": 1, "start_layer": 8, "end_layer": 16, "slot_base": 1, "produces": [16],
             "sends": ["aux_hidden_states_0", "aux_hidden_states_1"], "relays": ["aux_hidden_states_0"], "collects": []},
            {"rank": 2, "start_layer": 16, "end_layer": 24, "slot_base": 2, "produces": [],
             "sends": ["aux_hidden_states_0", "aux_hidden_states_1"],
             "relays": ["aux_hidden_states_0", "aux_hidden_states_1"], "collects": []},
            {"rank": 3, "start_layer": 24, "end_layer": 32, "slot_base": 2, "produces": [29],
             "sends": [], "relays": [], "collects": ["aux_hidden_states_0", "aux_hidden_states_1"]},
        ],
    }


def test_boundary_rule_rejects_id_ending_a_non_last_stage():
    with pytest.raises(LayoutError, match="aux layer id 4 ends stage 0"):
        plan_layout(8, 2, [2, 4, 5], boundary_rule="reject-at-stage-end")
    # N itself ends the *last* stage: allowed; and the same ids pass without the rule.
    plan_layout(8, 2, [2, 5, 8], boundary_rule="reject-at-stage-end")
    plan_layout(8, 2, [2, 4, 5])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0, "pp_size": 1}, "num_layers 0 is invalid"),
        ({"num_layers": 4, "pp_size": 0}, "pipeline size 0 is invalid"),
        ({"num_layers": 4, "pp_size": 5}, "pipeline size 5 is larger than num_layers 4"),
        ({"num_layers": 8, "pp_size": 2, "partition": [3, 3]}, r"partition \[3, 3\] sums to 6 but the model has 8"),
        ({"num_layers": 8, "pp_size": 2, "partition": [8]}, "has 1 entries but the pipeline has 2 stages"),
        ({"num_layers": 8, "pp_size": 2, "partition": [8, 0]}, "contains 0"),
        ({"num_layers": 8, "pp_size": 2, "aux_layers": [9]}, "aux layer id 9 is out of range"),
        ({"num_layers": 8, "pp_size": 2, "aux_layers": [-1]}, "aux layer id -1 is out of range"),
        ({"num_layers": 8, "pp_size": 2, "require_aux": True}, "no aux layer ids were given"),
        ({"num_layers": 8, "pp_size": 2, "boundary_rule": "nope"}, "boundary rule 'nope' is unknown"),
    ],
)
def test_invalid_layouts_name_the_value_and_rule(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        plan_layout(**kwargs)


def test_eagle3_default_ids():
    assert eagle3_default_aux_ids(32) == (2, 16, 29)
    assert eagle3_default_aux_ids(80) == (2, 40, 77)
    assert eagle3_default_aux_ids(4) == (1, 2)  # (2, 2, 1) deduped
