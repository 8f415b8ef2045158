"""The planner over fake topologies (sysfs trees) and fake catalogs (no model file)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_service.errors import CapacityError, ConfigError
from moe_service.layout import REGION_ALIGN_BYTES
from moe_service.numa import Topology, hugepage_pool_path
from pipeline.plan import check_capacity, format_plan, home_ranges, plan, plan_summary
from tests.support.numa_fixtures import GIB, cfg, fake_catalog, write_sysfs

SNC_DIST = [[10, 12, 21, 21], [12, 10, 21, 21], [21, 21, 10, 12], [21, 21, 12, 10]]


def four_nodes(tmp_path, mem_gib=64.0, balancing=0, dist=SNC_DIST):
    return Topology.read(write_sysfs(tmp_path, [[0, 1], [2, 3], [4, 5], [6, 7]], [mem_gib] * 4,
                                     distances=dist, numa_balancing=balancing))


def check_consistent(layout, catalog):
    """Invariants every layout must keep (the contract fastload, replication and the engine use)."""
    regions = sorted(layout.regions, key=lambda r: r.arena_offset)
    end = 0
    for r in regions:
        assert layout.align_bytes % REGION_ALIGN_BYTES == 0
        assert r.arena_offset % layout.align_bytes == 0 and r.nbytes % layout.align_bytes == 0
        assert r.arena_offset >= end, f"{r.name} overlaps the previous region"
        assert r.used_bytes <= r.nbytes
        end = r.arena_offset + r.nbytes
        for e in r.extents:
            assert e.region_offset + e.nbytes <= r.used_bytes
        for c in r.copies:
            assert c.region_offset + c.nbytes <= r.used_bytes
            src = [p for p in layout.primary_regions()
                   if p.arena_offset <= c.src_arena_offset and c.src_arena_offset + c.nbytes <= p.arena_offset + p.used_bytes]
            assert src, f"copy source of {r.name} is not inside a primary region"
    assert end <= layout.arena_bytes
    # every file byte range of every tensor is read exactly once into a primary region
    file_bytes = sum(e.nbytes for r in layout.primary_regions() for e in r.extents)
    assert file_bytes == catalog.total_bytes
    # each expert copy: the region holding it has the expected node
    for (layer, kind), p in layout.experts.items():
        et = catalog.expert_layers[layer][kind]
        assert p.offsets.shape == p.nodes.shape and p.n_expert == et.n_expert
        assert (p.offsets[:, 0] >= 0).all()
        for e in range(et.n_expert):
            for c in range(p.offsets.shape[1]):
                off = int(p.offsets[e, c])
                if off < 0:
                    continue
                r = next(r for r in regions if r.arena_offset <= off < r.arena_offset + r.used_bytes)
                assert off + et.slab_bytes <= r.arena_offset + r.used_bytes
                if r.policy == "bind":
                    assert p.nodes[e, c] == r.nodes[0]


def test_home_ranges():
    assert home_ranges(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert home_ranges(10, 4) == [(0, 3), (3, 5), (5, 8), (8, 10)]
    for e in range(10):  # the ranges are exactly e * N // E
        lo, hi = home_ranges(10, 4)[e * 4 // 10]
        assert lo <= e < hi


def test_expert_shard_homes_and_replicas(tmp_path):
    topo = four_nodes(tmp_path)
    cat = fake_catalog(n_layers=2, n_expert=32, slab_bytes=4096)
    layout = plan(cat, topo, cfg(replicas=1))
    check_consistent(layout, cat)
    p = layout.experts[(1, "down")]
    assert p.nodes[:, 0].tolist() == [e * 4 // 32 for e in range(32)]
    # replica of each expert: on the other socket (distance 21), the 8 experts of a node split
    # 4 + 4 over the two nodes there
    for home in range(4):
        reps = p.nodes[home * 8:(home + 1) * 8, 1]
        far = {2, 3} if home < 2 else {0, 1}
        assert set(reps.tolist()) == far
        assert sorted(np.bincount(reps, minlength=4)[sorted(far)].tolist()) == [4, 4]
    # replica bytes balance over the nodes
    rep_bytes = {r.nodes[0]: r.used_bytes for r in layout.replica_regions()}
    assert len(rep_bytes) == 4 and max(rep_bytes.values()) == min(rep_bytes.values())
    # one extent per (expert tensor, node) in each node's region: node i's experts are contiguous
    for r in layout.primary_regions():
        if r.name.startswith("experts."):
            assert len(r.extents) == 2 * 3
    # the dense region is interleaved over all nodes
    dense = next(r for r in layout.regions if r.name == "dense")
    assert dense.policy == "interleave" and dense.nodes == (0, 1, 2, 3)
    assert "blk.0.attn_q.weight" in layout.tensors and "blk.0.ffn_up_exps.weight" not in layout.tensors


def test_replicas_farthest_then_next_tier(tmp_path):
    topo = four_nodes(tmp_path)
    cat = fake_catalog(n_layers=1, n_expert=32)
    p = plan(cat, topo, cfg(replicas=2)).experts[(0, "gate")]
    for e in range(8):  # home 0: both far nodes first
        assert sorted(p.nodes[e, 1:].tolist()) == [2, 3]
    p3 = plan(cat, topo, cfg(replicas=3)).experts[(0, "gate")]
    for e in range(32):
        assert sorted(p3.nodes[e].tolist()) == [0, 1, 2, 3]
    # the farthest node wins when distances differ: a ring where node 2 is far from 0
    ring = [[10, 16, 32, 16], [16, 10, 16, 32], [32, 16, 10, 16], [16, 32, 16, 10]]
    topo_ring = four_nodes(tmp_path / "ring", dist=ring)
    pr = plan(cat, topo_ring, cfg(replicas=1)).experts[(0, "gate")]
    assert pr.nodes[:, 1].tolist() == [2] * 8 + [3] * 8 + [0] * 8 + [1] * 8


def test_snc_mirror_refused_interleave_accepted(tmp_path):
    topo = four_nodes(tmp_path, mem_gib=320.0)
    # 378 GiB: 58 MoE layers x 3 kinds x 256 experts of ~8.9 MB, plus some dense bytes
    slab = -(-(378 * GIB - 60 * 1024**2) // (58 * 3 * 256 * 64)) * 64
    cat = fake_catalog(n_layers=58, n_expert=256, slab_bytes=slab, dense_bytes=1024**2)
    assert 378 * GIB < cat.total_bytes < 378.1 * GIB
    with pytest.raises(CapacityError) as err:
        plan(cat, topo, cfg("mirror"))
    msg = str(err.value)
    assert "node 0 needs 378.0 GiB" in msg and "has 320.0 GiB" in msg and "mirror" in msg
    # not strict: the same facts come back as reasons for the CLI
    layout = plan(cat, topo, cfg("mirror"), strict=False)
    summary = plan_summary(layout, topo, cfg())
    assert summary["fits"] is False and len(summary["reasons"]) >= 4
    json.dumps(summary)
    inter = plan(cat, topo, cfg("interleave"))
    s = plan_summary(inter, topo, cfg())
    assert s["fits"] and s["reasons"] == []
    assert all(94 * GIB < b < 95 * GIB for b in s["bytes_per_node"].values())
    # expert_shard also fits (each node gets its quarter of the experts)
    assert not check_capacity(plan(cat, topo, cfg(), strict=False), topo, cfg())


def test_numa_balancing_warning(tmp_path):
    topo = four_nodes(tmp_path, balancing=1)
    layout = plan(fake_catalog(), topo, cfg())
    assert any("numa_balancing=1" in w for w in layout.warnings)
    assert plan_summary(layout, topo, cfg())["warnings"] == layout.warnings
    topo0 = four_nodes(tmp_path / "b0", balancing=0)
    assert not plan(fake_catalog(), topo0, cfg()).warnings


def test_one_node_host_trivial(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path, [[0, 1]], [16.0]))
    cat = fake_catalog(n_layers=2, n_expert=8)
    for policy in ("expert_shard", "interleave", "mirror", "local"):
        layout = plan(cat, topo, cfg(policy=policy))
        check_consistent(layout, cat)
        assert len(layout.regions) == 1 and layout.regions[0].policy == "local"
        assert layout.nodes == (0,) and layout.replicas == 0
        assert (layout.experts[(0, "up")].nodes == 0).all()
    with pytest.raises(ConfigError, match="replicas"):
        plan(cat, topo, cfg(replicas=1))


def test_mirror_layout(tmp_path):
    topo = four_nodes(tmp_path)
    cat = fake_catalog(n_layers=2, n_expert=8)
    layout = plan(cat, topo, cfg("mirror"))
    check_consistent(layout, cat)
    assert [r.nodes for r in layout.regions] == [(0,), (1,), (2,), (3,)]
    assert [r.role for r in layout.regions] == ["primary", "replica", "replica", "replica"]
    assert len(layout.tensors["output.weight"]) == 4
    p = layout.experts[(0, "down")]
    assert p.nodes.shape == (8, 4) and (p.nodes == np.arange(4)).all()
    first = layout.regions[0]
    for c in range(1, 4):  # copy c sits at the same offset inside its region
        assert (p.offsets[:, c] - layout.regions[c].arena_offset == p.offsets[:, 0] - first.arena_offset).all()


def test_interleave_and_local_ignore_replicas(tmp_path):
    topo = four_nodes(tmp_path)
    cat = fake_catalog()
    inter = plan(cat, topo, cfg("interleave", replicas=1))
    check_consistent(inter, cat)
    assert len(inter.regions) == 1 and inter.regions[0].policy == "interleave"
    assert any("ignored" in w for w in inter.warnings)
    assert (inter.experts[(0, "gate")].nodes == -1).all()
    local = plan(cat, topo, cfg("local"))
    assert local.regions[0].policy == "local" and local.nodes == (0, 1, 2, 3)


def test_gpu_node_binds_dense(tmp_path):
    topo = four_nodes(tmp_path)
    layout = plan(fake_catalog(), topo, cfg(), gpu_node=2)
    dense = next(r for r in layout.regions if r.name == "dense")
    assert dense.policy == "bind" and dense.nodes == (2,)
    with pytest.raises(ConfigError, match="GPU"):
        plan(fake_catalog(), topo, cfg(nodes=[0, 1]), gpu_node=3)


def test_config_errors(tmp_path):
    topo = four_nodes(tmp_path)
    with pytest.raises(ConfigError) as err:
        cfg("spread")  # the config refuses it before any plan
    assert "numa.policy: must be one of" in err.value.errors[0]
    with pytest.raises(ConfigError, match="replication.replicas: must be 0..3"):
        plan(fake_catalog(), topo, cfg(replicas=4))
    with pytest.raises(ConfigError, match=r"numa.nodes: \[9\]"):
        plan(fake_catalog(), topo, cfg(nodes=[0, 9]))
    two = plan(fake_catalog(), topo, cfg(nodes=[1, 3], replicas=1))
    assert two.nodes == (1, 3)
    assert set(two.experts[(0, "gate")].nodes[:, 1].tolist()) == {1, 3}


def test_unaligned_slabs_start_on_cache_lines(tmp_path):
    topo = four_nodes(tmp_path)
    cat = fake_catalog(n_layers=1, n_expert=8, slab_bytes=1000)
    layout = plan(cat, topo, cfg(replicas=1))
    check_consistent(layout, cat)
    for p in layout.experts.values():
        assert (p.offsets % 64 == 0).all()


def test_format_plan(tmp_path):
    topo = four_nodes(tmp_path)
    layout = plan(fake_catalog(n_expert=32), topo, cfg(replicas=1))
    s = plan_summary(layout, topo, cfg())
    assert s["experts_per_node"] == {"0": 16, "1": 16, "2": 16, "3": 16}
    assert s["primary_experts_per_node"] == {"0": 8, "1": 8, "2": 8, "3": 8}
    text = format_plan(s)
    assert "fits: yes" in text and "experts.node3" in text and "replicas.node0" in text


def test_round_robin_homes(tmp_path):
    topo = four_nodes(tmp_path)
    cat = fake_catalog(n_layers=2, n_expert=32, slab_bytes=4096)
    layout = plan(cat, topo, cfg(expert_homes="round_robin", replicas=1))
    check_consistent(layout, cat)
    p = layout.experts[(0, "up")]
    assert p.nodes[:, 0].tolist() == [e % 4 for e in range(32)]
    assert all(p.nodes[e, 1] in ({2, 3} if e % 4 < 2 else {0, 1}) for e in range(32))
    node0 = next(r for r in layout.regions if r.name == "experts.node0")
    assert len(node0.extents) == 2 * 3 * 8  # one slab per extent: a node's experts are not adjacent in the file
    with pytest.raises(ConfigError) as err:
        cfg(expert_homes="striped")
    assert "numa.expert_homes: must be one of" in err.value.errors[0]


@pytest.mark.parametrize("pages,align", [("thp", 2 * 1024**2), ("4k", 2 * 1024**2), ("2m", 2 * 1024**2),
                                         ("1g", GIB)])
def test_regions_follow_the_page_size(tmp_path, pages, align):
    topo = four_nodes(tmp_path)
    cat = fake_catalog(n_layers=2, n_expert=8, slab_bytes=4096)
    for policy in ("expert_shard", "interleave", "mirror"):
        layout = plan(cat, topo, cfg(policy, pages=pages, replicas=1 if policy == "expert_shard" else 0),
                      strict=False)
        check_consistent(layout, cat)
        assert layout.align_bytes == align
        assert all(r.arena_offset % align == 0 and r.nbytes == align for r in layout.regions)  # tiny regions
        assert layout.arena_bytes == len(layout.regions) * align


def test_hugetlb_capacity_counts_pool_pages(tmp_path):
    # node 0: 200 free 2 MiB pages; node 1: 3 free of 10 (7 in use); plenty of ordinary memory
    topo = Topology.read(write_sysfs(tmp_path, [[0, 1], [2, 3]], [64.0, 64.0], hugepages_2m=[(200, 200), (10, 3)]))
    cat = fake_catalog(n_layers=2, n_expert=8, slab_bytes=3 * 1024**2)  # 24 MiB per expert tensor
    layout = plan(cat, topo, cfg(pages="2m"), strict=False)
    need = {r.nodes[0]: r.nbytes for r in layout.regions if r.policy == "bind"}
    assert need == {0: 72 * 1024**2, 1: 72 * 1024**2}  # 4 experts x 3 MiB x 6 tensors, per node
    (short,) = check_capacity(layout, topo, cfg(pages="2m"))
    # node 1: its 36 expert pages plus its half of the interleaved dense region (1 page)
    assert short == ("node 1 needs 37 hugetlb pages of 2 MiB but its pool has 3 free (of 10); raise it: "
                     f"echo 44 > {hugepage_pool_path(1, 2048)}")
    with pytest.raises(CapacityError, match="node 1 needs 37 hugetlb pages"):
        plan(cat, topo, cfg(pages="2m"))
    assert not check_capacity(layout, topo, cfg(pages="thp"))  # ordinary memory: 64 GiB per node
