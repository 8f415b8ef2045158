"""fastload: read the GGUF into placed anonymous memory, N threads wide.

::

    reserve   one private anonymous mapping of layout.arena_bytes, 2 MiB aligned (nothing touched)
    advise    MADV_HUGEPAGE on the whole arena (THP: 512x fewer faults, 2 MiB TLB entries)
    bind      every region before first touch: bind -> mbind(MPOL_BIND, {node}),
              interleave -> mbind(MPOL_INTERLEAVE, nodes), local -> nothing
    chunks    each primary region cut into chunk_bytes pieces (2 MiB aligned, never crossing
              a region), each with the file ranges (Extents) that land in it
    workers   N threads (threads, capped by usable CPUs), each taking the next chunk:
                populate  madvise(MADV_POPULATE_WRITE) (or touch one byte per 4 KiB page
                          where the kernel lacks it): the pages appear on the bound node
                fill      preadv from the shard file straight into the arena, looping over
                          short reads and the 0x7ffff000-byte per-call limit
    progress  every progress_interval_s: log fastload_progress, STATUS "fastload 45% 6.1/13.5 GiB 3.2 GB/s"

Both populate (ctypes) and preadv release the GIL, so Python threads run them in parallel.
There is no staging buffer: the file's bytes go from the page cache into the arena once, so
resident memory grows by the bytes loaded and no more. Replica regions are bound here (the
arena is reserved whole) but left untouched: replication populates and fills them.
"""

from __future__ import annotations

import errno
import itertools
import os
import sys
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from moe_service import memory
from moe_service.errors import CapacityError, ModelFileError, NumaError, StageError
from moe_service.layout import PAGE_BYTES, REGION_ALIGN_BYTES, Layout, Region, align_up
from moe_service.log import get_logger
from moe_service.weights import WeightStore
from pipeline.spec import Stage, register_stage

log = get_logger(__name__)

GiB = 2**30
DEFAULT_CHUNK_BYTES = 64 * 2**20
_EHWPOISON = getattr(errno, "EHWPOISON", 133)  # populate hit a poisoned page


@dataclass
class LoadStats:
    """What a load did. ``seconds``: wall time from reservation to the last byte;
    ``populate_s`` / ``read_s``: time summed over threads in each step; ``populate``:
    'madvise' or 'touch'; ``anon_huge_bytes``: growth of this process's AnonHugePages
    during the load (THP-backed anonymous memory)."""

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

    @property
    def gbps(self) -> float:
        """Bytes loaded per second, in GB/s (10^9 bytes)."""
        return self.bytes_loaded / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Chunk:
    region: Region
    start: int  # arena offsets: [start, end) is populated
    end: int
    reads: list[tuple[int, int, int, int]] = field(
        default_factory=list
    )  # (shard, file_off, nbytes, arena_off)

    @property
    def read_bytes(self) -> int:
        return sum(r[2] for r in self.reads)


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


def plan_chunks(catalog, layout: Layout, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[_Chunk]:
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
            region.arena_offset % REGION_ALIGN_BYTES
            or region.arena_offset + region.nbytes > layout.arena_bytes
        ):
            raise StageError(
                f"fastload: region {region.name} at arena offset {region.arena_offset} ({region.nbytes} bytes) "
                f"is not 2 MiB aligned inside the {layout.arena_bytes}-byte arena"
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
    ``local`` -> no call. ``mbind`` (default :func:`moe_service.memory.mbind`) is called as
    ``mbind(address, nbytes, mode, nodes)``. Returns the number of calls made. Raises
    NumaError naming the region and nodes when the kernel refuses.
    """
    mbind = memory.mbind if mbind is None else mbind
    base = memory.address_of(arena)
    calls = 0
    for r in layout.regions:
        if r.policy == "local" or r.nbytes == 0:
            continue
        if r.policy == "bind":
            mode, nodes = memory.MPOL_BIND, tuple(r.nodes[:1])
        elif r.policy == "interleave":
            mode, nodes = memory.MPOL_INTERLEAVE, tuple(r.nodes or layout.nodes)
        else:
            raise StageError(f"fastload: region {r.name} has unknown policy {r.policy!r}")
        try:
            mbind(base + r.arena_offset, r.nbytes, mode, nodes)
        except OSError as e:
            raise NumaError(
                f"fastload: mbind of region {r.name} ({r.nbytes} bytes, {r.policy} to node(s) {list(nodes)}) "
                f"failed: {os.strerror(e.errno or 0)}"
            ) from e
        calls += 1
    return calls


class _Loader:
    """The worker pool of one load (see the module docstring)."""

    def __init__(
        self,
        catalog,
        arena: np.ndarray,
        chunks: list[_Chunk],
        *,
        threads: int,
        populate: str,
        max_read_bytes: int,
    ):
        self.catalog = catalog
        self.arena = arena
        self.base = memory.address_of(arena)
        self.chunks = chunks
        self.threads = threads
        self.populate = populate  # 'madvise', 'touch' or 'none' (memory already populated)
        self.max_read_bytes = max_read_bytes
        self.next_chunk = itertools.count()
        self.done_bytes = [0] * threads
        self.populate_s = [0.0] * threads
        self.read_s = [0.0] * threads
        self.read_calls = [0] * threads
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
        for t in workers:
            t.start()
        try:
            while not self.finished.wait(tick_s):
                on_tick()
        except BaseException:
            self.stop.set()
            raise
        finally:
            for t in workers:
                t.join()
        if self.errors:
            raise self.errors[0]

    def _work(self, w: int) -> None:
        fds: dict[int, int] = {}
        view = memoryview(self.arena)
        done = self.done_bytes

        def counter(nbytes: int) -> None:
            done[w] += nbytes

        try:
            while not self.stop.is_set():
                i = next(self.next_chunk)
                if i >= len(self.chunks):
                    break
                c = self.chunks[i]
                t0 = time.perf_counter()
                self._populate(c)
                t1 = time.perf_counter()
                for shard, file_off, n, arena_off in c.reads:
                    fd = fds.get(shard)
                    if fd is None:
                        fd = fds[shard] = os.open(self.catalog.shards[shard].path, os.O_RDONLY | os.O_CLOEXEC)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self.read_calls[w] += memory.pread_full(
                        fd,
                        view[arena_off : arena_off + n],
                        file_off,
                        path=self.catalog.shards[shard].path,
                        max_call_bytes=self.max_read_bytes,
                        on_read=counter,
                    )
                self.populate_s[w] += t1 - t0
                self.read_s[w] += time.perf_counter() - t1
        except BaseException as e:
            with self._lock:
                self.errors.append(e)
            self.stop.set()
        finally:
            view.release()
            for fd in fds.values():
                os.close(fd)
            with self._lock:
                self._alive -= 1
                if self._alive == 0:
                    self.finished.set()

    def _populate(self, c: _Chunk) -> None:
        n = c.end - c.start
        if self.populate == "madvise":
            while True:
                try:
                    memory.madvise(self.base + c.start, n, memory.MADV_POPULATE_WRITE)
                    return
                except OSError as e:
                    if e.errno in (errno.EINTR, errno.EAGAIN):
                        continue
                    if e.errno in (errno.ENOMEM, errno.EFAULT, _EHWPOISON):
                        r = c.region
                        raise CapacityError(
                            f"fastload: populating region {r.name} ({r.policy}, node(s) {list(r.nodes) or 'any'}) "
                            f"failed with {errno.errorcode.get(e.errno, e.errno)} at region bytes "
                            f"{c.start - r.arena_offset}..{c.end - r.arena_offset} of {r.nbytes} "
                            f"({r.used_bytes} used): the memory is not there"
                        ) from None
                    raise StageError(f"fastload: madvise(MADV_POPULATE_WRITE) failed: {e}") from e
        elif self.populate == "touch":
            self.arena[c.start : c.end : PAGE_BYTES] = 0  # one write per 4 KiB page: faults it in


def fastload(
    catalog,
    layout: Layout,
    *,
    threads: int = 16,
    hugepages: bool = True,
    populate: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_read_bytes: int = memory.PREAD_MAX_BYTES,
    progress_interval_s: float = 2.0,
    on_progress=None,
    should_stop=None,
    mbind=None,
    progress_bar: bool | None = None,
) -> tuple[np.ndarray, WeightStore, LoadStats]:
    """Load every primary region of ``layout`` from ``catalog``'s files into a new arena.

    Returns (arena: uint8 [layout.arena_bytes] over one private anonymous mapping, the
    :class:`WeightStore` over it, :class:`LoadStats`). Pages of each region sit where its
    policy puts them (bound before first touch). ``populate``: 'auto' (MADV_POPULATE_WRITE
    when the kernel has it, else touching pages, logged once), 'madvise' or 'touch'.
    ``max_read_bytes`` caps one preadv call (tests force it small). ``on_progress(done_bytes,
    total_bytes, gbps)`` is called every ``progress_interval_s`` and at the end;
    ``should_stop()`` is polled at the same times and may raise to abort the load (the arena
    is freed). ``mbind(address, nbytes, mode, nodes)`` replaces the policy call (tests).
    ``progress_bar``: a tqdm bar on stderr (default: when stderr is a TTY).

    Raises ModelFileError (a shard shorter than the layout needs, or the file ending during
    a read), CapacityError (address space refused, or populate got ENOMEM/EFAULT: naming
    the region, node and sizes), NumaError (mbind refused), StageError (a broken layout).
    """
    if catalog.problems():
        raise catalog.error()
    chunks = plan_chunks(catalog, layout, chunk_bytes)
    total = sum(c.read_bytes for c in chunks)
    n_threads = effective_threads(threads, len(chunks))
    mode = populate
    if mode == "auto":
        mode = "madvise" if memory.populate_write_supported() else "touch"
        if mode == "touch":
            log.warning(
                "fastload_populate_fallback",
                stage="fastload",
                reason="kernel lacks MADV_POPULATE_WRITE (Linux < 5.14): touching one byte per 4 KiB page",
            )
    elif mode not in ("madvise", "touch"):
        raise ValueError(f"populate must be 'auto', 'madvise' or 'touch' (got {populate!r})")

    t_start = time.perf_counter()
    huge0 = memory.anon_huge_bytes()
    arena = memory.reserve_arena(layout.arena_bytes)
    try:
        thp = False
        if hugepages:
            try:
                memory.madvise(memory.address_of(arena), arena.nbytes, memory.MADV_HUGEPAGE)
                thp = memory.thp_mode() in ("always", "madvise")
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
            thp=memory.thp_mode() if hugepages else "off",
        )
        loader = _Loader(
            catalog, arena, chunks, threads=n_threads, populate=mode, max_read_bytes=max_read_bytes
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
            hugepages=thp,
            populate_s=sum(loader.populate_s),
            read_s=sum(loader.read_s),
            anon_huge_bytes=max(0, memory.anon_huge_bytes() - huge0),
            read_calls=sum(loader.read_calls),
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
    )
    return arena, WeightStore(arena, layout, catalog), stats


def reread(
    catalog, layout: Layout, arena: np.ndarray, *, threads: int = 16, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> LoadStats:
    """Read the model again into an arena that :func:`fastload` already filled: the same
    parallel preads, with no reservation, no policy calls and no page faults. Its rate is
    the parallel-read ceiling the benchmark compares fastload with."""
    chunks = plan_chunks(catalog, layout, chunk_bytes)
    n_threads = effective_threads(threads, len(chunks))
    loader = _Loader(
        catalog, arena, chunks, threads=n_threads, populate="none", max_read_bytes=memory.PREAD_MAX_BYTES
    )
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
    )


def _progress_bar(total: int, wanted: bool | None):
    if wanted is None:
        wanted = sys.stderr.isatty()
    if not wanted:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="fastload", file=sys.stderr)


@register_stage
class FastloadStage(Stage):
    """Reads the model into the arena the plan laid out (``ctx.catalog``, ``ctx.layout``;
    without a layout, one ``local`` region in file order) and sets ``ctx.arena`` and
    ``ctx.weights``. Settings: ``[fastload]`` threads, hugepages, populate, chunk_bytes,
    max_read_bytes, progress_interval_s."""

    name = "fastload"
    requires: tuple[str, ...] = ()
    summary = (
        "needs catalog + layout; fills arena and weights (populate + pread, N threads, THP, bound per region)"
    )

    def __init__(self) -> None:
        self.stats: LoadStats | None = None

    def run(self, ctx) -> None:
        from moe_service.layout import plain_layout

        if ctx.catalog is None:
            raise StageError("fastload: no model catalog (the prepare step did not run)")
        layout = ctx.layout
        if layout is None:
            layout = ctx.layout = plain_layout(ctx.catalog)
            log.info(
                "fastload_plain_layout", stage="fastload", reason="no plan in the context: one local region"
            )
        cfg = ctx.config.fastload
        arena, weights, self.stats = fastload(
            ctx.catalog,
            layout,
            threads=cfg.threads,
            hugepages=cfg.hugepages,
            populate=cfg.populate,
            chunk_bytes=cfg.chunk_bytes,
            max_read_bytes=cfg.max_read_bytes,
            progress_interval_s=cfg.progress_interval_s,
            on_progress=lambda done, total, gbps: ctx.status(status_line(done, total, gbps)),
            should_stop=ctx.check_shutdown,
        )
        ctx.arena, ctx.weights = arena, weights

    def close(self, ctx) -> None:
        arena = ctx.arena
        ctx.arena = ctx.weights = None
        if arena is not None:
            memory.free_arena(arena)
            log.info("fastload_freed", stage="fastload", bytes=arena.nbytes)
