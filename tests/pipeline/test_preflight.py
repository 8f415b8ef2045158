"""Preflight over fake hosts (sysfs trees) and fake catalogs backed by sparse files."""

from __future__ import annotations

import resource

import pytest

from moe_service.config import load_config
from moe_service.engine.device import cuda_absent_reason
from moe_service.errors import CapacityError, PreflightError
from moe_service.numa import Topology, hugepage_pool_path
from pipeline.plan import plan
from pipeline.preflight import CPU_FLAGS, format_report, run_preflight
from tests.support.numa_fixtures import GIB, cfg, fake_catalog, write_sysfs


def sparse_model(tmp_path, total_gib: float, n_expert=8):
    """A fake catalog of about ``total_gib`` whose shard is a sparse file of the right size."""
    slab = int(total_gib * GIB / (2 * 3 * n_expert)) // 64 * 64
    path = tmp_path / "model.gguf"
    cat = fake_catalog(n_layers=2, n_expert=n_expert, slab_bytes=slab, path=path)
    with open(path, "wb") as f:
        f.truncate(cat.shards[0].size_bytes)
    return cat


def config(mode: str = "off", pages: str = "thp"):
    """The service config these checks read: a 0.5 GiB reserve per node, pin.mode, fastload.pages."""
    return load_config(data={"numa": {"node_reserve_gib": 0.5}, "pin": {"mode": mode},
                             "fastload": {"pages": pages}})


def test_model_larger_than_memory_is_refused_with_both_numbers(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1], [2, 3]], [8.0, 8.0]))
    cat = sparse_model(tmp_path, 20.0)
    layout = plan(cat, topo, cfg(), strict=False)
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
    layout = plan(cat, topo, cfg(), strict=False)
    report = run_preflight(cat, topo, layout, config())
    assert report.ok
    assert {c.name for c in report.warnings} == {"thp", "numa_balancing"}


def test_catalog_problems_fail(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1]], [8.0]))
    cat = sparse_model(tmp_path, 0.01)
    with open(cat.shards[0].path, "r+b") as f:
        f.truncate(cat.shards[0].size_bytes - 100)  # the last tensor now reaches past the end
    layout = plan(cat, topo, cfg(), strict=False)
    with pytest.raises(PreflightError) as err:
        run_preflight(cat, topo, layout, config())
    assert not isinstance(err.value, CapacityError)
    assert "output.weight" in str(err.value) and "past the end" in str(err.value)
    cat.shards[0].path.unlink()
    with pytest.raises(PreflightError, match="cannot be read"):
        run_preflight(cat, topo, layout, config())


def test_cpu_flags(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1], [2, 3]], [8.0, 8.0], cpu_flags="fpu sse2 avx"))
    cat = sparse_model(tmp_path, 1.0)
    layout = plan(cat, topo, cfg(), strict=False)
    report = run_preflight(cat, topo, layout, config(), raise_on_fail=False)
    by = {c.name: c for c in report.checks}
    assert CPU_FLAGS == ("avx2", "fma", "f16c")
    assert by["cpu_flags"].status == "fail" and "lacks avx2, fma, f16c" in by["cpu_flags"].message
    assert by["cpu_flags"].numbers == {"missing": ["avx2", "fma", "f16c"]}
    with pytest.raises(PreflightError, match="the CPU lacks avx2"):
        report.raise_for_failures()


def test_hugetlb_pools_refuse_with_the_numbers_and_the_command(tmp_path):
    # node 0: 1024 free 2 MiB pages; node 1: 10 of 30 free; 8 GiB of ordinary memory each
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1], [2, 3]], [8.0, 8.0],
                                     hugepages_2m=[(1024, 1024), (30, 10)]))
    cat = sparse_model(tmp_path, 1.0)
    layout = plan(cat, topo, cfg(pages="2m"), strict=False)
    report = run_preflight(cat, topo, layout, config(pages="2m"), raise_on_fail=False)
    by = {c.name: c for c in report.checks}
    assert not any(name.startswith("memory.") for name in by)  # the pools, not MemFree, hold the arena
    assert "thp" not in by
    assert by["hugepages.node0"].status == "ok"  # 2 GiB of free 2 MiB pages for ~0.5 GiB
    node1 = by["hugepages.node1"]
    need = node1.numbers["needed_pages"]
    assert 250 < need < 260 and node1.numbers["free_pages"] == 10 and node1.numbers["pool_pages"] == 30
    assert node1.status == "fail" and node1.capacity
    assert node1.message == (f"node 1 needs {need} hugetlb pages of 2 MiB but its pool has 10 free (of 30); "
                             f"raise it: echo {30 + need - 10} > {hugepage_pool_path(1, 2048)}")
    assert by["hugepages.host"].status == "ok"  # 1034 free pages in all
    with pytest.raises(CapacityError, match="hugepages-2048kB/nr_hugepages"):
        report.raise_for_failures()
    # 1 GiB pages: the plan takes whole GiB per region and the pools have none
    layout_1g = plan(cat, topo, cfg(pages="1g"), strict=False)
    by_1g = {c.name: c for c in run_preflight(cat, topo, layout_1g, config(pages="1g"), raise_on_fail=False).checks}
    assert by_1g["hugepages.node0"].numbers["needed_pages"] == 1 + 1  # its experts + its half of dense
    assert "hugepages-1048576kB/nr_hugepages" in by_1g["hugepages.node0"].message


no_cuda = pytest.mark.skipif(cuda_absent_reason() is None, reason="a CUDA device is present: pin and device checks pass")


@no_cuda
def test_memlock_when_pinning(tmp_path):
    """No CUDA here: pin.mode = auto skips pinning (nothing to lock); required fails and checks
    memlock. (pipeline/pin.py's own tests cover auto with a GPU and a short RLIMIT_MEMLOCK.)"""
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1]], [8.0]))
    cat = sparse_model(tmp_path, 1.0)
    layout = plan(cat, topo, cfg(), strict=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
    try:
        auto = run_preflight(cat, topo, layout, config(mode="auto"))
        pin = next(c for c in auto.checks if c.name == "pin")
        assert pin.status == "ok" and "skipped" in pin.message and "memlock" not in {c.name for c in auto.checks}
        with pytest.raises(PreflightError, match="LimitMEMLOCK=infinity") as err:
            run_preflight(cat, topo, layout, config(mode="required"))
        assert "pin.mode = required but" in str(err.value)
        off = run_preflight(cat, topo, layout, config(mode="off"))
        assert "memlock" not in {c.name for c in off.checks}
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


@no_cuda
def test_engine_device_cuda_without_a_gpu_fails(tmp_path):
    topo = Topology.read(write_sysfs(tmp_path / "sys", [[0, 1]], [8.0]))
    cat = sparse_model(tmp_path, 0.01)
    layout = plan(cat, topo, cfg(), strict=False)
    report = run_preflight(cat, topo, layout, load_config(data={"engine": {"device": "cuda"}}), raise_on_fail=False)
    device = next(c for c in report.checks if c.name == "engine.device")
    assert device.status == "fail" and device.message.startswith("engine.device = cuda but torch")
    cpu = run_preflight(cat, topo, layout, load_config(data={"engine": {"device": "cpu"}}), raise_on_fail=False)
    assert next(c for c in cpu.checks if c.name == "engine.device").numbers == {"device": "cpu"}


def test_kv_cache_that_does_not_fit_is_refused_with_the_numbers(tmp_path):
    """An explicit context whose KV cache exceeds engine.kv_cache_gib: preflight fails (a
    capacity error) naming the context, the bytes and the budget; plan's kv_capacity agrees."""
    from types import SimpleNamespace

    from moe_service.config import Settings
    from moe_service.errors import CapacityError
    from moe_service.numa import Topology
    from pipeline.plan import kv_capacity, plan
    from pipeline.preflight import run_preflight

    topo = Topology.read(root="/")
    params = SimpleNamespace(n_layer=48, n_head_kv=4, head_dim=128, head_dim_v=128, n_ctx_train=40960)
    cat = SimpleNamespace(params=params, tensors={}, expert_layers={}, shards=[], metadata={})
    cfg = Settings(model={"context_tokens": 40960}, engine={"kv_cache_gib": 1.0}, serve={"parallel": 4})
    layout = plan(cat, topo, cfg, strict=False)
    kv = kv_capacity(cat, layout, topo, cfg)
    assert not kv["fits"] and kv["total_bytes"] == 40960 * 48 * 4 * 128 * 2 * 2 * 4
    assert "model.context_tokens = 40960" in kv["reasons"][0] and "15.00 GiB" in kv["reasons"][0]
    report = run_preflight(cat, topo, layout, cfg, raise_on_fail=False)
    check = next(c for c in report.checks if c.name == "kv_cache")
    assert check.status == "fail" and "engine.kv_cache_gib = 1.00 GiB" in check.message
    with pytest.raises(CapacityError, match="kv_cache_gib"):
        report.raise_for_failures()
    ok = Settings(model={"context_tokens": 0}, engine={"kv_cache_gib": 1.0}, serve={"parallel": 4})
    kv = kv_capacity(cat, layout, topo, ok)
    assert kv["fits"] and kv["n_ctx"] == 2560  # 1 GiB / (4 seqs x 96 KiB/token) = 2730 -> 2560
