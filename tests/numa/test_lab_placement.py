"""Placement on a real multi-node kernel (the lab VM: 4 nodes, SNC-like distances).

fastload binds every region before first touch and fills it; placement must then find 100%
of the sampled pages of every expert slab on its planned node; replication must put every
replica on its node; ``interleave`` must spread each expert tensor evenly; a region touched
before it was bound must be found and migrated. Everything is read back with move_pages in
query mode, independently of the code under test's own sampler where it matters.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from types import SimpleNamespace as NS

import numpy as np
import pytest

from moe_service import memory, numa
from moe_service.gguf_model import GGUFModel
from moe_service.layout import Layout
from moe_service.numa import Topology
from pipeline.fastload import fastload
from pipeline.placement import format_residency, place, verify_residency
from pipeline.plan import plan
from pipeline.replication import replicate

GIB = 2**30
SLAB_STEP_BYTES = 64 * 1024  # pages sampled inside each expert slab (plus its last page)


def slab_residency(arena: np.ndarray, layout: Layout, columns: slice) -> tuple[int, list[str]]:
    """Query the node of sampled pages of every expert slab copy in ``columns`` of each
    ExpertPlacement; returns (pages checked, one line per slab copy off its planned node)."""
    base = memory.address_of(arena)
    bad, checked = [], 0
    for (layer, kind), p in sorted(layout.experts.items()):
        rel = np.append(np.arange(0, p.slab_bytes, SLAB_STEP_BYTES, dtype=np.uint64), np.uint64(p.slab_bytes - 1))
        offs = p.offsets[:, columns]
        want = p.nodes[:, columns]
        e_idx, c_idx = np.nonzero(offs >= 0)
        addrs = (base + offs[e_idx, c_idx].astype(np.uint64)[:, None] + rel[None, :]).ravel()
        status = numa.move_pages(addrs).reshape(len(e_idx), len(rel))
        checked += status.size
        for i in np.nonzero((status != want[e_idx, c_idx][:, None]).any(axis=1))[0]:
            found = {int(n): int(c) for n, c in zip(*np.unique(status[i], return_counts=True), strict=True)}
            bad.append(f"layer {layer} {kind} expert {e_idx[i]} copy {c_idx[i]}: planned node "
                       f"{want[e_idx[i], c_idx[i]]}, pages found {found}")
    return checked, bad


def file_bytes(catalog, offset: int, nbytes: int, shard: int = 0) -> np.ndarray:
    with open(catalog.shards[shard].path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(nbytes), dtype=np.uint8)


def test_vm_topology(initial_topology: Topology, topology: Topology, models):
    want_nodes = int(os.environ.get("LAB_NODES", "4"))
    assert topology.node_ids == tuple(range(want_nodes))
    assert all(n.cpus for n in topology.nodes)
    if os.environ.get("LAB_DISTANCES"):
        dist = json.loads(os.environ["LAB_DISTANCES"])
        assert [[topology.distance(a, b) for b in topology.node_ids] for a in topology.node_ids] == dist
    # the VM boots with numa_balancing=1: the plan records the warning; the session then sets 0
    assert initial_topology.numa_balancing == 1
    cat = GGUFModel.open(models["small"])
    warned = plan(cat, initial_topology, NS(policy="expert_shard", nodes=[], node_reserve_gib=0.1), None)
    assert any("numa_balancing=1" in w for w in warned.warnings)
    assert topology.numa_balancing == 0


def test_syscalls_on_each_node(topology: Topology):
    nbytes = 4 * 1024 * 1024
    for node in topology.node_ids:
        arena = memory.reserve_arena(nbytes)
        addr = memory.address_of(arena)
        try:
            _, st = numa.page_nodes(addr, nbytes)  # absent: a query does not fault pages in
            assert numa.status_counts(st) == ({}, 2, 0), st
            numa.mbind(addr, nbytes, numa.MPOL_BIND, [node])
            assert numa.get_mempolicy(addr) == (numa.MPOL_BIND, [node])
            arena[::4096] = 1
            _, st = numa.page_nodes(addr, nbytes, step_bytes=4096)
            assert (st == node).all(), f"node {node}: {numa.status_counts(st)}"
            # move every 4 KiB page to the next node (THP pages are split or moved whole)
            other = topology.node_ids[(topology.node_ids.index(node) + 1) % topology.n_nodes]
            numa.mbind(addr, nbytes, numa.MPOL_BIND, [other])  # policy first, or pages bounce back
            pages = numa.sample_addresses(addr, nbytes, 4096)
            moved = numa.move_pages(pages, np.full(pages.size, other), numa.MPOL_MF_MOVE)
            for _ in range(3):  # a page can be briefly busy (-EBUSY: on a per-CPU LRU list): again
                busy = moved != other
                if not busy.any():
                    break
                moved[busy] = numa.move_pages(pages[busy], np.full(int(busy.sum()), other), numa.MPOL_MF_MOVE)
            assert (moved == other).all(), numa.status_counts(moved)
            assert (numa.page_nodes(addr, nbytes, 4096)[1] == other).all()
        finally:
            memory.free_arena(arena)


class TestExpertShard:
    """The big model planned expert_shard with one replica per expert, loaded once for both
    tests (freed when the class is done, before the other tests need the memory)."""

    @pytest.fixture(scope="class")
    def shard_loaded(self, topology, models):
        cat = GGUFModel.open(models["big"])
        layout = plan(cat, topology, NS(policy="expert_shard", nodes=[], node_reserve_gib=0.1), NS(replicas=1))
        arena, _weights, stats = fastload(cat, layout, threads=4)
        yield cat, layout, arena, stats
        memory.free_arena(arena)

    def test_expert_shard_every_slab_on_its_node(self, shard_loaded, topology):
        cat, layout, arena, stats = shard_loaded
        report = place(arena, layout)
        print(f"\nfastload {stats.bytes_loaded / GIB:.2f} GiB, THP {stats.anon_huge_bytes / GIB:.2f} GiB")
        print(format_residency(report))
        assert report.ok and not report.migrated and report.on_plan_fraction() == 1.0
        checked, bad = slab_residency(arena, layout, slice(0, 1))
        assert checked > 3000 and not bad, "\n".join(bad[:10])
        # experts of node i are e*4//32 == i, and the dense region is interleaved over all 4
        p = layout.experts[(1, "up")]
        assert p.nodes[:, 0].tolist() == [e * topology.n_nodes // 32 for e in range(32)]
        maps = {m["start"]: m["policy"] for m in numa.read_numa_maps()}
        base = memory.address_of(arena)
        for r in layout.primary_regions():
            want = f"bind:{r.nodes[0]}" if r.policy == "bind" else "interleave:" + numa.format_cpulist(r.nodes)
            assert maps.get(base + r.arena_offset) == want, (r.name, maps.get(base + r.arena_offset))

    def test_replicas_on_their_nodes(self, shard_loaded, topology):
        cat, layout, arena, _ = shard_loaded
        rep = replicate(arena, layout, topology, threads_per_node=1)
        assert rep.residency is not None and rep.residency.ok
        print("\n" + format_residency(rep.residency))
        checked, bad = slab_residency(arena, layout, slice(1, 2))
        assert checked > 3000 and not bad, "\n".join(bad[:10])
        dist = topology.distance
        for p in layout.experts.values():
            for e in range(p.n_expert):
                home, copy = int(p.nodes[e, 0]), int(p.nodes[e, 1])
                # the replica sits on a node at the largest distance from the home node
                assert dist(home, copy) == max(dist(home, n) for n in topology.node_ids if n != home)
                a, b = int(p.offsets[e, 0]), int(p.offsets[e, 1])
                assert np.array_equal(arena[a:a + p.slab_bytes], arena[b:b + p.slab_bytes])
        # and the primary bytes are the file's
        et = cat.expert_layers[0]["down"]
        _s, fo, n = et.slab(31)
        off = int(layout.experts[(0, "down")].offsets[31, 1])
        assert np.array_equal(arena[off:off + n], file_bytes(cat, fo, n))


def test_interleave_spreads_each_expert_tensor(topology, models):
    cat = GGUFModel.open(models["big"])
    layout = plan(cat, topology, NS(policy="interleave", nodes=[], node_reserve_gib=0.1), None)
    arena, _w, _stats = fastload(cat, layout, threads=4)
    try:
        report = verify_residency(arena, layout)
        assert report.ok
        base = memory.address_of(arena)
        even = 1 / topology.n_nodes
        for (layer, kind), p in sorted(layout.experts.items()):
            name = cat.expert_layers[layer][kind].tensor.name
            off, nbytes = layout.tensors[name][0], p.slab_bytes * p.n_expert
            addrs = numa.sample_addresses(base + off, nbytes, 4096)  # every page of the tensor
            st = numa.move_pages(addrs)
            counts, absent, other = numa.status_counts(st)
            assert absent == 0 and other == 0
            share = {n: counts.get(n, 0) / st.size for n in topology.node_ids}
            print(f"{name}: {nbytes / 2**20:.0f} MiB, share per node {share}")
            for n, s in share.items():
                assert abs(s - even) <= 0.10 * even, f"{name}: node {n} holds {s:.3f} of it (even: {even:.3f})"
    finally:
        memory.free_arena(arena)


def test_region_touched_before_binding_is_migrated(topology, models):
    cat = GGUFModel.open(models["small"])
    layout = plan(cat, topology, NS(policy="expert_shard", nodes=[], node_reserve_gib=0.1), None)
    victim = next(r for r in layout.regions if r.name == "experts.node2")
    wrong_cpu = topology.node(0).cpus[0]
    touched = {}

    def late_mbind(address, nbytes, mode, nodes):
        if tuple(nodes) == victim.nodes and mode == numa.MPOL_BIND and nbytes == victim.nbytes:
            # first touch of the whole region from node 0's CPU, before any policy: local -> node 0
            def touch():
                with numa.run_on_cpus([wrong_cpu]):
                    ctypes.memset(address, 0x5A, nbytes)

            t = threading.Thread(target=touch)
            t.start()
            t.join()
            touched["status"] = numa.status_counts(numa.page_nodes(address, nbytes)[1])
        numa.mbind(address, nbytes, mode, nodes)  # without MPOL_MF_MOVE: present pages stay

    arena, _w, _stats = fastload(cat, layout, threads=4, mbind=late_mbind)
    try:
        assert touched["status"][0] == {0: victim.nbytes // numa.SAMPLE_STEP_BYTES}
        report = place(arena, layout)
        before = next(r for r in report.before if r.name == victim.name)
        after = next(r for r in report.regions if r.name == victim.name)
        print("\n" + format_residency(report))
        assert before.stray == before.samples and before.node_samples == {0: before.samples}
        assert report.migrated == [victim.name]
        assert after.ok and after.node_samples == {2: after.samples}
        checked, bad = slab_residency(arena, layout, slice(0, 1))
        assert not bad, "\n".join(bad[:10])
        et = cat.expert_layers[1]["gate"]
        e = int(np.nonzero(layout.experts[(1, "gate")].nodes[:, 0] == 2)[0][-1])
        _s, fo, n = et.slab(e)
        off = int(layout.experts[(1, "gate")].offsets[e, 0])
        assert np.array_equal(arena[off:off + n], file_bytes(cat, fo, n))  # the data moved with the pages
    finally:
        memory.free_arena(arena)


def test_mirror_copy_per_node(topology, models):
    cat = GGUFModel.open(models["small"])
    layout = plan(cat, topology, NS(policy="mirror", nodes=[], node_reserve_gib=0.1), None)
    arena, weights, _stats = fastload(cat, layout, threads=4)
    try:
        assert place(arena, layout).ok
        rep = replicate(arena, layout, topology)
        assert rep.residency.ok and rep.bytes_copied == 3 * layout.regions[0].used_bytes
        checked, bad = slab_residency(arena, layout, slice(0, None))
        assert not bad, "\n".join(bad[:10])
        offs, nodes = weights.expert_copies(0, "up")
        assert nodes.shape == (32, topology.n_nodes) and (nodes == np.arange(topology.n_nodes)).all()
        t = cat.tensors["output.weight"]
        for c in range(topology.n_nodes):
            assert np.array_equal(weights.tensor("output.weight", c), file_bytes(cat, t.file_offset, t.nbytes))
    finally:
        memory.free_arena(arena)


def test_pipeline_stages_end_to_end(topology, models):
    """prepare -> fastload -> placement -> replication through the declared runner."""
    import pipeline.fastload  # noqa: F401  (registers the stages)
    import pipeline.placement  # noqa: F401
    import pipeline.replication  # noqa: F401
    from moe_service.config import load_config
    from pipeline.context import PipelineContext
    from pipeline.prepare import prepare
    from pipeline.runner import PipelineRunner

    cfg = load_config(data={
        "model": {"path": str(models["small"])},
        "pipeline": {"stages": ["fastload", "placement", "replication"]},
        "numa": {"policy": "expert_shard"},
        "replication": {"replicas": 2},
        "fastload": {"threads": 4},
    })
    ctx = PipelineContext(cfg)
    prepare(ctx)
    runner = PipelineRunner(ctx)
    try:
        runner.run()
        assert ctx.residency.ok and ctx.residency.on_plan_fraction() == 1.0
        names = {r.name for r in ctx.residency.regions}
        assert {f"replicas.node{n}" for n in topology.node_ids} <= names
        offs, nodes = ctx.weights.expert_copies(1, "down")
        assert offs.shape == (32, 3) and (offs >= 0).all()
        assert all(len(set(row)) == 3 for row in nodes.tolist())  # three different nodes per expert
        checked, bad = slab_residency(ctx.arena, ctx.layout, slice(0, None))
        assert not bad, "\n".join(bad[:10])
    finally:
        runner.close()
