"""fastload on real files and real anonymous memory: every byte where the layout says, the
policy calls before first touch, the populate fallback, THP, the read loop over a >2 GiB
tensor of a sparse file, thread capping, peak RSS, progress, and the Stage."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from moe_service import memory, numa
from moe_service.config import load_config
from moe_service.errors import CapacityError, Interrupted, ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.layout import (
    REGION_ALIGN_BYTES,
    ExpertPlacement,
    Extent,
    Layout,
    Region,
    align_up,
    plain_layout,
)
from pipeline.context import PipelineContext
from pipeline.fastload import (
    FastloadStage,
    effective_threads,
    fastload,
    plan_chunks,
    reread,
    status_line,
)
from tests.support.gguf_factory import write_moe_gguf, write_sparse_gguf

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


def file_bytes(catalog, shard: int, offset: int, nbytes: int) -> bytes:
    with open(catalog.shards[shard].path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def sha(b) -> str:
    return hashlib.sha256(b).hexdigest()


def run_python(script: str):
    """Run ``script`` in a fresh interpreter (its own affinity, its own peak RSS) from the repo;
    returns the JSON of its last stdout line."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    """A 3-shard MoE model of ~9 MB: 4 layers, 8 experts of 256 x 256 Q8_0."""
    d = tmp_path_factory.mktemp("split")
    paths = write_moe_gguf(
        d / "m.gguf", n_layer=4, n_embd=256, n_expert=8, n_ff_exp=256, split_max_tensors=16
    )
    assert len(paths) == 3
    return GGUFModel.open(paths[1])


def test_every_tensor_and_slab_equals_the_file(split_model):
    m = split_model
    layout = plain_layout(m)
    arena, store, stats = fastload(m, layout, threads=4, chunk_bytes=2 * MiB, max_read_bytes=4099)
    try:
        assert stats.bytes_loaded == m.total_bytes and stats.chunks > 3
        assert stats.read_calls >= m.total_bytes // 4099  # the short-read loop ran
        for name, t in m.tensors.items():
            assert sha(store.tensor(name)) == sha(file_bytes(m, t.shard, t.file_offset, t.nbytes)), name
        for (layer, kind), _ in layout.experts.items():
            et = m.expert_tensor(layer, kind)
            offsets, nodes = store.expert_copies(layer, kind)
            for e in range(et.n_expert):
                off = int(offsets[e, 0])
                assert arena[off : off + et.slab_bytes].tobytes() == file_bytes(m, *et.slab(e))
        assert memory.address_of(arena) % REGION_ALIGN_BYTES == 0
    finally:
        memory.free_arena(arena)


def test_prefetch_thread_and_whole_chunk_populate_load_the_same_bytes(split_model):
    m = split_model
    layout = plain_layout(m)
    for kw in ({"prefetch": True}, {"populate_step_bytes": 0}):
        arena, store, stats = fastload(m, layout, threads=2, chunk_bytes=2 * MiB, **kw)
        try:
            for name, t in m.tensors.items():
                assert store.tensor(name).tobytes() == file_bytes(m, t.shard, t.file_offset, t.nbytes), (
                    kw,
                    name,
                )
        finally:
            memory.free_arena(arena)


def hand_layout(m: GGUFModel) -> Layout:
    """Experts bound to node 0 in reverse expert order (slabs scattered over the file), dense
    tensors interleaved, and an empty replica region: what a plan for one node could make."""
    experts_r = Region("node0 experts", "primary", "bind", (0,), 0, 0)
    dense_r = Region("dense", "primary", "interleave", (0,), 0, 0)
    replica_r = Region("replicas node0", "replica", "bind", (0,), 0, 0)
    tensors: dict[str, list[int]] = {}
    experts = {}
    off = 0
    for layer, lay in m.expert_layers.items():
        for kind, et in lay.items():
            offs = np.zeros((et.n_expert, 1), np.int64)
            for e in reversed(range(et.n_expert)):
                shard, file_off, n = et.slab(e)
                experts_r.extents.append(Extent(shard, file_off, n, off))
                offs[e, 0] = off
                off = align_up(off + n, 64)
            experts[(layer, kind)] = ExpertPlacement(
                layer, kind, et.slab_bytes, offs, np.zeros_like(offs, np.int32)
            )
    experts_r.used_bytes, experts_r.nbytes = off, align_up(off, REGION_ALIGN_BYTES)
    dense_r.arena_offset = experts_r.nbytes
    off = 0
    expert_names = {et.tensor.name for lay in m.expert_layers.values() for et in lay.values()}
    for t in m.tensors.values():
        if t.name not in expert_names:
            dense_r.extents.append(Extent(t.shard, t.file_offset, t.nbytes, off))
            tensors[t.name] = [dense_r.arena_offset + off]
            off = align_up(off + t.nbytes, 64)
    dense_r.used_bytes, dense_r.nbytes = off, align_up(off, REGION_ALIGN_BYTES)
    replica_r.arena_offset = dense_r.arena_offset + dense_r.nbytes
    replica_r.nbytes = 4 * REGION_ALIGN_BYTES
    regions = [experts_r, dense_r, replica_r]
    return Layout(
        regions, replica_r.arena_offset + replica_r.nbytes, tensors, experts, nodes=(0,), policy="bind"
    )


def test_hand_built_layout_binds_before_first_touch(split_model, monkeypatch):
    m = split_model
    layout = hand_layout(m)
    events: list[tuple] = []
    real_madvise = memory.madvise

    def spy_madvise(addr, n, advice):
        events.append(("madvise", advice, addr, n))
        real_madvise(addr, n, advice)

    real_mbind = numa.mbind

    def spy_mbind(addr, n, mode, nodes):
        events.append(("mbind", mode, addr, n, nodes))
        real_mbind(addr, n, mode, nodes)

    monkeypatch.setattr(memory, "madvise", spy_madvise)
    arena, store, stats = fastload(m, layout, threads=2, chunk_bytes=2 * MiB, mbind=spy_mbind)
    try:
        base = memory.address_of(arena)
        binds = [e for e in events if e[0] == "mbind"]
        assert binds == [
            ("mbind", numa.MPOL_BIND, base + r.arena_offset, r.nbytes, (0,))
            if r.policy == "bind"
            else ("mbind", numa.MPOL_INTERLEAVE, base + r.arena_offset, r.nbytes, (0,))
            for r in layout.regions
        ]
        first_populate = next(
            i for i, e in enumerate(events) if e[:2] == ("madvise", memory.MADV_POPULATE_WRITE) and e[3] > 0
        )
        assert max(i for i, e in enumerate(events) if e[0] == "mbind") < first_populate
        # the kernel holds the policies we asked for
        experts_r, dense_r, replica_r = layout.regions
        assert numa.get_mempolicy(base + experts_r.arena_offset) == (numa.MPOL_BIND, [0])
        assert numa.get_mempolicy(base + dense_r.arena_offset) == (numa.MPOL_INTERLEAVE, [0])
        assert numa.get_mempolicy(base + replica_r.arena_offset) == (numa.MPOL_BIND, [0])
        # bytes: every slab at its scattered place, every dense tensor
        for (layer, kind), p in layout.experts.items():
            et = m.expert_tensor(layer, kind)
            for e in range(et.n_expert):
                off = int(p.offsets[e, 0])
                assert arena[off : off + et.slab_bytes].tobytes() == file_bytes(m, *et.slab(e))
        for name in layout.tensors:
            t = m.tensors[name]
            assert store.tensor(name).tobytes() == file_bytes(m, t.shard, t.file_offset, t.nbytes)
        # the replica region was bound but not populated: replication fills it
        populated = [
            (a - base, a - base + n)
            for _, adv, a, n in (e for e in events if e[0] == "madvise")
            if adv == memory.MADV_POPULATE_WRITE
        ]
        assert all(hi <= replica_r.arena_offset for _, hi in populated)
        assert stats.bytes_loaded == m.total_bytes
    finally:
        memory.free_arena(arena)


def test_populate_falls_back_to_touch_when_madvise_says_einval(split_model, monkeypatch):
    real_madvise = memory.madvise

    def old_kernel(addr, n, advice):
        if advice == memory.MADV_POPULATE_WRITE:
            raise OSError(errno.EINVAL, "Invalid argument")
        real_madvise(addr, n, advice)

    monkeypatch.setattr(memory, "madvise", old_kernel)
    m = split_model
    with capture_logs() as logs:
        arena, store, stats = fastload(m, plain_layout(m), threads=2, chunk_bytes=2 * MiB)
    try:
        assert stats.populate == "touch"
        assert [e["event"] for e in logs].count("fastload_populate_fallback") == 1
        for name, t in m.tensors.items():
            assert store.tensor(name).tobytes() == file_bytes(m, t.shard, t.file_offset, t.nbytes)
    finally:
        memory.free_arena(arena)


def test_enomem_during_populate_is_a_capacity_error_naming_the_region(split_model, monkeypatch):
    real_madvise = memory.madvise

    def full_node(addr, n, advice):
        if advice == memory.MADV_POPULATE_WRITE and n:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        real_madvise(addr, n, advice)

    monkeypatch.setattr(memory, "madvise", full_node)
    with pytest.raises(CapacityError, match=r"region node0 experts \(bind, node\(s\) \[0\]\).*ENOMEM"):
        fastload(split_model, hand_layout(split_model), threads=2, chunk_bytes=2 * MiB)


@pytest.mark.skipif(memory.thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off")
def test_arena_is_anonymous_memory_backed_by_huge_pages(tmp_path):
    offsets = write_sparse_gguf(tmp_path / "s.gguf", 64 * MiB)
    m = GGUFModel.open(tmp_path / "s.gguf")
    huge0 = memory.anon_huge_bytes()
    arena, store, stats = fastload(m, plain_layout(m), threads=2)
    try:
        grown = memory.anon_huge_bytes() - huge0
        assert stats.hugepages and grown >= 32 * MiB and stats.anon_huge_bytes == grown
        base = memory.address_of(arena)
        maps = Path("/proc/self/maps").read_text().splitlines()
        (line,) = [
            ln for ln in maps if int(ln.split("-")[0], 16) <= base < int(ln.split()[0].split("-")[1], 16)
        ]
        assert len(line.split()) == 5, f"arena mapping is not anonymous: {line}"  # no path column
        big_off, big_n = offsets["big"]
        assert sha(store.tensor("big")) == sha(file_bytes(m, 0, big_off, big_n))
    finally:
        memory.free_arena(arena)


@pytest.mark.slow  # 2.2 GB of memory populated and compared: ~13 s on a quiet 2-core VM
def test_tensor_over_2gib_of_a_sparse_file(tmp_path):
    """One >2 GiB tensor (a hole with random patches across the 2 GiB mark), one whole
    chunk read in one go with the per-call cap forced small: the loop and 64-bit offsets."""
    path = tmp_path / "big.gguf"
    offsets = write_sparse_gguf(path, (2 << 30) + 8 * MiB)
    m = GGUFModel.open(path)
    big = m.tensors["big"]
    assert big.nbytes > 2**31 and (big.file_offset, big.nbytes) == offsets["big"]
    cap = 256 * MiB + 4097
    arena, store, stats = fastload(
        m, plain_layout(m), threads=2, chunk_bytes=4 << 30, max_read_bytes=cap, populate_step_bytes=0
    )
    try:  # one chunk, populated whole, then one pread_full of the big tensor: the loop ran
        assert stats.chunks == 1 and stats.read_calls == -(-big.nbytes // cap) + 1
        view = store.tensor("big")
        step = 256 * MiB
        with open(path, "rb") as f:
            f.seek(big.file_offset)
            for lo in range(0, big.nbytes, step):
                assert view[lo : lo + step].tobytes() == f.read(min(step, big.nbytes - lo)), (
                    f"bytes {lo}.. differ"
                )
        assert np.count_nonzero(view[(2 << 30) - big.file_offset - 4096 : (2 << 30) - big.file_offset + 4096])
        assert store.tensor("small").tobytes() == file_bytes(m, 0, *offsets["small"])
    finally:
        memory.free_arena(arena)


def test_pread_loop_and_eof_names_the_file(tmp_path):
    p = tmp_path / "f.bin"
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    buf = bytearray(9_000)
    fd = os.open(p, os.O_RDONLY)
    try:
        calls = memory.pread_full(fd, memoryview(buf), 1000, path=p, max_call_bytes=997)
        assert bytes(buf) == data[1000:] and calls == -(-9000 // 997)
        with pytest.raises(ModelFileError, match=rf"{p}: file ends at byte 10000 but 1000 more bytes"):
            memory.pread_full(fd, memoryview(bytearray(2000)), 9000, path=p)
    finally:
        os.close(fd)


def test_file_shrinking_after_the_catalog_is_a_model_file_error(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf", n_embd=256, n_ff_exp=256, n_expert=8)
    m = GGUFModel.open(path)
    layout = plain_layout(m)
    with open(path, "r+b") as f:
        f.truncate(m.shards[0].size_bytes - 5000)
    with pytest.raises(ModelFileError, match=rf"{path}: file ends at byte"):
        fastload(m, layout, threads=2)


def test_layout_past_the_end_of_a_shard_is_refused_before_allocating(split_model, monkeypatch):
    m = split_model
    layout = plain_layout(m)
    r = layout.regions[0]
    e = r.extents[-1]
    r.extents[-1] = Extent(e.shard, m.shards[e.shard].size_bytes - 10, e.nbytes, e.region_offset)

    def no_alloc(*a, **k):
        raise AssertionError("arena reserved before validation")

    monkeypatch.setattr(memory, "reserve_arena", no_alloc)
    with pytest.raises(ModelFileError, match="past the end of the file"):
        fastload(m, layout)


def test_chunks_are_2mib_aligned_within_regions(split_model):
    layout = hand_layout(split_model)
    chunks = plan_chunks(split_model, layout, chunk_bytes=3 * MiB)  # rounded up to 4 MiB
    for c in chunks:
        r = c.region
        assert (
            c.start % REGION_ALIGN_BYTES == 0
            and r.arena_offset <= c.start < c.end <= r.arena_offset + r.nbytes
        )
        assert c.end - c.start <= 4 * MiB
        assert all(c.start <= a and a + n <= c.end for _, _, n, a in c.reads)
        ranges = c.file_ranges()  # what prefetch asks the kernel to read ahead: merged, same bytes
        assert sum(n for _, _, n in ranges) == c.read_bytes and len(ranges) <= len(c.reads)
        for (s1, o1, n1), (s2, o2, _) in zip(ranges, ranges[1:], strict=False):
            assert s1 < s2 or o1 + n1 < o2
    assert sum(c.read_bytes for c in chunks) == split_model.total_bytes


def test_thread_count_is_capped_by_usable_cpus(split_model):
    assert effective_threads(16) == min(16, len(os.sched_getaffinity(0)))
    assert effective_threads(16, n_chunks=1) == 1 and effective_threads(1) == 1
    script = textwrap.dedent(f"""
        import os, json
        os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
        from moe_service.gguf_model import GGUFModel
        from moe_service.layout import plain_layout
        from pipeline.fastload import effective_threads, fastload
        m = GGUFModel.open({str(split_model.path)!r})
        arena, store, stats = fastload(m, plain_layout(m), threads=16, chunk_bytes=2 << 20)
        print(json.dumps([effective_threads(16), stats.threads]))
    """)
    assert run_python(script) == [1, 1]


def test_peak_rss_is_the_bytes_loaded_and_no_more(tmp_path):
    """No staging buffer: the process's peak RSS grows by the arena alone (within 5%)."""
    write_sparse_gguf(tmp_path / "r.gguf", 384 * MiB)
    script = textwrap.dedent(f"""
        import json
        from moe_service import memory, numa
        from moe_service.gguf_model import GGUFModel
        from moe_service.layout import plain_layout
        from pipeline.fastload import fastload
        m = GGUFModel.open({str(tmp_path / "r.gguf")!r})
        layout = plain_layout(m)
        rss0, hwm0 = memory.rss_bytes()
        arena, store, stats = fastload(m, layout, threads=2)
        rss1, hwm1 = memory.rss_bytes()
        print(json.dumps(dict(hwm0=hwm0, hwm1=hwm1, loaded=stats.bytes_loaded)))
    """)
    r = run_python(script)
    assert r["loaded"] > 380 * MiB
    assert r["hwm1"] - r["hwm0"] <= 1.05 * r["loaded"], r


def test_progress_reports_and_status_line(split_model):
    seen = []
    arena, _, stats = fastload(
        split_model,
        plain_layout(split_model),
        threads=2,
        chunk_bytes=2 * MiB,
        progress_interval_s=0.001,
        on_progress=lambda *a: seen.append(a),
    )
    memory.free_arena(arena)
    assert seen and seen[-1][0] == seen[-1][1] == stats.bytes_loaded
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False))
    assert status_line(int(6.1 * 2**30), int(13.5 * 2**30), 3.2) == "fastload 45% 6.1/13.5 GiB 3.2 GB/s"


def test_reread_refills_a_loaded_arena(split_model):
    m = split_model
    layout = plain_layout(m)
    arena, store, _ = fastload(m, layout, threads=2)
    try:
        arena[:] = 0
        stats = reread(m, layout, arena, threads=2)
        assert stats.bytes_loaded == m.total_bytes
        t = m.tensors["output.weight"]
        assert store.tensor(t.name).tobytes() == file_bytes(m, t.shard, t.file_offset, t.nbytes)
    finally:
        memory.free_arena(arena)


def _ctx(model: GGUFModel) -> PipelineContext:
    ctx = PipelineContext(
        load_config(
            data={
                "pipeline": {"stages": ["fastload"]},
                "fastload": {"threads": 2, "chunk_bytes": 2 * MiB, "progress_interval_s": 0.001},
            }
        )
    )
    ctx.catalog = model
    ctx.layout = plain_layout(model)
    return ctx


def test_stage_fills_context_reports_status_and_frees(split_model):
    ctx = _ctx(split_model)
    stage = FastloadStage()
    assert stage.skip_reason(ctx) is None
    stage.run(ctx)
    try:
        assert ctx.arena.nbytes == ctx.layout.arena_bytes and ctx.weights.arena is ctx.arena
        assert ctx.status_text.startswith("fastload 100% ") and ctx.status_text.endswith(" GB/s")
        assert any(s.startswith("STATUS=fastload ") for s in ctx.notifier.sent)
        t = split_model.tensors["blk.3.ffn_down_exps.weight"]
        assert ctx.weights.tensor(t.name).tobytes() == file_bytes(
            split_model, t.shard, t.file_offset, t.nbytes
        )
    finally:
        stage.close(ctx)
    assert ctx.arena is None and ctx.weights is None


def test_stage_stops_on_shutdown_request(split_model):
    ctx = _ctx(split_model)
    ctx.request_shutdown("SIGTERM")
    with pytest.raises(Interrupted):
        FastloadStage().run(ctx)
    assert ctx.arena is None


# -- fastload.pages: 4 KiB pages, hugetlb flags and alignment (hugetlb loads run in tests/numa) --


def test_hugetlb_mmap_flags():
    assert memory.hugetlb_mmap_flags(2 * MiB) == memory.MAP_HUGETLB | memory.MAP_HUGE_2MB == 0x40000 | (21 << 26)
    assert memory.hugetlb_mmap_flags(1024 * MiB) == memory.MAP_HUGETLB | memory.MAP_HUGE_1GB == 0x40000 | (30 << 26)
    with pytest.raises(ValueError, match="power of two"):
        memory.hugetlb_mmap_flags(3 * MiB)


def _pool_free_2m() -> int:
    path = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
    return int(path.read_text()) if path.exists() else 0


def test_hugetlb_arena_is_mapped_with_map_hugetlb():
    """The flags really reach mmap: with no free 2 MiB pages the kernel refuses the mapping
    (an ordinary anonymous mapping would succeed); with some, the mapping's pages are 2 MiB."""
    if _pool_free_2m() < 2:
        with pytest.raises(CapacityError, match=r"cannot map 2 hugetlb pages of 2048 kB .*free_hugepages"):
            memory.reserve_arena(4 * MiB, hugetlb_page_bytes=2 * MiB)
        return
    arena = memory.reserve_arena(4 * MiB, hugetlb_page_bytes=2 * MiB)
    try:
        base = memory.address_of(arena)
        assert base % (2 * MiB) == 0
        smaps = Path("/proc/self/smaps").read_text().split("\n")
        at = next(i for i, ln in enumerate(smaps) if ln.startswith(f"{base:x}-"))
        page = next(ln for ln in smaps[at:] if ln.startswith("KernelPageSize:"))
        assert page.split()[1] == "2048"
    finally:
        memory.free_arena(arena)
    with pytest.raises(ValueError, match="multiple of its 2097152-byte pages"):
        memory.reserve_arena(3 * MiB, hugetlb_page_bytes=2 * MiB)


def test_hugetlb_needs_page_aligned_regions_and_madvise_populate(split_model):
    from moe_service.errors import ConfigError, StageError
    from pipeline.fastload import hugetlb_page_bytes, populate_mode

    two_mib = plain_layout(split_model)  # planned for THP: regions aligned to 2 MiB
    assert hugetlb_page_bytes(two_mib, "thp") == 0 and hugetlb_page_bytes(two_mib, "2m") == 2 * MiB
    with pytest.raises(StageError, match=r"region all .* not aligned to the 1073741824-byte pages of "
                                         r"fastload.pages = 1g: the plan aligned regions to 2097152 bytes"):
        fastload(split_model, two_mib, pages="1g")
    one_gib = plain_layout(split_model, align_bytes=1024 * MiB)
    assert one_gib.arena_bytes == 1024 * MiB and hugetlb_page_bytes(one_gib, "1g") == 1024 * MiB
    with pytest.raises(ConfigError, match="populate = touch cannot be used with fastload.pages = 2m"):
        populate_mode("touch", "2m")
    assert populate_mode("touch", "thp") == "touch"


def test_hugetlb_shortage_names_the_node_and_its_pool():
    from pipeline.fastload import shortage_error

    region = Region("experts.node1", "primary", "bind", (1,), 4 * MiB, 6 * MiB, used_bytes=5 * MiB)
    layout = Layout([Region("experts.node0", "primary", "bind", (0,), 0, 4 * MiB), region], 10 * MiB, {}, {},
                    nodes=(0, 1))
    pools = {0: numa.HugepagePool(2048, 8, 8), 1: numa.HugepagePool(2048, 4, 2)}
    err = shortage_error("fastload", region, 8 * MiB, 10 * MiB, errno.EFAULT, layout, 2048, pools)
    assert str(err) == (
        "fastload: populating region experts.node1 (bind, node(s) [1]) failed with EFAULT at region bytes "
        "4194304..6291456 of 6291456: a hugetlb pool is short: node 1 needs 3 hugetlb pages of 2048 kB for this "
        "stage and its pool had 2 free (of 4) when the stage started; raise it: echo 5 > "
        "/sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages")


def test_4k_pages_take_no_huge_pages(split_model):
    huge0 = memory.anon_huge_bytes()
    arena, store, stats = fastload(split_model, plain_layout(split_model), threads=2, pages="4k")
    try:
        assert stats.pages == "4k" and not stats.hugepages
        assert memory.anon_huge_bytes() - huge0 <= 0  # MADV_NOHUGEPAGE even where THP is "always"
        t = next(iter(split_model.tensors.values()))
        assert sha(store.tensor(t.name)) == sha(file_bytes(split_model, t.shard, t.file_offset, t.nbytes))
    finally:
        memory.free_arena(arena)
