"""The balance simulation's pieces: greedy assignment, replica copy sets (same as the planner's),
the synthetic group-limited router."""

from __future__ import annotations

from itertools import product
from math import comb

import numpy as np
import pytest

from bench.placement import (
    SNC4_DISTANCES,
    assign_greedy,
    copy_nodes,
    expert_homes,
    group_limited_picks,
    max_per_node,
    synthetic_topology,
    uniform_picks,
)
from pipeline.plan import plan
from tests.support.numa_fixtures import cfg, fake_catalog


def test_greedy_takes_the_least_loaded_copy_primary_first():
    copies = np.array([[0, 1], [0, 2], [1, -1], [2, 0]])
    picks = np.array([[0, 1, 2, 3]])
    # e0 -> 0 (tie: primary); e1 -> 2 (node 0 has one); e2 -> 1 (its only copy); e3 -> 0 (0 and 2
    # have one each: the primary, node 2, wins the tie)
    assert assign_greedy(picks, copies, 3).tolist() == [[0, 2, 1, 2]]


def test_full_replication_reaches_the_ideal():
    topo = synthetic_topology(4)
    picks = uniform_picks(2000, 256, top_k=6, seed=3)
    for rule in ("contiguous", "round_robin"):
        assert max_per_node(picks, copy_nodes(expert_homes(256, 4, rule), 3, topo), 4) == 2.0


def exact_e_max(n_expert: int, n_nodes: int, k: int) -> float:
    """E[max per node] for k distinct experts drawn uniformly, n_expert / n_nodes per node."""
    per = n_expert // n_nodes
    total = comb(n_expert, k)
    e = 0.0
    for counts in product(range(k + 1), repeat=n_nodes):
        if sum(counts) != k:
            continue
        ways = 1
        for c in counts:
            ways *= comb(per, c)
        e += max(counts) * ways / total
    return e


def test_uniform_routing_matches_the_exact_expectation():
    want = exact_e_max(256, 4, 6)  # 2.79..: the reference figure 2.8
    got = max_per_node(uniform_picks(20000, 256, 6, seed=1), copy_nodes(expert_homes(256, 4, "contiguous"), 0,
                                                                         synthetic_topology(4)), 4)
    assert abs(got - want) < 0.03, (got, want)
    assert 2.78 < want < 2.81


@pytest.mark.parametrize("rule", ["contiguous", "round_robin"])
@pytest.mark.parametrize("replicas", [0, 1, 2, 3])
def test_copy_sets_are_the_planners(rule, replicas):
    topo = synthetic_topology(4, SNC4_DISTANCES)
    layout = plan(fake_catalog(n_layers=1, n_expert=256, slab_bytes=256), topo,
                  cfg(expert_homes=rule, replicas=replicas))
    planned = layout.experts[(0, "gate")].nodes
    assert np.array_equal(planned, copy_nodes(expert_homes(256, 4, rule), replicas, topo))


def test_group_limited_picks_stay_in_the_kept_groups():
    picks = group_limited_picks(3000, 256, n_group=8, n_group_used=4, top_k=8, seed=2)
    assert picks.shape == (3000, 8)
    assert all(len(set(row)) == 8 for row in picks.tolist())
    groups_used = np.array([len(set((row // 32).tolist())) for row in picks])
    assert groups_used.max() <= 4
    # the synthetic router concentrates: contiguous homes (2 groups per node) balance worse than
    # round-robin homes, and one replica recovers most of the gap
    topo = synthetic_topology(4)
    contiguous = max_per_node(picks, copy_nodes(expert_homes(256, 4, "contiguous"), 0, topo), 4)
    round_robin = max_per_node(picks, copy_nodes(expert_homes(256, 4, "round_robin"), 0, topo), 4)
    one_replica = max_per_node(picks, copy_nodes(expert_homes(256, 4, "contiguous"), 1, topo), 4)
    assert round_robin < contiguous and one_replica < round_robin
