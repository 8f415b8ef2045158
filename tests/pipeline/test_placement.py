"""Placement and replication on this host (one node): the copy plan, the sampler, the checks.

Multi-node behaviour (strays found and migrated, replicas on their nodes) runs in the lab VM
(tests/numa, booted by tests/lab).
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from moe_service.errors import StageError
from moe_service.layout import Layout, Region
from moe_service.numa import Topology
from pipeline.placement import format_residency, place, status_line, verify_residency
from pipeline.plan import plan
from pipeline.replication import copy_tasks, replicate
from tests.support.numa_fixtures import cfg, fake_catalog, write_sysfs

SNC = [[10, 12, 21, 21], [12, 10, 21, 21], [21, 21, 10, 12], [21, 21, 12, 10]]


def fill_primaries(arena: np.ndarray, layout: Layout, file_bytes: np.ndarray) -> None:
    """What fastload does with the extents, from an in-memory 'file'."""
    for r in layout.primary_regions():
        for e in r.extents:
            dst = r.arena_offset + e.region_offset
            arena[dst:dst + e.nbytes] = file_bytes[e.file_offset:e.file_offset + e.nbytes]


@pytest.mark.parametrize("policy,replicas", [("expert_shard", 0), ("expert_shard", 1), ("expert_shard", 3),
                                             ("mirror", 0), ("interleave", 0)])
def test_every_copy_holds_the_file_bytes(tmp_path, policy, replicas):
    topo = Topology.read(write_sysfs(tmp_path, [[0], [1], [2], [3]], [4.0] * 4, distances=SNC))
    cat = fake_catalog(n_layers=2, n_expert=32, slab_bytes=1000)  # unaligned slabs: one extent each
    layout = plan(cat, topo, cfg(policy, replicas=replicas))
    rng = np.random.default_rng(0)
    file_bytes = rng.integers(0, 256, size=cat.shards[0].size_bytes, dtype=np.uint8)
    arena = np.zeros(layout.arena_bytes, dtype=np.uint8)
    fill_primaries(arena, layout, file_bytes)
    # no NUMA or memory calls: the copy machinery alone (threads unpinned, no mbind, no populate)
    rep = replicate(arena, layout, None, threads_per_node=2, chunk_bytes=4096, bind=False, verify=False,
                    populate=False)
    assert rep.bytes_copied == sum(c.nbytes for r in layout.replica_regions() for c in r.copies)
    for (layer, kind), p in layout.experts.items():
        et = cat.expert_layers[layer][kind]
        for e in range(et.n_expert):
            _shard, fo, n = et.slab(e)
            for c in range(p.offsets.shape[1]):
                off = int(p.offsets[e, c])
                assert off >= 0
                assert np.array_equal(arena[off:off + n], file_bytes[fo:fo + n]), (layer, kind, e, c)
    for name, offs in layout.tensors.items():
        t = cat.tensors[name]
        for off in offs:
            assert np.array_equal(arena[off:off + t.nbytes], file_bytes[t.file_offset:t.file_offset + t.nbytes])


def test_copy_tasks_chunking(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path, [[0], [1]], [4.0] * 2))
    layout = plan(fake_catalog(n_expert=8, slab_bytes=4096), topo, cfg("mirror"))
    tasks = copy_tasks(layout, chunk_bytes=10_000)
    assert {t.node for t in tasks} == {1}
    assert sum(t.nbytes for t in tasks) == layout.regions[0].used_bytes
    assert max(t.nbytes for t in tasks) == 10_000


def _mapped(nbytes: int):
    m = mmap.mmap(-1, nbytes)
    return m, np.frombuffer(m, dtype=np.uint8)


def test_residency_on_this_host():
    node = Topology.read().node_ids[0]
    m, arena = _mapped(8 * 1024 * 1024)
    region = Region("experts.node0", "primary", "bind", (node,), 0, 4 * 1024 * 1024, 4 * 1024 * 1024)
    untouched = Region("dense", "primary", "interleave", (node,), 4 * 1024 * 1024, 4 * 1024 * 1024, 3 * 1024 * 1024)
    layout = Layout([region, untouched], arena.nbytes, {}, {}, nodes=(node,), policy="expert_shard")
    arena[:4 * 1024 * 1024] = 7  # the first region written, the second never touched
    rep = verify_residency(arena, layout)
    r0, r1 = rep.regions
    assert r0.ok and r0.node_samples == {node: 2} and r0.bytes_per_node() == {node: 4 * 1024 * 1024}
    assert r1.absent == 2 and not r1.ok
    with pytest.raises(StageError, match="region dense: 2 of 2 sampled pages were never written"):
        place(arena, layout)
    arena[4 * 1024 * 1024:] = 1
    ok = place(arena, layout)
    assert ok.ok and ok.on_plan_fraction() == 1.0 and not ok.migrated
    assert "experts.node0" in format_residency(ok) and status_line(ok).startswith("placement: 100.0%")
    del arena, rep, ok
    m.close()


def test_replicate_with_binding_on_this_host(tmp_path):
    """Replica regions bound and filled with pinned threads, then verified, on a real mapping."""
    topo = Topology.read()
    node = topo.node_ids[0]
    # a two-'node' plan whose both nodes are this host's node 0 cannot be made; use mirror on a
    # hand-made layout: primary region bound to node 0, one replica region also on node 0
    m, arena = _mapped(8 * 1024 * 1024)
    from moe_service.layout import CopyExtent

    prim = Region("mirror.node0", "primary", "bind", (node,), 0, 2 * 1024 * 1024, 1_000_000)
    rep_r = Region("mirror.copy", "replica", "bind", (node,), 2 * 1024 * 1024, 2 * 1024 * 1024, 1_000_000,
                   copies=[CopyExtent(0, 1_000_000, 0)])
    layout = Layout([prim, rep_r], 4 * 1024 * 1024, {}, {}, nodes=(node,), policy="mirror", replicas=1)
    arena[:1_000_000] = np.arange(1_000_000) % 251
    seen = []
    rep = replicate(arena, layout, topo, threads_per_node=2, chunk_bytes=300_000,
                    progress=lambda done, total: seen.append((done, total)))
    assert np.array_equal(arena[2 * 1024 * 1024:2 * 1024 * 1024 + 1_000_000], arena[:1_000_000])
    assert rep.bytes_copied == 1_000_000 and rep.bytes_per_node == {node: 1_000_000}
    assert rep.residency is not None and rep.residency.ok
    assert max(d for d, _ in seen) == 1_000_000 and len(seen) == 4
    del arena
    m.close()
