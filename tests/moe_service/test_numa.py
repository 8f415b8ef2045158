"""Topology.read over fake sysfs trees, and the syscall wrappers on this (one-node) host."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from moe_service import numa
from moe_service.errors import NumaError
from moe_service.numa import Topology, format_cpulist, parse_cpulist
from tests.support.numa_fixtures import GIB, write_sysfs


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    assert format_cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_four_node_host(tmp_path):
    root = write_sysfs(
        tmp_path,
        node_cpus=[[0, 1], [2, 3], [4, 5], [6, 7]],
        node_mem_gib=[64, 64, 64, 64],
        node_free_gib=[60, 50, 40, 30],
        distances=[[10, 12, 21, 21], [12, 10, 21, 21], [21, 21, 10, 12], [21, 21, 12, 10]],
        numa_balancing=1,
        hugepages_2m=[(512, 500), (0, 0), (0, 0), (16, 16)],
        gpus=[("0000:17:00.0", 0), ("0000:b1:00.0", 2)],
    )
    t = Topology.read(root)
    assert t.node_ids == (0, 1, 2, 3)
    assert t.node(1).cpus == (2, 3)
    assert t.node(3).mem_available_bytes == 30 * GIB
    assert t.node(0).mem_total_bytes == 64 * GIB
    assert t.distance(0, 1) == 12 and t.distance(0, 3) == 21 and t.distance(2, 2) == 10
    assert t.node(0).hugepages[2048].nr == 512 and t.node(0).hugepages[2048].free_bytes == 500 * 2 * 1024**2
    assert t.gpu_nodes() == [0, 2]  # the HDMI audio functions are not GPUs
    assert t.numa_balancing == 1
    assert t.thp_enabled == "madvise"
    assert {"avx2", "fma", "f16c"} <= t.cpu_flags
    assert t.mem_available_bytes == 180 * GIB
    d = t.describe()
    assert d["distances"]["0"]["3"] == 21 and d["nodes"][2]["cpus"] == "4-5"
    with pytest.raises(NumaError, match="node 7"):
        t.node(7)


def test_affinity_and_cgroup_restrict_cpus(tmp_path):
    root = write_sysfs(tmp_path, node_cpus=[[0, 1, 2, 3], [4, 5, 6, 7]], node_mem_gib=[8, 8],
                       allowed_cpus="0-5", cgroup_cpus="1-7")
    t = Topology.read(root)
    assert t.node(0).cpus == (1, 2, 3)
    assert t.node(1).cpus == (4, 5)
    # an explicit affinity replaces the status file's
    t2 = Topology.read(root, affinity=[0, 7])
    assert t2.node(0).cpus == () and t2.node(1).cpus == (7,)


def test_no_numa_sysfs_is_one_node(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 1048576 kB\nMemFree: 524288 kB\nMemAvailable: 786432 kB\n")
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-3\n")
    t = Topology.read(tmp_path)
    assert t.node_ids == (0,)
    assert t.node(0).cpus == (0, 1, 2, 3)
    assert t.node(0).mem_available_bytes == 768 * 1024**2
    assert t.numa_balancing is None and not t.is_multi_node


def test_live_host_reads():
    t = Topology.read()
    assert t.n_nodes >= 1
    assert t.cpus() and set(t.cpus()) <= set(__import__("os").sched_getaffinity(0))
    assert t.mem_available_bytes > 0


def test_nodemask_bits():
    mask, maxnode = numa.nodemask([0, 3, 64])
    assert maxnode == numa.NODEMASK_BITS + 1
    assert mask[0] == 0b1001 and mask[1] == 1
    assert numa.nodes_of_mask(mask) == [0, 3, 64]
    with pytest.raises(NumaError, match="outside"):
        numa.nodemask([5000])


def test_sample_addresses():
    a = numa.sample_addresses(0x200000 + 100, 5 * 1024 * 1024)
    assert a[0] == 0x200000 and len(a) == 3
    assert numa.sample_addresses(0x1000, 0).size == 0


def _anon(nbytes: int) -> tuple[mmap.mmap, np.ndarray, int]:
    m = mmap.mmap(-1, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    return m, a, a.ctypes.data


def test_syscalls_on_this_host():
    node = Topology.read().node_ids[0]
    m, a, addr = _anon(4 * 1024 * 1024)
    _, st = numa.page_nodes(addr, a.nbytes)
    assert numa.status_counts(st) == ({}, 2, 0)  # nothing touched yet: query mode does not fault pages in
    numa.mbind(addr, a.nbytes, numa.MPOL_BIND, [node])
    assert numa.get_mempolicy(addr) == (numa.MPOL_BIND, [node])
    a[::4096] = 1
    nodes, absent, other = numa.status_counts(numa.page_nodes(addr, a.nbytes)[1])
    assert nodes == {node: 2} and absent == 0 and other == 0
    # MOVE to the node they are already on succeeds and reports the node
    st = numa.move_pages(numa.sample_addresses(addr, a.nbytes), [node, node], numa.MPOL_MF_MOVE)
    assert st.tolist() == [node, node]
    with pytest.raises(NumaError, match=r"mbind\(addr=0x[0-9a-f]+, len=4194304, mode=bind, nodes=\[999\].*EINVAL"):
        numa.mbind(addr, a.nbytes, numa.MPOL_BIND, [999])
    with pytest.raises(NumaError, match="aligned"):
        numa.mbind(addr + 1, 4096, numa.MPOL_BIND, [node])
    del a
    m.close()


def test_set_mempolicy_round_trip():
    node = Topology.read().node_ids[0]
    numa.set_mempolicy(numa.MPOL_BIND, [node])
    try:
        assert numa.get_mempolicy() == (numa.MPOL_BIND, [node])
    finally:
        numa.set_mempolicy(numa.MPOL_DEFAULT)
    assert numa.get_mempolicy()[0] == numa.MPOL_DEFAULT


def test_run_on_cpus_restores():
    import os

    before = os.sched_getaffinity(0)
    one = min(before)
    with numa.run_on_cpus([one]):
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == before


def test_l2_cache_bytes_reads_the_level_2_cache_of_cpu0(tmp_path):
    cache = tmp_path / "sys/devices/system/cpu/cpu0/cache"
    for name, level, kind, size in (("index0", "1", "Data", "48K"), ("index1", "1", "Instruction", "32K"),
                                    ("index2", "2", "Unified", "2048K\n"), ("index3", "3", "Unified", "300M")):
        (cache / name).mkdir(parents=True)
        for field, text in (("level", level), ("type", kind), ("size", size)):
            (cache / name / field).write_text(text + "\n")
    assert numa.l2_cache_bytes(tmp_path) == 2 << 20
    (cache / "index2" / "size").write_text("1M\n")
    assert numa.l2_cache_bytes(tmp_path) == 1 << 20


def test_l2_cache_bytes_falls_back_where_sysfs_does_not_say(tmp_path):
    assert numa.l2_cache_bytes(tmp_path) == numa.L2_DEFAULT_BYTES  # no cache folder (a VM)
    index = tmp_path / "sys/devices/system/cpu/cpu0/cache/index2"
    index.mkdir(parents=True)
    (index / "level").write_text("2\n")
    (index / "type").write_text("Unified\n")
    (index / "size").write_text("garbage\n")
    assert numa.l2_cache_bytes(tmp_path) == numa.L2_DEFAULT_BYTES
