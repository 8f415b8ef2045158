"""fastload.io and the pipelined load: every mode (buffered / direct, interleaved / pipelined)
loads the same bytes (hash per region, and each extent against the file), with file offsets
and sizes that are not 4 KiB aligned (zero-copy spans, bounce-buffer spans, heads and tails);
the O_DIRECT read loop on its own over random ranges; the fallback to buffered reads when a
filesystem refuses O_DIRECT (at open: ramfs or an old tmpfs; at the first read: simulated,
as some network filesystems do), logged once; io = auto's choice; no page cache left behind
by a direct load; and the placement of extents congruent to their file offsets."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from moe_service import fileio, memory
from moe_service.errors import CapacityError, ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.layout import PAGE_BYTES, plain_layout
from pipeline.fastload import choose_io, fastload, reread
from tests.pipeline.test_fastload import hand_layout
from tests.support.gguf_factory import write_moe_gguf

MiB = 2**20
MODES = [  # (io, pipeline)
    ("buffered", "off"),
    ("buffered", "on"),
    ("direct", "on"),
]


def file_bytes(catalog, shard: int, offset: int, nbytes: int) -> bytes:
    with open(catalog.shards[shard].path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def region_hashes(arena: np.ndarray, layout) -> list[str]:
    return [hashlib.sha256(arena[r.arena_offset : r.arena_offset + r.used_bytes]).hexdigest()
            for r in layout.primary_regions()]


def assert_extents_equal_file(arena: np.ndarray, layout, catalog) -> None:
    for r in layout.primary_regions():
        for e in r.extents:
            a = r.arena_offset + e.region_offset
            assert arena[a : a + e.nbytes].tobytes() == file_bytes(catalog, e.shard, e.file_offset, e.nbytes), (
                r.name, e)


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    """general.alignment 8 (tensor offsets not cache-line aligned: every direct span goes
    through the bounce buffer) and odd-sized F32 extras (a file size not a 4 KiB multiple)."""
    d = tmp_path_factory.mktemp("odd")
    (path,) = write_moe_gguf(d / "m.gguf", n_layer=3, n_embd=256, n_expert=8, n_ff_exp=256, alignment=8,
                             extra_tensors=5, seed=3)
    m = GGUFModel.open(path)
    assert m.shards[0].size_bytes % PAGE_BYTES
    assert any(t.file_offset % 64 for t in m.tensors.values())
    return m


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """~6 MB in 2 shards, default alignment (32): the plain layout places tensors congruent
    to their file offsets, so direct spans land in place, with unaligned heads and tails."""
    paths = write_moe_gguf(tmp_path_factory.mktemp("m") / "m.gguf", n_layer=3, n_embd=256, n_expert=8,
                           n_ff_exp=256, extra_tensors=3, split_max_tensors=20, seed=5)
    assert len(paths) == 2
    return GGUFModel.open(paths[0])


def load(m, layout, io, pipeline, **kw):
    kw = {"threads": 2, "chunk_bytes": 2 * MiB, "io": io, "pipeline": pipeline, **kw}
    return fastload(m, layout, **kw)


@pytest.mark.parametrize("which", ["model-plain", "model-hand", "odd-plain", "odd-hand"])
def test_every_mode_loads_identical_bytes(which, model, odd_model):
    m = model if which.startswith("model") else odd_model
    layout = plain_layout(m) if which.endswith("plain") else hand_layout(m)
    hashes = {}
    for io, pipeline in MODES:
        # small direct calls and 3 readers: the read loop and the chunk hand-over both run
        arena, store, stats = load(m, layout, io, pipeline, max_read_bytes=3 * PAGE_BYTES + 5, direct_threads=3)
        try:
            assert stats.io == io and stats.pipelined == (pipeline == "on") and stats.bytes_loaded == m.total_bytes
            if io == "direct" and stats.direct_fallback is None:
                assert stats.direct_bytes == m.total_bytes
            assert_extents_equal_file(arena, layout, m)
            hashes[(io, pipeline)] = region_hashes(arena, layout)
        finally:
            memory.free_arena(arena)
    assert len({tuple(h) for h in hashes.values()}) == 1, hashes


@pytest.mark.parametrize("which", ["hand", "plain"])
def test_pipelined_direct_binds_before_first_touch(which, model):
    """The policies are all set before the first populate, and every read straight into the
    arena lands in populated memory (the readers wait for, or do, the populate); with the
    plain layout (extents congruent to the file) most bytes are read in place."""
    from moe_service import numa

    events = []
    real_madvise, real_preadv = memory.madvise, os.preadv

    def spy_madvise(addr, n, advice):
        if advice == memory.MADV_POPULATE_WRITE:
            events.append(("populate", addr, n))
        real_madvise(addr, n, advice)

    def spy_mbind(addr, n, mode, nodes):
        events.append(("mbind", addr, n))
        numa.mbind(addr, n, mode, nodes)

    def spy_preadv(fd, bufs, off):
        for b in bufs:
            a = np.frombuffer(b, dtype=np.uint8)
            events.append(("read", memory.address_of(a), len(a)))
        return real_preadv(fd, bufs, off)

    mp = pytest.MonkeyPatch()
    mp.setattr(memory, "madvise", spy_madvise)
    mp.setattr(os, "preadv", spy_preadv)
    try:
        layout = hand_layout(model) if which == "hand" else plain_layout(model)
        arena, _, stats = load(model, layout, "direct", "on", mbind=spy_mbind, populate_threads=2)
    finally:
        mp.undo()
    try:
        assert_extents_equal_file(arena, layout, model)
        base, end = memory.address_of(arena), memory.address_of(arena) + arena.nbytes
        kinds = [e[0] if e[2] else "probe" for e in events]  # madvise(0, 0, POPULATE_WRITE): the probe
        if which == "hand":
            assert max(i for i, k in enumerate(kinds) if k == "mbind") < kinds.index("populate")
        else:
            in_place = sum(n for k, a, n in events if k == "read" and base <= a < end)
            assert in_place > 0.9 * model.total_bytes, in_place
        populated: list[tuple[int, int]] = []
        for kind, addr, n in events:
            if kind == "populate" and n:
                populated.append((addr, addr + n))
            elif kind == "read" and base <= addr < end:  # straight into the arena: populated before
                assert any(lo <= addr and addr + n <= hi for lo, hi in populated), (addr - base, n)
        assert stats.populate_threads == 2
    finally:
        memory.free_arena(arena)


def test_direct_span_reader_on_random_ranges(tmp_path):
    """read_span_direct against plain reads: random offsets and sizes (inside one block,
    across blocks, up to the end of a file whose size is not a 4 KiB multiple), destinations
    congruent (in place) or not (bounce), call and bounce sizes forced small."""
    rng = np.random.default_rng(7)
    size = 3 * MiB + 1234
    data = rng.integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    if not fileio.direct_supported(path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (the fallback tests cover that)")
    dst = memory.reserve_arena(4 * MiB)
    view = memoryview(dst)
    bounce = fileio.aligned_buffer(3 * PAGE_BYTES)
    fd = fileio.open_direct(path)
    try:
        cases = [(0, size), (size - 1, 1), (size - 5000, 5000), (4095, 2), (4096, 4096), (1, 4094)]
        for _ in range(60):
            off = int(rng.integers(0, size))
            cases.append((off, int(rng.integers(1, min(size - off, 700_000) + 1))))
        for off, n in cases:
            for congruent in (True, False):
                a = off % PAGE_BYTES + (8192 if congruent else 8192 + 64)
                dst[a : a + n] = 0
                got = []
                calls = fileio.read_span_direct(fd, dst, view, a, off, n, bounce, path=path,
                                                call_bytes=2 * PAGE_BYTES + 1, on_read=got.append)
                assert np.array_equal(dst[a : a + n], data[off : off + n]), (off, n, congruent)
                assert sum(got) == n and calls >= 1
        with pytest.raises(ModelFileError, match=rf"{path}: file ends at byte {size} but 10 more bytes"):
            fileio.read_span_direct(fd, dst, view, 0, size - 100, 110, bounce, path=path)
    finally:
        os.close(fd)
        view.release()
        memory.free_arena(dst)


def test_truncated_file_is_a_model_file_error_in_direct_mode(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf", n_embd=256, n_ff_exp=256, n_expert=8)
    m = GGUFModel.open(path)
    layout = plain_layout(m)
    with open(path, "r+b") as f:
        f.truncate(m.shards[0].size_bytes - 5000)
    with pytest.raises(ModelFileError, match=rf"{path}: file ends at byte"):
        load(m, layout, "direct", "on")


def test_enomem_in_a_populate_thread_stops_the_pipelined_load(model, monkeypatch):
    real = memory.madvise

    def full(addr, n, advice):
        if advice == memory.MADV_POPULATE_WRITE and n:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        real(addr, n, advice)

    monkeypatch.setattr(memory, "madvise", full)
    with pytest.raises(CapacityError, match=r"region node0 experts .*ENOMEM"):
        load(model, hand_layout(model), "direct", "on", populate_threads=2)


# --- the fallback to buffered reads ------------------------------------------------------------


def _refusing_dir(base: Path):
    """A directory on a filesystem that refuses O_DIRECT at open, and how to clean it up:
    /dev/shm where tmpfs refuses it (Linux < 6.6), else a ramfs mounted under ``base`` (root),
    else None."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        probe = shm / f"moe-service-odirect-{os.getpid()}"
        probe.write_bytes(b"\0" * 8192)
        try:
            if fileio.open_direct(probe) is None:
                d = shm / f"moe-service-test-{os.getpid()}"
                d.mkdir(exist_ok=True)
                return d, lambda: subprocess.run(["rm", "-rf", str(d)], check=False)
        finally:
            probe.unlink()
    if os.geteuid() == 0:
        d = base / "ramfs"
        d.mkdir()
        if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True).returncode == 0:
            return d, lambda: subprocess.run(["umount", str(d)], check=False)
    return None


def test_direct_falls_back_to_buffered_where_o_direct_is_refused_at_open(tmp_path):
    found = _refusing_dir(tmp_path)
    if found is None:
        pytest.skip("no filesystem here refuses O_DIRECT (tmpfs accepts it since Linux 6.6; ramfs needs root)")
    d, cleanup = found
    try:
        paths = write_moe_gguf(d / "m.gguf", n_layer=2, n_embd=256, n_expert=8, n_ff_exp=256, split_max_tensors=12)
        m = GGUFModel.open(paths[0])
        assert fileio.open_direct(m.shards[0].path) is None
        layout = plain_layout(m)
        with capture_logs() as logs:
            arena, _, stats = load(m, layout, "direct", "on", direct_threads=3)
        try:
            falls = [e for e in logs if e["event"] == "fastload_direct_fallback"]
            assert len(falls) == 1 and "O_DIRECT refused" in falls[0]["reason"], falls
            assert stats.io == "direct" and stats.direct_bytes == 0 and "O_DIRECT refused" in stats.direct_fallback
            assert_extents_equal_file(arena, layout, m)
        finally:
            memory.free_arena(arena)
    finally:
        cleanup()


def test_direct_falls_back_when_the_first_direct_read_is_refused(model, monkeypatch):
    """Some filesystems open with O_DIRECT and refuse the reads (EINVAL): the same fallback."""
    def refuse(fd, buf, offset, path):
        raise fileio.DirectRefused(errno.EINVAL, f"{path}: O_DIRECT read at byte {offset} refused: Invalid argument")

    monkeypatch.setattr(fileio, "_preadv_direct", refuse)
    layout = plain_layout(model)
    with capture_logs() as logs:
        arena, _, stats = load(model, layout, "direct", "on", direct_threads=3)
    try:
        assert [e["event"] for e in logs].count("fastload_direct_fallback") == 1
        assert stats.direct_bytes == 0 and "refused" in stats.direct_fallback
        assert_extents_equal_file(arena, layout, model)
        st = reread(model, layout, arena, io="direct")
        assert st.direct_fallback and st.bytes_loaded == model.total_bytes
    finally:
        memory.free_arena(arena)


# --- io = auto, the page cache -----------------------------------------------------------------


def test_auto_picks_buffered_when_cached_or_small_and_direct_when_big_and_cold(model, monkeypatch):
    size = sum(s.size_bytes for s in model.shards)
    monkeypatch.setattr(fileio, "cached_fraction_sampled", lambda path: 1.0)
    c = choose_io(model, "auto", available_bytes=size)
    assert (c.io, c.pipelined) == ("buffered", False) and "page cache" in c.reason
    monkeypatch.setattr(fileio, "cached_fraction_sampled", lambda path: 0.0)
    c = choose_io(model, "auto", available_bytes=size, direct_above_free_fraction=0.5)
    assert (c.io, c.pipelined) == ("direct", True) and "larger than 0.5 x MemAvailable" in c.reason
    c = choose_io(model, "auto", available_bytes=4 * size, direct_above_free_fraction=0.5)
    assert (c.io, c.pipelined) == ("buffered", True)
    assert choose_io(model, "auto", available_bytes=1000 * size, direct_above_free_fraction=0).io == "direct"
    assert choose_io(model, "buffered", pipeline="off").pipelined is False
    assert choose_io(model, "direct", pipeline="off").io == "direct"


def test_sampled_cache_fraction_sees_a_read_file_and_an_evicted_one(model):
    path = model.shards[0].path
    with open(path, "rb") as f:
        f.read()
    assert fileio.cached_fraction_sampled(path) > 0.98
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    from bench.fastload import cached_fraction

    if cached_fraction(path) <= 0.02:  # tmpfs keeps its pages whatever we advise
        assert fileio.cached_fraction_sampled(path) <= 0.05


def test_stage_reads_the_io_settings(model):
    from moe_service.config import load_config
    from pipeline.context import PipelineContext
    from pipeline.fastload import FastloadStage

    ctx = PipelineContext(load_config(data={
        "pipeline": {"stages": ["fastload"]},
        "fastload": {"threads": 2, "chunk_bytes": 2 * MiB, "io": "direct", "direct_threads": 3,
                     "populate_threads": 2},
    }))
    ctx.catalog, ctx.layout = model, plain_layout(model)
    stage = FastloadStage()
    stage.run(ctx)
    try:
        st = stage.stats
        assert (st.io, st.pipelined, st.populate_threads) == ("direct", True, 2) and st.threads == 3
        assert_extents_equal_file(ctx.arena, ctx.layout, model)
    finally:
        stage.close(ctx)


def test_direct_load_leaves_no_page_cache_behind(model):
    from bench.fastload import cached_fraction

    paths = [s.path for s in model.shards]
    if not fileio.direct_supported(paths[0]):
        pytest.skip(f"{paths[0].parent} refuses O_DIRECT")
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if max(map(cached_fraction, paths)) > 0.02:
        pytest.skip("this filesystem keeps the file cached whatever we advise (tmpfs)")
    layout = plain_layout(model)
    arena, _, stats = load(model, layout, "direct", "on")
    try:
        assert stats.direct_bytes == model.total_bytes
        assert max(map(cached_fraction, paths)) <= 0.02
        assert_extents_equal_file(arena, layout, model)
    finally:
        memory.free_arena(arena)


def test_plain_layout_places_tensors_congruent_to_their_file_offsets(model, odd_model):
    layout = plain_layout(model)
    for e in layout.regions[0].extents:
        assert e.region_offset % PAGE_BYTES == e.file_offset % PAGE_BYTES and e.region_offset % 32 == 0
    used = layout.regions[0].used_bytes
    data = sum(s.size_bytes - s.data_offset for s in model.shards)
    assert used <= data + 2 * PAGE_BYTES  # the file's spacing, plus < 4 KiB where a shard starts
    for e in plain_layout(odd_model).regions[0].extents:  # 8-byte aligned tensors: cache-line aligned
        assert e.region_offset % 64 == 0
