"""hugetlb pages on a real multi-node kernel (the lab VM: 4 nodes, pools at 0 when it boots).

Each test reserves per-node pools of 2 MiB pages through sysfs (as the Ansible `hugepages`
role does), loads the small lab model with ``fastload.pages = 2m`` and checks, independently
of the code under test: every sampled page of every expert slab copy is on its planned node,
the arena's mappings are hugetlb (numa_maps kernelpagesize_kB=2048), each node's pool lost
exactly the pages the plan put there (bound regions whole, the interleaved region's pages
where move_pages finds them), and freeing the arena gives them back. A pool too small for its
node is refused by preflight with the command that fixes it, and a load that tries anyway
fails with a CapacityError naming the node and its pool (not a SIGBUS).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moe_service import memory, numa
from moe_service.errors import CapacityError
from moe_service.gguf_model import GGUFModel
from moe_service.numa import Topology, hugepage_pool_path
from pipeline.fastload import fastload
from pipeline.placement import format_residency, place
from pipeline.plan import plan
from pipeline.preflight import run_preflight
from pipeline.replication import replicate
from tests.numa.lab_helpers import file_bytes, lab_config, slab_residency

PAGE_BYTES = 2 * 1024 * 1024
PAGE_KIB = 2048
POOL_PAGES = 64  # 128 MiB per node of the VM's 1.5 GiB


def set_pool(node: int, pages: int) -> int:
    """Ask for ``pages`` 2 MiB pages on ``node``; returns what the kernel granted (read back)."""
    path = Path(hugepage_pool_path(node, PAGE_KIB))
    path.write_text(f"{pages}\n")
    return int(path.read_text())


def free_pages(topology: Topology) -> dict[int, int]:
    return {n: numa.hugepage_pools(n)[PAGE_KIB].free for n in topology.node_ids}


@pytest.fixture
def pools(topology):
    """POOL_PAGES free 2 MiB pages on every node for the test, all given back after it."""
    try:
        for n in topology.node_ids:
            granted = set_pool(n, POOL_PAGES)  # more when a failed test still holds pages
            assert granted >= POOL_PAGES, f"node {n}: the kernel granted {granted} 2 MiB pages, not {POOL_PAGES}"
        yield POOL_PAGES
    finally:
        for n in topology.node_ids:
            set_pool(n, 0)


def pages_by_node(arena: np.ndarray, region) -> dict[int, int]:
    """Node of each 2 MiB page of ``region`` that is present, counted (move_pages, query mode)."""
    addrs = memory.address_of(arena) + region.arena_offset + np.arange(region.nbytes // PAGE_BYTES,
                                                                        dtype=np.uint64) * PAGE_BYTES
    counts, _absent, _other = numa.status_counts(numa.move_pages(addrs))
    return counts


def test_2m_pages_land_on_their_nodes_and_come_from_each_nodes_pool(topology, models, pools):
    host = Topology.read()  # the pools as they are now
    cat = GGUFModel.open(models["small"])
    cfg = lab_config("expert_shard", replicas=1, pages="2m")
    layout = plan(cat, host, cfg)  # strict: the pools must hold the plan
    report = run_preflight(cat, host, layout, cfg)
    by = {c.name: c for c in report.checks}
    assert all(by[f"hugepages.node{n}"].status == "ok" for n in host.node_ids)
    assert not any(name.startswith("memory.") for name in by)

    before = free_pages(host)
    arena, weights, stats = fastload(cat, layout, threads=4, pages="2m")
    try:
        after_load = free_pages(host)
        assert stats.pages == "2m" and stats.hugepages
        base = memory.address_of(arena)
        spans = [(base + r.arena_offset, base + r.arena_offset + r.nbytes) for r in layout.regions]
        # the arena's mappings that hold pages (numa_maps prints kernelpagesize_kB only for those)
        maps = [m for m in numa.read_numa_maps() if m["pages"] and any(lo <= m["start"] < hi for lo, hi in spans)]
        assert len(maps) >= host.n_nodes and all(m["page_kib"] == PAGE_KIB for m in maps), maps

        # every primary page where the plan put it, and each node's pool short by exactly those pages
        res = place(arena, layout)
        print("\n" + format_residency(res))
        assert res.ok and not res.migrated
        checked, bad = slab_residency(arena, layout, slice(0, 1))
        assert checked > 500 and not bad, "\n".join(bad[:10])
        want = {n: 0 for n in host.node_ids}
        for r in layout.primary_regions():
            if r.policy == "bind":
                want[r.nodes[0]] += r.nbytes // PAGE_BYTES
            else:  # interleaved: count where the kernel put each page, and that it spread them
                spread = pages_by_node(arena, r)
                assert sum(spread.values()) == r.nbytes // PAGE_BYTES and set(spread) <= set(r.nodes)
                assert max(spread.values()) - min(spread.get(n, 0) for n in r.nodes) <= 1, spread
                for n, c in spread.items():
                    want[n] += c
        took = {n: before[n] - after_load[n] for n in host.node_ids}
        print(f"pool pages taken per node by fastload: {took} (planned {want})")
        assert took == want

        # replicas: populated from their nodes' pools before the copy, on their nodes, the same bytes
        rep = replicate(arena, layout, host, threads_per_node=1, pages="2m")
        assert rep.residency is not None and rep.residency.ok
        checked, bad = slab_residency(arena, layout, slice(1, 2))
        assert checked > 500 and not bad, "\n".join(bad[:10])
        after_rep = free_pages(host)
        want_rep = {n: 0 for n in host.node_ids}
        for r in layout.replica_regions():
            want_rep[r.nodes[0]] += r.nbytes // PAGE_BYTES
        assert {n: after_load[n] - after_rep[n] for n in host.node_ids} == want_rep
        et = cat.expert_layers[1]["down"]
        _s, fo, n = et.slab(5)
        for c in (0, 1):
            off = int(layout.experts[(1, "down")].offsets[5, c])
            assert np.array_equal(arena[off:off + n], file_bytes(cat, fo, n))
        del weights
    finally:
        memory.free_arena(arena)
    assert free_pages(host) == before  # every page back in its node's pool


def test_short_pool_refused_by_preflight_and_by_the_load(topology, models, pools):
    assert set_pool(3, 1) == 1, "node 3's pool still holds pages of an earlier test"
    host = Topology.read()
    cat = GGUFModel.open(models["small"])
    cfg = lab_config("expert_shard", pages="2m")
    layout = plan(cat, host, cfg, strict=False)
    node3 = next(c for c in run_preflight(cat, host, layout, cfg, raise_on_fail=False).checks
                 if c.name == "hugepages.node3")
    need = node3.numbers["needed_pages"]
    assert node3.status == "fail" and need >= 2
    assert node3.message.endswith(f"raise it: echo {need} > {hugepage_pool_path(3, PAGE_KIB)}")
    before = free_pages(host)
    with pytest.raises(CapacityError) as err:
        fastload(cat, layout, threads=4, pages="2m")  # the other pools cover the mapping; node 3 cannot
    msg = str(err.value)
    print(f"\n{msg}")
    assert "node(s) [3]" in msg or "[0, 1, 2, 3]" in msg  # node 3's experts or the interleaved region
    assert f"node 3 needs {need} hugetlb pages of 2048 kB" in msg and "its pool had 1 free (of 1)" in msg
    assert free_pages(host) == before  # the failed load gave every page back
