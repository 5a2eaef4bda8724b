"""``sim_fleet_routing.py``'s model: what must hold whatever the policy."""

from __future__ import annotations

import pytest

from benchmark import sim_fleet_routing as sim
from benchmark.bench_rag_grid import PARAMS

SMALL = {**PARAMS, "requests": 120}


@pytest.mark.parametrize("policy", sim.POLICIES)
def test_every_token_has_one_source_and_first_uses_are_prefills_whatever_the_route(policy):
    row = sim.simulate("varlen_k6_p256_z07_t4", 4, 0.25, policy, SMALL, seed=7)
    assert row["local_share"] + row["store_share"] + row["prefill_share"] == pytest.approx(1)
    # a unit's first use is a prefill wherever it lands: the prefill share is the policy's
    # neither; the store holds everything computed, so a miss here is a load, not a prefill
    first = sim.simulate("varlen_k6_p256_z07_t4", 4, 0.25, "round_robin", SMALL, seed=7)
    assert row["prefill_share"] == pytest.approx(first["prefill_share"])
    assert sum(row["per_instance"]) == row["requests"] == 120


def test_round_robin_spreads_evenly_and_one_instance_caches_like_any_policy():
    assert sim.simulate("aligned", 4, 0.5, "round_robin", SMALL, seed=1)["busiest_over_mean"] \
        == 1.0
    one = {p: sim.simulate("varlen_k6_p256_z07_t4", 1, 0.25, p, SMALL, seed=3)["local_share"]
           for p in sim.POLICIES}
    assert len(set(one.values())) == 1  # with one instance routing cannot matter


def test_the_lru_keeps_the_newest_units_within_its_capacity():
    inst = sim.Instance(capacity=10)
    computed: set = set()
    assert inst.serve([(("doc", 1), 6), (("doc", 2), 4)], computed) == \
        {"local": 0, "store": 0, "prefill": 10}
    assert inst.serve([(("doc", 3), 5)], computed)["prefill"] == 5  # evicts doc 1
    assert inst.serve([(("doc", 2), 4), (("doc", 1), 6)], computed) == \
        {"local": 4, "store": 6, "prefill": 0}
    assert inst.used <= 10


def test_cache_aware_follows_the_longest_prefix_above_the_threshold():
    fleet = [sim.Instance(100), sim.Instance(100)]
    units = [(("system", 0), 50), (("doc", 1), 50), (("doc", 2), 10)]
    fleet[1].remember(units)
    assert sim.route("cache_aware", fleet, units, list, [], {}, None) == 1
    other = [(("system", 1), 50), (("doc", 3), 50)]
    assert sim.route("cache_aware", fleet, other, list, [], {}, None) == 0  # smallest tree
