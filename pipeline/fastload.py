"""fastload: read the GGUF into placed anonymous memory, N threads wide.

::

    reserve   one private anonymous mapping of layout.arena_bytes, aligned to the plan's regions
              (nothing touched); fastload.pages = 2m / 1g: MAP_HUGETLB | MAP_HUGE_2MB / _1GB,
              pages reserved from the pools now, each node's taken at first touch
    advise    thp: MADV_HUGEPAGE on the whole arena (512x fewer faults, 2 MiB TLB entries);
              4k: MADV_NOHUGEPAGE; hugetlb: nothing
    bind      every region before first touch: bind -> mbind(MPOL_BIND, {node}),
              interleave -> mbind(MPOL_INTERLEAVE, nodes), local -> nothing (hugetlb pages
              then come from the bound node's pool)
    chunks    each primary region cut into chunk_bytes pieces (2 MiB aligned, never crossing
              a region), each with the file ranges (Extents) that land in it
    prefetch  (optional, off by default) one thread walks the chunks in order a few chunks
              ahead of the workers, asking the kernel to read their file ranges (fadvise
              WILLNEED): a cold page cache fills as one stream while the workers work
    io        buffered (through the page cache) or direct (O_DIRECT, no page cache copy), and
              interleaved or pipelined (see below): fastload.io = auto picks buffered when the
              file is already cached (sampled with mincore) or smaller than
              direct_above_free_fraction of MemAvailable, else direct; pipelined unless the
              load is buffered from a warm cache
    workers   interleaved (a warm page cache: the load is memory copies, CPU bound):
              N threads (threads, capped by usable CPUs), each taking the next chunk and
              going through it 2 MiB (one huge page) at a time:
                populate  madvise(MADV_POPULATE_WRITE) (or touch one byte per 4 KiB page
                          where the kernel lacks it; never with hugetlb, where a short pool
                          would be a SIGBUS): the page appears on the bound node; ENOMEM /
                          EFAULT: CapacityError naming the region, node(s) and pool
                fill      preadv from the shard file straight into it while the zeroed
                          page is still in cache, looping over short reads and the
                          0x7ffff000-byte per-call limit
              pipelined (a cold cache or direct I/O: the load waits on the device):
                populate  populate_threads threads populate whole chunks in order, ahead
                          of the readers (faulting and zeroing hide behind the I/O)
                fill      reader threads take the chunks in the same order, wait until
                          theirs is populated (or populate it themselves when nobody has
                          started it: the populate threads fell behind), and read it:
                          buffered preads (threads, capped by CPUs: the copies from the
                          cache cost CPU), or O_DIRECT
                          reads of DIRECT_CALL_BYTES each straight into the arena
                          (direct_threads, not capped by CPUs: they sleep on the device;
                          spans that are not 4 KiB congruent go through a bounce buffer,
                          see moe_service.fileio); a filesystem that refuses O_DIRECT
                          (tmpfs before Linux 6.6, ramfs, some network filesystems) is read
                          buffered, logged once (fastload_direct_fallback)
    progress  every progress_interval_s: log fastload_progress, STATUS "fastload 45% 6.1/13.5 GiB 3.2 GB/s"

Both populate (ctypes) and preadv release the GIL, so Python threads run them in parallel.
There is no staging buffer: the file's bytes go from the page cache (or, direct, from the
device) into the arena once, so resident memory grows by the bytes loaded and no more.
Bind-before-touch holds in every mode: all policies are set before the first populate, and
direct reads only land in pages already populated under them. Replica regions are bound here
(the arena is reserved whole) but left untouched: replication populates and fills them.
"""

from __future__ import annotations

import errno
import itertools
import os
import resource
import sys
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from moe_service import fileio, memory, numa
from moe_service.config import WORK_CHUNK_BYTES
from moe_service.errors import CapacityError, ConfigError, ModelFileError, NumaError, StageError
from moe_service.layout import (
    HUGETLB_PAGE_BYTES,
    PAGE_BYTES,
    REGION_ALIGN_BYTES,
    Layout,
    Region,
    align_up,
    region_align_bytes,
)
from moe_service.log import get_logger
from moe_service.numa import HugepagePool
from moe_service.sizes import GiB, MiB
from moe_service.weights import WeightStore
from pipeline.context import PipelineContext
from pipeline.plan import node_need_bytes
from pipeline.spec import Stage, register_stage

log = get_logger(__name__)

POPULATE_STEP_BYTES = 2 * MiB
"""Populate and fill go 2 MiB (one huge page) at a time inside a chunk: the page the kernel
just zeroed is still in cache when preadv overwrites it, so memory sees one write, not two."""


IO_MODES = ("auto", "buffered", "direct")
WARM_CACHED_FRACTION = 0.9
"""A file with at least this fraction of its (sampled) pages in the page cache is warm: loaded
buffered and interleaved whatever fastload.io and fastload.pipeline = auto would pick."""
DIRECT_THREADS = 4
SPAN_GAP_BYTES = 64 * 1024
"""Direct reads of one chunk merge extents whose gap is the same in the file and the arena and
at most this big (the GGUF's padding between tensors): one read instead of one per tensor."""


@dataclass(frozen=True)
class IoChoice:
    """How a load reads: ``io`` 'buffered' or 'direct', ``pipelined`` (populate ahead of the
    readers), ``cached_fraction`` of the files in the page cache when sampled (None: not
    sampled), ``file_bytes``, and ``reason``: one sentence for the log."""

    io: str
    pipelined: bool
    reason: str
    cached_fraction: float | None = None
    file_bytes: int = 0


def choose_io(catalog, io: str = "auto", *, pipeline: str = "auto", direct_above_free_fraction: float = 0.5,
              available_bytes: int | None = None) -> IoChoice:
    """Resolve fastload.io (``auto`` / ``buffered`` / ``direct``) and fastload.pipeline
    (``auto`` / ``on`` / ``off``) for ``catalog``'s files.

    auto: buffered when the files are at least :data:`WARM_CACHED_FRACTION` cached (the copy
    is already there: reading it costs memory bandwidth only), else direct when they are
    larger than ``direct_above_free_fraction`` x MemAvailable (``available_bytes``; a
    buffered read would leave a second copy of the model in the page cache, on top of the
    arena, and evict everything else), else buffered (the cache it leaves makes the next
    start warm). Pipelined: auto = unless buffered from a warm cache. Raises ConfigError for
    an unknown value."""
    if io not in IO_MODES:
        raise ConfigError(f"fastload.io: must be one of {', '.join(IO_MODES)} (got {io!r})")
    if pipeline not in ("auto", "on", "off"):
        raise ConfigError(f"fastload.pipeline: must be one of auto, on, off (got {pipeline!r})")
    file_bytes = sum(s.size_bytes for s in catalog.shards)
    cached: float | None = None
    if io == "auto" or pipeline == "auto":
        sizes = [max(s.size_bytes, 1) for s in catalog.shards]
        fracs = [fileio.cached_fraction_sampled(s.path) for s in catalog.shards]
        cached = sum(f * n for f, n in zip(fracs, sizes, strict=True)) / sum(sizes)
    if io == "auto":
        if available_bytes is None:
            available_bytes = fileio.meminfo().get("MemAvailable", 0)
        assert cached is not None  # sampled above for io = auto
        if cached >= WARM_CACHED_FRACTION:
            chosen, reason = "buffered", f"{100 * cached:.0f}% of the file is in the page cache"
        elif file_bytes > direct_above_free_fraction * available_bytes:
            chosen, reason = "direct", (f"the file ({file_bytes / GiB:.1f} GiB) is larger than "
                                        f"{direct_above_free_fraction:g} x MemAvailable ({available_bytes / GiB:.1f} GiB)")
        else:
            chosen, reason = "buffered", (f"the file ({file_bytes / GiB:.1f} GiB) fits in "
                                          f"{direct_above_free_fraction:g} x MemAvailable ({available_bytes / GiB:.1f} GiB)")
    else:
        chosen, reason = io, f"fastload.io = {io}"
    if pipeline == "auto":
        assert cached is not None  # sampled above for pipeline = auto
        pipelined = chosen == "direct" or cached < WARM_CACHED_FRACTION
    else:
        pipelined = pipeline == "on"
    return IoChoice(chosen, pipelined, reason, cached, file_bytes)


@dataclass
class LoadStats:
    """What a load did. ``seconds``: wall time from reservation to the last byte;
    ``populate_s`` / ``read_s``: time summed over threads in each step; ``cpu_s``: process
    CPU time (user + system) spent meanwhile; ``populate``: 'madvise' or 'touch' ('none'
    for :func:`reread`); ``hugepages``: huge pages back the arena (THP advised and enabled,
    or hugetlb); ``pages``: fastload.pages ('thp', '4k', '2m', '1g'); ``anon_huge_bytes``:
    growth of this process's AnonHugePages during the load (THP-backed anonymous memory;
    hugetlb pages are not counted there). ``io``: 'buffered' or 'direct' (what was asked;
    ``direct_fallback`` says why some file was read buffered instead); ``pipelined``;
    ``populate_threads``; ``wait_s``: reader thread-seconds spent waiting for a chunk to be
    populated (above ~0: populate was the bottleneck); ``direct_bytes``: bytes read with
    O_DIRECT."""

    bytes_loaded: int
    seconds: float
    threads: int
    chunks: int
    populate: str
    hugepages: bool
    populate_s: float = 0.0
    read_s: float = 0.0
    anon_huge_bytes: int = 0
    read_calls: int = 0
    cpu_s: float = 0.0
    pages: str = "thp"
    io: str = "buffered"
    pipelined: bool = False
    populate_threads: int = 0
    wait_s: float = 0.0
    direct_bytes: int = 0
    direct_fallback: str | None = None

    @property
    def concurrency(self) -> float:
        """Process CPU seconds (user + system) per wall second during the load: above 1 only
        when several load threads ran at the same time (the GIL was released)."""
        return self.cpu_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def gbps(self) -> float:
        """Bytes loaded per second, in GB/s (10^9 bytes)."""
        return self.bytes_loaded / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Chunk:
    region: Region
    start: int  # arena offsets: [start, end) is populated
    end: int
    # (shard, file_offset, nbytes, arena_offset), sorted by arena_offset
    reads: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def read_bytes(self) -> int:
        return sum(r[2] for r in self.reads)

    def steps(self, step: int):
        """Yield (lo, hi, reads) for each ``step``-byte piece of the chunk, with the reads cut
        at the piece's bounds: populate a piece, fill it while its zeroed lines are in cache."""
        reads, j = self.reads, 0
        for lo in range(self.start, self.end, step):
            hi = min(lo + step, self.end)
            out = []
            while j < len(reads):
                shard, file_off, n, arena_off = reads[j]
                a, b = max(lo, arena_off), min(hi, arena_off + n)
                if a < b:
                    out.append((shard, file_off + a - arena_off, b - a, a))
                if arena_off + n > hi:
                    break
                j += 1
            yield lo, hi, out

    def spans(self, max_gap: int = SPAN_GAP_BYTES) -> list[tuple[int, int, int, int, int]]:
        """(shard, file_offset, nbytes, arena_offset, payload_bytes) of the chunk's reads with
        neighbours merged where the gap between them is the same in the file and in the arena
        and at most ``max_gap`` (the gap bytes are the file's padding, written into the
        arena's padding between the two extents: this chunk's bytes, nobody else's).
        ``payload_bytes``: the extents' bytes alone."""
        out: list[list[int]] = []
        for shard, file_off, n, arena_off in self.reads:
            if out:
                sh, fo, nb, ao, _ = out[-1]
                gap = arena_off - (ao + nb)
                if sh == shard and 0 <= gap <= max_gap and file_off - (fo + nb) == gap:
                    out[-1][2] += gap + n
                    out[-1][4] += n
                    continue
            out.append([shard, file_off, n, arena_off, n])
        return [(r[0], r[1], r[2], r[3], r[4]) for r in out]

    def file_ranges(self) -> list[tuple[int, int, int]]:
        """(shard, file_offset, nbytes) of the chunk's reads, contiguous ones merged."""
        out: list[list[int]] = []
        for shard, file_off, n, _ in sorted(self.reads, key=lambda r: (r[0], r[1])):
            if out and out[-1][0] == shard and out[-1][1] + out[-1][2] == file_off:
                out[-1][2] += n
            else:
                out.append([shard, file_off, n])
        return [(r[0], r[1], r[2]) for r in out]


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def effective_threads(threads: int, n_chunks: int | None = None) -> int:
    """Load threads actually used: ``threads`` capped by the usable CPUs
    (len(os.sched_getaffinity(0))) and by the number of chunks; at least 1."""
    n = min(threads, memory.usable_cpus())
    if n_chunks is not None:
        n = min(n, n_chunks)
    return max(1, n)


def status_line(done_bytes: int, total_bytes: int, gbps: float) -> str:
    """The STATUS text of a load in progress: ``fastload 45% 6.1/13.5 GiB 3.2 GB/s``."""
    pct = int(100 * done_bytes / total_bytes) if total_bytes else 100
    return f"fastload {pct}% {done_bytes / GiB:.1f}/{total_bytes / GiB:.1f} GiB {gbps:.1f} GB/s"


def plan_chunks(catalog, layout: Layout, chunk_bytes: int = WORK_CHUNK_BYTES) -> list[_Chunk]:
    """Cut every primary region with extents into chunks of ``chunk_bytes`` (rounded up to
    2 MiB) and attach to each the file ranges that land in it.

    Checks, before anything is allocated, that every extent lies inside its region and
    inside its shard file; raises ModelFileError naming the shard (a file shorter than the
    catalog says: truncated or replaced) or StageError (a layout that does not fit its region).
    """
    chunk_bytes = align_up(max(chunk_bytes, REGION_ALIGN_BYTES), REGION_ALIGN_BYTES)
    n_shards = len(catalog.shards)
    chunks: list[_Chunk] = []
    for region in layout.primary_regions():
        if not region.extents:
            continue
        if (
            region.arena_offset % layout.align_bytes
            or region.arena_offset + region.nbytes > layout.arena_bytes
        ):
            raise StageError(
                f"fastload: region {region.name} at arena offset {region.arena_offset} ({region.nbytes} bytes) "
                f"is not {layout.align_bytes}-byte aligned inside the {layout.arena_bytes}-byte arena"
            )
        extents = sorted(region.extents, key=lambda e: e.region_offset)
        end_used = 0
        for e in extents:
            if not 0 <= e.shard < n_shards or catalog.shards[e.shard].index != e.shard:
                raise ModelFileError(
                    f"fastload: region {region.name} reads shard {e.shard}, which the catalog lacks"
                )
            shard = catalog.shards[e.shard]
            if e.file_offset + e.nbytes > shard.size_bytes:
                raise ModelFileError(
                    f"{shard.path}: bytes {e.file_offset}..{e.file_offset + e.nbytes} are past the end of the "
                    f"file ({shard.size_bytes} bytes): truncated download?"
                )
            if e.region_offset < end_used or e.region_offset + e.nbytes > region.nbytes:
                raise StageError(
                    f"fastload: layout region {region.name} has an extent at {e.region_offset} (+{e.nbytes}) "
                    f"overlapping another or past the region's {region.nbytes} bytes"
                )
            end_used = e.region_offset + e.nbytes
        fill_end = min(align_up(end_used, PAGE_BYTES), region.nbytes)
        starts = [e.region_offset for e in extents]
        for lo in range(0, fill_end, chunk_bytes):
            hi = min(lo + chunk_bytes, fill_end)
            chunk = _Chunk(region, region.arena_offset + lo, region.arena_offset + hi)
            i = max(0, bisect_right(starts, lo) - 1)
            while i < len(extents) and extents[i].region_offset < hi:
                e = extents[i]
                a, b = max(lo, e.region_offset), min(hi, e.region_offset + e.nbytes)
                if a < b:
                    skip = a - e.region_offset
                    chunk.reads.append((e.shard, e.file_offset + skip, b - a, region.arena_offset + a))
                i += 1
            chunks.append(chunk)
    return chunks


def bind_regions(arena: np.ndarray, layout: Layout, mbind=None) -> int:
    """Set each region's memory policy on its arena range, before anything touches it.

    ``bind`` -> MPOL_BIND to its node, ``interleave`` -> MPOL_INTERLEAVE over its nodes,
    ``local`` -> no call. Replica regions are bound too (the arena is reserved whole here).
    ``mbind`` (default :func:`moe_service.numa.mbind`) is called as ``mbind(address, nbytes,
    mode, nodes)``. Returns the number of calls made. Raises NumaError naming the region and nodes
    when the kernel refuses.
    """
    mbind = numa.mbind if mbind is None else mbind
    base = memory.address_of(arena)
    calls = 0
    for r in layout.regions:
        if r.policy == "local" or r.nbytes == 0:
            continue
        if r.policy == "bind":
            mode, nodes = numa.MPOL_BIND, tuple(r.nodes[:1])
        elif r.policy == "interleave":
            mode, nodes = numa.MPOL_INTERLEAVE, tuple(r.nodes or layout.nodes)
        else:
            raise StageError(f"fastload: region {r.name} has unknown policy {r.policy!r}")
        try:
            mbind(base + r.arena_offset, r.nbytes, mode, nodes)
        except (OSError, NumaError) as e:
            raise NumaError(
                f"fastload: mbind of region {r.name} ({r.nbytes} bytes, {r.policy} to node(s) {list(nodes)}) "
                f"failed: {e}"
            ) from e
        calls += 1
    return calls


def pool_snapshot(layout: Layout, page_kib: int) -> dict[int, HugepagePool]:
    """Each plan node's hugetlb pool of ``page_kib`` KiB pages as it is now (empty for 0)."""
    if not page_kib:
        return {}
    pools = {n: numa.hugepage_pools(n).get(page_kib) for n in layout.nodes if n >= 0}
    return {n: p for n, p in pools.items() if p is not None}


def shortage_error(stage: str, region: Region, lo: int, hi: int, err: int, layout: Layout,
                   page_kib: int = 0, pools: dict[int, HugepagePool] | None = None) -> CapacityError:
    """The CapacityError of a populate that found no memory (``err``: its errno) at arena bytes
    [lo, hi) of ``region``: names the region, its node(s) and sizes; with hugetlb pages
    (``page_kib``), each node's pages needed by the stage (the plan's regions of ``region``'s
    role: primaries for fastload, replicas for replication) vs the free pages its pool had when
    the stage started (``pools``), and the command that raises a short pool."""
    what = (f"{stage}: populating region {region.name} ({region.policy}, node(s) {list(region.nodes) or 'any'}) "
            f"failed with {errno.errorcode.get(err, err)} at region bytes {lo - region.arena_offset}.."
            f"{hi - region.arena_offset} of {region.nbytes}")
    if not page_kib:
        return CapacityError(f"{what} ({region.used_bytes} used): the memory is not there")
    page_bytes = page_kib * 1024
    need = node_need_bytes(layout, [r for r in layout.regions if r.role == region.role])
    parts = []
    for n in region.nodes or layout.nodes:
        pool = (pools or {}).get(n)
        need_pages = -(-need.get(n, 0) // page_bytes)
        free, nr = (pool.free, pool.nr) if pool else (0, 0)
        part = (f"node {n} needs {need_pages} hugetlb pages of {page_kib} kB for this stage and its pool had "
                f"{free} free (of {nr}) when the stage started")
        if need_pages > free:
            part += f"; raise it: echo {nr + need_pages - free} > {numa.hugepage_pool_path(n, page_kib)}"
        parts.append(part)
    return CapacityError(f"{what}: a hugetlb pool is short: " + "; ".join(parts))


def populate_range(base: int, region: Region, lo: int, hi: int, layout: Layout, *, stage: str,
                   page_kib: int = 0, pools: dict[int, HugepagePool] | None = None) -> None:
    """Fault in arena bytes [lo, hi) of ``region`` (arena at address ``base``; lo page aligned)
    with MADV_POPULATE_WRITE. Raises :func:`shortage_error` when the memory (or the node's
    hugetlb pool) is not there, StageError for another failure."""
    try:
        memory.populate_write(base + lo, hi - lo)
    except OSError as e:
        if e.errno is not None and e.errno in memory.SHORTAGE_ERRNOS:
            raise shortage_error(stage, region, lo, hi, e.errno, layout, page_kib, pools) from None
        raise StageError(f"{stage}: madvise(MADV_POPULATE_WRITE) failed: {e}") from e


class _Loader:
    """The worker pools of one load (see the module docstring): interleaved (each worker
    populates and fills its chunk 2 MiB at a time) or pipelined (populate workers ahead of
    reader workers, buffered or direct reads)."""

    def __init__(
        self,
        catalog,
        arena: np.ndarray,
        chunks: list[_Chunk],
        *,
        threads: int,
        populate: str,
        max_read_bytes: int,
        step_bytes: int = 0,
        prefetch: bool = False,
        layout: Layout | None = None,
        page_kib: int = 0,
        io: str = "buffered",
        pipelined: bool = False,
        populate_threads: int = 1,
    ):
        self.catalog = catalog
        self.layout = layout
        self.page_kib = page_kib
        self.pools = pool_snapshot(layout, page_kib) if layout is not None else {}
        self.arena = arena
        self.base = memory.address_of(arena)
        self.chunks = chunks
        self.threads = threads
        self.populate = populate  # 'madvise', 'touch' or 'none' (memory already populated)
        self.max_read_bytes = max_read_bytes
        self.step_bytes = step_bytes
        self.io = io
        self.pipelined = pipelined or io == "direct"
        self.prefetch = prefetch and io == "buffered"
        self.populate_threads = populate_threads if self.pipelined and populate != "none" else 0
        self.call_bytes = min(fileio.DIRECT_CALL_BYTES, max_read_bytes)
        self.next_chunk = itertools.count()
        # pipelined, per chunk: 0 nobody has it, 1 being populated, 2 populated (ready to read)
        # pipelined: per chunk 0 free, 1 being populated, 2 ready (empty when not pipelined)
        self.state: list[int] = [0] * len(chunks) if self.populate_threads else []
        self.populate_cursor = 0
        self.ready_cv = threading.Condition()
        self.taken = 0  # chunks handed to workers so far (the prefetcher stays a window ahead)
        self.taken_cv = threading.Condition()
        self.done_bytes = [0] * threads
        self.populate_s = [0.0] * (threads + self.populate_threads)
        self.read_s = [0.0] * threads
        self.wait_s = [0.0] * threads
        self.read_calls = [0] * threads
        self.direct_bytes = [0] * threads
        self.buffered_shards: set[int] = set()  # direct refused there: read buffered
        self.direct_fallback: str | None = None
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.finished = threading.Event()
        self._alive = threads
        self._lock = threading.Lock()

    def run(self, on_tick, tick_s: float) -> None:
        workers = [
            threading.Thread(target=self._work, args=(w,), name=f"fastload-{w}", daemon=True)
            for w in range(self.threads)
        ]
        workers += [
            threading.Thread(target=self._populate_ahead, args=(self.threads + p,), name=f"fastload-populate-{p}",
                             daemon=True)
            for p in range(self.populate_threads)
        ]
        if self.prefetch:
            workers.append(threading.Thread(target=self._prefetch, name="fastload-prefetch", daemon=True))
        for t in workers:
            t.start()
        try:
            while not self.finished.wait(tick_s):
                on_tick()
        except BaseException:
            self.stop.set()
            raise
        finally:
            self.stop.set()  # the prefetcher and the populate workers may still be ahead: stop them
            for cv in (self.taken_cv, self.ready_cv):
                with cv:
                    cv.notify_all()
            for t in workers:
                t.join()
        if self.errors:
            raise self.errors[0]

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self.errors.append(e)
        self.stop.set()
        with self.ready_cv:
            self.ready_cv.notify_all()

    def _claim_next(self) -> int | None:
        """Pipelined: the first chunk nobody populates yet, now marked as being populated."""
        with self.ready_cv:
            i = self.populate_cursor
            while i < len(self.chunks) and self.state[i]:
                i += 1
            self.populate_cursor = i
            if i >= len(self.chunks):
                return None
            self.state[i] = 1
            return i

    def _mark_ready(self, i: int) -> None:
        with self.ready_cv:
            self.state[i] = 2
            self.ready_cv.notify_all()

    def _populate_ahead(self, slot: int) -> None:
        """Pipelined: populate whole chunks in order and mark them ready for the readers."""
        try:
            while not self.stop.is_set():
                i = self._claim_next()
                if i is None:
                    break
                c = self.chunks[i]
                t0 = time.perf_counter()
                self._populate(c.region, c.start, c.end)
                self.populate_s[slot] += time.perf_counter() - t0
                self._mark_ready(i)
        except BaseException as e:
            self._fail(e)

    def _ensure_ready(self, w: int, i: int) -> bool:
        """Pipelined: make chunk ``i`` populated before reading it. Nobody has taken it yet
        (the populate threads fell behind): populate it here, which keeps a slow populate
        (a VM's host faults, few populate threads) from holding the readers up. Another
        thread is at it: wait. False when the load stops first."""
        if not self.populate_threads:
            return True
        t0 = time.perf_counter()
        with self.ready_cv:
            mine = self.state[i] == 0
            if mine:
                self.state[i] = 1
            else:
                while self.state[i] != 2 and not self.stop.is_set():
                    self.ready_cv.wait(0.5)
        if mine:
            c = self.chunks[i]
            self._populate(c.region, c.start, c.end)
            self.populate_s[w] += time.perf_counter() - t0
            self._mark_ready(i)
        else:
            self.wait_s[w] += time.perf_counter() - t0
        return self.state[i] == 2

    def _work(self, w: int) -> None:
        fds: dict[int, int] = {}
        dfds: dict[int, int] = {}
        view = memoryview(self.arena)  # type: ignore[arg-type]  # numpy's stubs: __buffer__ on Python >= 3.12 only
        done = self.done_bytes
        bounce = None

        def counter(nbytes: int) -> None:
            done[w] += nbytes

        try:
            while not self.stop.is_set():
                i = next(self.next_chunk)
                if i >= len(self.chunks):
                    break
                if self.prefetch:
                    with self.taken_cv:
                        self.taken = max(self.taken, i + 1)
                        self.taken_cv.notify_all()
                c = self.chunks[i]
                if self.pipelined:
                    if not self._ensure_ready(w, i):
                        break
                    t0 = time.perf_counter()
                    if self.io == "direct":
                        if bounce is None:
                            bounce = fileio.aligned_buffer(self.call_bytes)
                        self._fill_direct(w, c, view, fds, dfds, bounce)
                    else:
                        self._fill_buffered(w, c.reads, view, fds, counter)
                    self.read_s[w] += time.perf_counter() - t0
                    continue
                for lo, hi, reads in c.steps(self.step_bytes):
                    t0 = time.perf_counter()
                    self._populate(c.region, lo, hi)
                    t1 = time.perf_counter()
                    self._fill_buffered(w, reads, view, fds, counter)
                    self.populate_s[w] += t1 - t0
                    self.read_s[w] += time.perf_counter() - t1
        except BaseException as e:
            self._fail(e)
        finally:
            view.release()
            for fd in itertools.chain(fds.values(), dfds.values()):
                os.close(fd)
            with self._lock:
                self._alive -= 1
                if self._alive == 0:
                    self.finished.set()

    def _fill_buffered(self, w: int, reads, view: memoryview, fds: dict[int, int], counter) -> None:
        for shard, file_off, n, arena_off in reads:
            self.read_calls[w] += memory.pread_full(
                self._fd(fds, shard),
                view[arena_off : arena_off + n],
                file_off,
                path=self.catalog.shards[shard].path,
                max_call_bytes=self.max_read_bytes,
                on_read=counter,
            )

    def _fill_direct(self, w: int, c: _Chunk, view: memoryview, fds: dict[int, int], dfds: dict[int, int],
                     bounce: np.ndarray) -> None:
        """Read chunk ``c`` with O_DIRECT, span by span (:meth:`_Chunk.spans`); a span whose
        file refuses O_DIRECT is read buffered (gap bytes included: the same bytes)."""
        for shard, file_off, n, arena_off, payload in c.spans():
            fd = self._dfd(dfds, shard)
            if fd is not None:
                try:
                    self.read_calls[w] += fileio.read_span_direct(
                        fd, self.arena, view, arena_off, file_off, n, bounce,
                        path=self.catalog.shards[shard].path, call_bytes=self.call_bytes,
                    )
                    self.direct_bytes[w] += payload
                    self.done_bytes[w] += payload
                    continue
                except fileio.DirectRefused as e:
                    self._refuse(shard, str(e))
            self._fill_buffered(w, [(shard, file_off, n, arena_off)], view, fds, None)
            self.done_bytes[w] += payload

    def _dfd(self, dfds: dict[int, int], shard: int) -> int | None:
        """This worker's O_DIRECT descriptor of ``shard``, or None where the filesystem refused it."""
        if shard in self.buffered_shards:
            return None
        fd = dfds.get(shard)
        if fd is None:
            fd = fileio.open_direct(self.catalog.shards[shard].path)
            if fd is None:
                self._refuse(shard, f"{self.catalog.shards[shard].path}: open with O_DIRECT refused (EINVAL)")
                return None
            dfds[shard] = fd
        return fd

    def _refuse(self, shard: int, reason: str) -> None:
        """Read ``shard`` buffered from now on; the first refusal of a load is logged."""
        with self._lock:
            self.buffered_shards.add(shard)
            first = self.direct_fallback is None
            if first:
                self.direct_fallback = reason
        if first:
            log.warning("fastload_direct_fallback", stage="fastload", path=str(self.catalog.shards[shard].path),
                        reason=reason, fallback="buffered reads (through the page cache)")

    def _prefetch(self) -> None:
        """One read-ahead stream over the chunks in order, ``threads + 1`` chunks ahead of the
        workers: posix_fadvise(WILLNEED) makes the kernel read a cold file while the workers
        populate and copy, as one sequential stream rather than one per worker."""
        fds: dict[int, int] = {}
        window = self.threads + 1
        try:
            for i, c in enumerate(self.chunks):
                with self.taken_cv:
                    while not self.stop.is_set() and i >= self.taken + window:
                        self.taken_cv.wait(0.5)
                if self.stop.is_set():
                    break
                for shard, file_off, n in c.file_ranges():
                    os.posix_fadvise(self._fd(fds, shard), file_off, n, os.POSIX_FADV_WILLNEED)
        except OSError as e:  # read-ahead is advice: a failure only costs speed
            log.warning("fastload_prefetch_failed", stage="fastload", error=str(e))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _fd(self, fds: dict[int, int], shard: int) -> int:
        """This worker's descriptor of ``shard`` (each worker has its own: own readahead state)."""
        fd = fds.get(shard)
        if fd is None:
            fd = fds[shard] = os.open(self.catalog.shards[shard].path, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def _populate(self, r: Region, lo: int, hi: int) -> None:
        if self.populate == "madvise":
            assert self.layout is not None  # every load that populates has a layout (fastload())
            populate_range(self.base, r, lo, hi, self.layout, stage="fastload", page_kib=self.page_kib,
                           pools=self.pools)
        elif self.populate == "touch":
            self.arena[lo:hi:PAGE_BYTES] = 0  # one write per 4 KiB page: faults it in


def hugetlb_page_bytes(layout: Layout, pages: str) -> int:
    """The hugetlb page size for fastload.pages ``pages`` (0 for 'thp' / '4k'), after checking
    that ``layout`` can be mapped with it: every region and the arena a multiple of the page
    (mbind splits a hugetlb mapping only at page boundaries). Raises ConfigError for an
    unknown ``pages``, StageError naming the first misaligned region."""
    if pages not in ("thp", "4k") and pages not in HUGETLB_PAGE_BYTES:
        raise ConfigError(f"fastload.pages: must be one of thp, 4k, {', '.join(HUGETLB_PAGE_BYTES)} (got {pages!r})")
    page = HUGETLB_PAGE_BYTES.get(pages, 0)
    if not page:
        return 0
    for r in layout.regions:
        if r.arena_offset % page or r.nbytes % page:
            raise StageError(
                f"fastload: region {r.name} ({r.nbytes} bytes at arena offset {r.arena_offset}) is not aligned to "
                f"the {page}-byte pages of fastload.pages = {pages}: the plan aligned regions to "
                f"{layout.align_bytes} bytes (plan with the same fastload.pages)"
            )
    if layout.arena_bytes % page:
        raise StageError(f"fastload: the arena ({layout.arena_bytes} bytes) is not a whole number of "
                         f"{page}-byte pages (fastload.pages = {pages})")
    return page


def populate_mode(populate: str, pages: str) -> str:
    """'madvise' or 'touch' for fastload.populate ``populate`` ('auto', 'madvise', 'touch').

    auto: MADV_POPULATE_WRITE where the kernel has it (Linux 5.14+), else touching one byte
    per 4 KiB page (logged). hugetlb pages (``pages`` 2m / 1g) are never touched: a write to a
    page the node's pool cannot supply is a SIGBUS, where MADV_POPULATE_WRITE returns an
    error the load reports. Raises ConfigError (touch with hugetlb, an unknown value) and
    StageError (hugetlb pages on a kernel without MADV_POPULATE_WRITE).
    """
    hugetlb = pages in HUGETLB_PAGE_BYTES
    if populate == "auto":
        if memory.populate_write_supported():
            return "madvise"
        if hugetlb:
            raise StageError(f"fastload.pages = {pages} needs MADV_POPULATE_WRITE (Linux 5.14+), which this "
                             "kernel lacks; use fastload.pages = thp")
        log.warning(
            "fastload_populate_fallback",
            stage="fastload",
            reason="kernel lacks MADV_POPULATE_WRITE (Linux < 5.14): touching one byte per 4 KiB page",
        )
        return "touch"
    if populate == "touch" and hugetlb:
        raise ConfigError(f"fastload.populate = touch cannot be used with fastload.pages = {pages}: a page the "
                          "node's pool cannot supply would kill the process (SIGBUS); use auto or madvise")
    if populate not in ("madvise", "touch"):
        raise ValueError(f"populate must be 'auto', 'madvise' or 'touch' (got {populate!r})")
    return populate


def fastload(
    catalog,
    layout: Layout,
    *,
    threads: int = 16,
    pages: str = "thp",
    populate: str = "auto",
    chunk_bytes: int = WORK_CHUNK_BYTES,
    max_read_bytes: int = memory.PREAD_MAX_BYTES,
    progress_interval_s: float = 2.0,
    on_progress=None,
    should_stop=None,
    mbind=None,
    progress_bar: bool | None = None,
    populate_step_bytes: int = POPULATE_STEP_BYTES,
    prefetch: bool = False,
    io: str = "auto",
    pipeline: str = "auto",
    populate_threads: int = 0,
    direct_threads: int = DIRECT_THREADS,
    direct_above_free_fraction: float = 0.5,
) -> tuple[np.ndarray, WeightStore, LoadStats]:
    """Load every primary region of ``layout`` from ``catalog``'s files into a new arena.

    Returns (arena: uint8 [layout.arena_bytes] over one private anonymous mapping, the
    :class:`WeightStore` over it, :class:`LoadStats`). Pages of each region sit where its
    policy puts them (bound before first touch). ``pages`` (fastload.pages): 'thp'
    (MADV_HUGEPAGE), '4k' (MADV_NOHUGEPAGE), '2m' / '1g' (hugetlb pages from the bound nodes'
    pools; the layout's regions must be aligned to the page size: plan with the same pages).
    ``populate``: 'auto' (MADV_POPULATE_WRITE when the kernel has it, else touching pages,
    logged once; never touching with hugetlb pages), 'madvise' or 'touch'.
    ``max_read_bytes`` caps one preadv call (tests force it small). ``on_progress(done_bytes,
    total_bytes, gbps)`` is called every ``progress_interval_s`` and at the end;
    ``should_stop()`` is polled at the same times and may raise to abort the load (the arena
    is freed). ``mbind(address, nbytes, mode, nodes)`` replaces the policy call (tests).
    ``progress_bar``: a tqdm bar on stderr (default: when stderr is a TTY).
    ``populate_step_bytes``: populate and fill alternate in pieces of this size inside a
    chunk (default 2 MiB; 0: populate the whole chunk, then read it). ``prefetch``: a
    read-ahead thread (posix_fadvise WILLNEED, one sequential stream a few chunks ahead of
    the workers) so a cold file is read while the workers populate and copy (~0.1 ms per
    64 MiB when the file is already cached). Off by default: on this project's test VM
    (virtio disk, read_ahead_kb 8192) the kernel's own read-ahead did as well or better
    (98 MB file cold: 2.4 GB/s without, 1.4 with; 4.3 GiB: 1.9 both); it is meant for hosts
    with a small read_ahead_kb, to be measured there with ``bench fastload``.
    ``io`` ('auto', 'buffered', 'direct') and ``pipeline`` ('auto', 'on', 'off'): see
    :func:`choose_io`. Pipelined, ``populate_threads`` threads populate ahead (0: a quarter
    of the usable CPUs, at least 1) and the readers are ``threads`` (capped by CPUs) for
    buffered reads, ``direct_threads`` for O_DIRECT ones.

    Raises ModelFileError (a shard shorter than the layout needs, or the file ending during
    a read), CapacityError (address space refused, hugetlb pools too small for the arena, or
    populate got ENOMEM/EFAULT: naming the region, node(s), sizes and, with hugetlb, each
    node's pool), NumaError (mbind refused), ConfigError (populate = touch with hugetlb
    pages), StageError (a broken layout, regions not aligned to the hugetlb page).
    """
    if catalog.problems():
        raise catalog.error()
    page_bytes = hugetlb_page_bytes(layout, pages)
    chunks = plan_chunks(catalog, layout, chunk_bytes)
    total = sum(c.read_bytes for c in chunks)
    choice = choose_io(catalog, io, pipeline=pipeline, direct_above_free_fraction=direct_above_free_fraction)
    if choice.pipelined and choice.io == "direct":
        n_threads = max(1, min(direct_threads, len(chunks)))
    else:
        n_threads = effective_threads(threads, len(chunks))
    n_populate = 0
    if choice.pipelined:
        n_populate = max(1, min(populate_threads or memory.usable_cpus() // 4, len(chunks)))
    mode = populate_mode(populate, pages)

    huge0 = memory.anon_huge_bytes()  # read outside the timed window: ~1 ms (it walks the page tables)
    cpu0 = _cpu_s()
    t_start = time.perf_counter()
    arena = memory.reserve_arena(layout.arena_bytes, layout.align_bytes, hugetlb_page_bytes=page_bytes)
    try:
        huge = page_bytes > 0
        if pages in ("thp", "4k"):
            try:
                advice = memory.MADV_HUGEPAGE if pages == "thp" else memory.MADV_NOHUGEPAGE
                memory.madvise(memory.address_of(arena), arena.nbytes, advice)
                huge = pages == "thp" and memory.thp_mode() in ("always", "madvise")
            except OSError as e:
                log.warning("fastload_no_hugepages", stage="fastload", error=str(e))
        binds = bind_regions(arena, layout, mbind)
        log.info(
            "fastload_start",
            stage="fastload",
            bytes=total,
            arena_bytes=layout.arena_bytes,
            regions=len(layout.regions),
            bound_regions=binds,
            chunks=len(chunks),
            threads=n_threads,
            populate=mode,
            pages=pages,
            thp=memory.thp_mode() if pages == "thp" else "off",
            io=choice.io,
            pipelined=choice.pipelined,
            populate_threads=n_populate,
            io_reason=choice.reason,
        )
        loader = _Loader(
            catalog,
            arena,
            chunks,
            threads=n_threads,
            populate=mode,
            max_read_bytes=max_read_bytes,
            step_bytes=populate_step_bytes or chunk_bytes,
            prefetch=prefetch,
            layout=layout,
            page_kib=page_bytes // 1024,
            io=choice.io,
            pipelined=choice.pipelined,
            populate_threads=n_populate,
        )
        bar = _progress_bar(total, progress_bar)
        last = {"t": t_start, "bar": 0}

        def tick(final: bool = False) -> None:
            done = sum(loader.done_bytes)
            now = time.perf_counter()
            if bar is not None:
                bar.update(done - last["bar"])
                last["bar"] = done
            if final or now - last["t"] >= progress_interval_s:
                last["t"] = now
                gbps = done / max(now - t_start, 1e-9) / 1e9
                log.info("fastload_progress", stage="fastload", bytes=done, total=total, gbps=round(gbps, 3))
                if on_progress is not None:
                    on_progress(done, total, gbps)
            if should_stop is not None:
                should_stop()

        try:
            loader.run(tick, min(progress_interval_s, 0.25) if bar is not None else progress_interval_s)
            seconds = time.perf_counter() - t_start
            tick(final=True)
        finally:
            if bar is not None:
                bar.close()
        stats = LoadStats(
            bytes_loaded=total,
            seconds=seconds,
            threads=n_threads,
            chunks=len(chunks),
            populate=mode,
            hugepages=huge,
            populate_s=sum(loader.populate_s),
            read_s=sum(loader.read_s),
            anon_huge_bytes=max(0, memory.anon_huge_bytes() - huge0),
            cpu_s=_cpu_s() - cpu0,
            read_calls=sum(loader.read_calls),
            pages=pages,
            io=choice.io,
            pipelined=choice.pipelined,
            populate_threads=n_populate,
            wait_s=sum(loader.wait_s),
            direct_bytes=sum(loader.direct_bytes),
            direct_fallback=loader.direct_fallback,
        )
    except BaseException:
        memory.free_arena(arena)
        raise
    log.info(
        "fastload_done",
        stage="fastload",
        bytes=total,
        seconds=round(stats.seconds, 3),
        gbps=round(stats.gbps, 3),
        threads=n_threads,
        populate=mode,
        anon_huge_bytes=stats.anon_huge_bytes,
        populate_s=round(stats.populate_s, 3),
        read_s=round(stats.read_s, 3),
        concurrency=round(stats.concurrency, 2),
        io=choice.io,
        pipelined=choice.pipelined,
        wait_s=round(stats.wait_s, 3),
        direct_bytes=stats.direct_bytes,
    )
    return arena, WeightStore(arena, layout, catalog), stats


def reread(
    catalog,
    layout: Layout,
    arena: np.ndarray,
    *,
    threads: int = 16,
    chunk_bytes: int = WORK_CHUNK_BYTES,
    step_bytes: int = POPULATE_STEP_BYTES,
    io: str = "buffered",
    direct_threads: int = DIRECT_THREADS,
) -> LoadStats:
    """Read the model again into an arena that :func:`fastload` already filled: the same
    parallel preads (``io`` 'buffered': ``threads`` capped by CPUs; 'direct': O_DIRECT reads,
    ``direct_threads`` readers), with no reservation, no policy calls and no page faults.
    Its rate is the parallel-read ceiling the benchmark compares fastload with."""
    if io not in ("buffered", "direct"):
        raise ValueError(f"reread: io must be 'buffered' or 'direct' (got {io!r})")
    chunks = plan_chunks(catalog, layout, chunk_bytes)
    if io == "direct":
        n_threads = max(1, min(direct_threads, len(chunks)))
    else:
        n_threads = effective_threads(threads, len(chunks))
    loader = _Loader(
        catalog,
        arena,
        chunks,
        threads=n_threads,
        populate="none",
        max_read_bytes=memory.PREAD_MAX_BYTES,
        step_bytes=step_bytes or chunk_bytes,
        layout=layout,
        io=io,
    )
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    loader.run(lambda: None, 1.0)
    seconds = time.perf_counter() - t0
    return LoadStats(
        sum(c.read_bytes for c in chunks),
        seconds,
        n_threads,
        len(chunks),
        "none",
        False,
        read_s=sum(loader.read_s),
        read_calls=sum(loader.read_calls),
        cpu_s=_cpu_s() - cpu0,
        io=io,
        pipelined=io == "direct",
        direct_bytes=sum(loader.direct_bytes),
        direct_fallback=loader.direct_fallback,
    )


def _progress_bar(total: int, wanted: bool | None):
    if wanted is None:
        wanted = sys.stderr.isatty()
    if not wanted:
        return None
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]  # optional (a progress bar on a TTY), no stubs
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="fastload", file=sys.stderr)


def _progress(ctx: PipelineContext, done: int, total: int, gbps: float) -> None:
    ctx.status(status_line(done, total, gbps))
    ctx.report_progress(done)  # bytes loaded: what keeps systemd's start timeout extended


def _check_model_unchanged(catalog, when: str) -> None:
    """StageError naming every shard replaced or rewritten since the catalog read it (checked
    at the start and the end of the stage: bytes read from a file swapped mid-load would mix
    two models). Exit 5: a restart catalogs and loads the new file."""
    from moe_service.gguf_model import changed_shards

    changed = changed_shards(catalog) if hasattr(catalog, "shards") else []
    if changed:
        raise StageError(f"fastload: the model changed {when}: {'; '.join(changed)}. The loaded weights "
                         "could mix two files; restart the service to load the new one")


@register_stage
class FastloadStage(Stage):
    """Reads the model into the arena the plan laid out (reads ``ctx.catalog`` and ``ctx.layout``,
    which the prepare step fills; when a caller left the layout out, one ``local`` region in
    file order) and writes ``ctx.arena`` and ``ctx.weights``. Settings: ``[fastload]`` threads, pages, populate, chunk_bytes,
    max_read_bytes, progress_interval_s, prefetch, io, pipeline, populate_threads,
    direct_threads, direct_above_free_fraction."""

    name = "fastload"
    reads = ("catalog",)
    reads_if_present = ("layout",)
    writes = ("arena", "weights")
    summary = "read the model into the placed arena (populate + pread, N threads, THP or hugetlb pages, bound per region)"

    stall_limit_s = 60.0  # no byte loaded for a minute: a dead disk or a hung NFS server
    progress_from_status = False  # its status line's GB/s changes while no byte arrives

    def __init__(self) -> None:
        self.stats: LoadStats | None = None

    def run(self, ctx: PipelineContext) -> None:
        from moe_service.layout import plain_layout

        catalog = ctx.catalog
        if catalog is None:
            raise StageError("fastload: no model catalog (the prepare step did not run)")
        cfg = ctx.config.fastload
        layout = ctx.layout
        if layout is None:
            layout = ctx.layout = plain_layout(catalog, region_align_bytes(cfg.pages))
            log.info(
                "fastload_plain_layout", stage="fastload", reason="no plan in the context: one local region"
            )
        _check_model_unchanged(catalog, "before the load")
        arena, weights, self.stats = fastload(
            catalog,
            layout,
            threads=cfg.threads,
            pages=cfg.pages,
            populate=cfg.populate,
            chunk_bytes=cfg.chunk_bytes,
            max_read_bytes=cfg.max_read_bytes,
            progress_interval_s=cfg.progress_interval_s,
            on_progress=lambda done, total, gbps: _progress(ctx, done, total, gbps),
            should_stop=ctx.check_shutdown,
            prefetch=cfg.prefetch,
            io=cfg.io,
            pipeline=cfg.pipeline,
            populate_threads=cfg.populate_threads,
            direct_threads=cfg.direct_threads,
            direct_above_free_fraction=cfg.direct_above_free_fraction,
        )
        try:
            _check_model_unchanged(catalog, "during the load")
        except StageError:
            memory.free_arena(arena)
            raise
        ctx.arena, ctx.weights = arena, weights

    def close(self, ctx: PipelineContext) -> None:
        arena = ctx.arena
        ctx.arena = ctx.weights = None
        if arena is not None:
            memory.free_arena(arena)
            log.info("fastload_freed", stage="fastload", bytes=arena.nbytes)
