"""Preflight over fake hosts (sysfs trees) and fake catalogs backed by sparse files."""

from __future__ import annotations

import resource
from types import SimpleNamespace as NS

import pytest
from numa_fixtures import GIB, Cfg, fake_catalog, write_sysfs

from moe_service.errors import CapacityError, PreflightError
from moe_service.numa import Topology
from pipeline.plan import plan
from pipeline.preflight import format_report, run_preflight


def sparse_model(tmp_path, total_gib: float, n_expert=8):
    """A fake catalog of about ``total_gib`` whose shard is a sparse file of the right size."""
    slab = int(total_gib * GIB / (2 * 3 * n_expert)) // 64 * 64
    path = tmp_path / "model.gguf"
    cat = fake_catalog(n_layers=2, n_expert=n_expert, slab_bytes=slab, path=path)
    with open(path, "wb") as f:
        f.truncate(cat.shards[0].size_bytes)
    return cat


def config(**pin):
    return NS(numa=Cfg(node_reserve_gib=0.5), pin=NS(**pin) if pin else None, fastload=None, preflight=None)


def test_model_larger_than_memory_is_refused_with_both_numbers(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1], [2, 3]], [8.0, 8.0]))
    cat = sparse_model(tmp_path, 20.0)
    layout = plan(cat, topo, Cfg(), Cfg(), strict=False)
    with pytest.raises(CapacityError) as err:
        run_preflight(cat, topo, layout, config())
    msg = str(err.value)
    # the host: 20 GiB needed vs 16 GiB MemAvailable; each node: ~10 GiB vs 7.5 GiB
    assert "the plan needs 20.0 GiB" in msg and "MemAvailable is 16.0 GiB" in msg
    assert "node 0 needs 10.0 GiB" in msg and "has 7.5 GiB (8053063680 bytes) available" in msg
    report = run_preflight(cat, topo, layout, config(), raise_on_fail=False)
    host = next(c for c in report.checks if c.name == "memory.host")
    assert host.numbers["needed_bytes"] > 20 * GIB - 64 * 1024**2 and host.numbers["available_bytes"] == 16 * GIB
    assert "FAIL  memory.node1" in format_report(report)


def test_model_that_fits_passes_with_warnings(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1], [2, 3]], [8.0, 8.0], numa_balancing=1,
                                     thp="always madvise [never]"))
    cat = sparse_model(tmp_path, 1.0)
    layout = plan(cat, topo, Cfg(), Cfg(), strict=False)
    report = run_preflight(cat, topo, layout, config())
    assert report.ok
    assert {c.name for c in report.warnings} == {"thp", "numa_balancing"}


def test_catalog_problems_fail(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1]], [8.0]))
    cat = sparse_model(tmp_path, 0.01)
    with open(cat.shards[0].path, "r+b") as f:
        f.truncate(cat.shards[0].size_bytes - 100)  # the last tensor now reaches past the end
    layout = plan(cat, topo, Cfg(), Cfg(), strict=False)
    with pytest.raises(PreflightError) as err:
        run_preflight(cat, topo, layout, config())
    assert not isinstance(err.value, CapacityError)
    assert "output.weight" in str(err.value) and "past the end" in str(err.value)
    cat.shards[0].path.unlink()
    with pytest.raises(PreflightError, match="cannot be read"):
        run_preflight(cat, topo, layout, config())


def test_cpu_flags_and_hugepages(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1], [2, 3]], [8.0, 8.0], cpu_flags="fpu sse2 avx",
                                     hugepages_2m=[(1024, 1024), (10, 10)]))
    cat = sparse_model(tmp_path, 1.0)
    layout = plan(cat, topo, Cfg(), Cfg(), strict=False)
    cfg = NS(numa=Cfg(), pin=None, fastload=NS(hugepage_kib=2048), preflight=None)
    report = run_preflight(cat, topo, layout, cfg, raise_on_fail=False)
    by = {c.name: c for c in report.checks}
    assert by["cpu_flags"].status == "fail" and "avx2, fma, f16c" in by["cpu_flags"].message
    assert by["hugepages.node0"].status == "ok"  # 2 GiB of free 2 MiB pages for ~0.5 GiB
    assert by["hugepages.node1"].status == "fail" and "hugepages-2048kB/nr_hugepages" in by["hugepages.node1"].message
    with pytest.raises(CapacityError):
        report.raise_for_failures()


def test_memlock_when_pinning(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1]], [8.0]))
    cat = sparse_model(tmp_path, 1.0)
    layout = plan(cat, topo, Cfg(), Cfg(), strict=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
    try:
        warn = run_preflight(cat, topo, layout, config(mode="auto"))
        assert next(c for c in warn.checks if c.name == "memlock").status == "warn"
        with pytest.raises(PreflightError, match="LimitMEMLOCK=infinity"):
            run_preflight(cat, topo, layout, config(mode="required"))
        off = run_preflight(cat, topo, layout, config(mode="off"))
        assert "memlock" not in {c.name for c in off.checks}
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
