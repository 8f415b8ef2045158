"""Replication: fill the replica regions the plan reserved, node to node, then check residency.

The plan (pipeline/plan.py) already decided every copy: replica regions (role ``replica``,
policy ``bind`` to one node) whose :class:`~moe_service.layout.CopyExtent` s say which primary
bytes go where, and ``Layout.experts[...]`` lists every copy's (offset, node), which
``WeightStore.expert_copies`` hands to the engine. ``mirror`` plans use the same machinery
(one big CopyExtent per node). This stage::

    bind     mbind(MPOL_BIND, {node}) on each replica region before touching it. fastload
             binds every region of the layout, replicas included, before it populates; binding
             here again is idempotent and keeps this stage correct on its own (for instance
             when fastload did not populate replica regions).
    copy     CopyExtents cut into chunks (replication.chunk_bytes); per destination node a
             pool of threads pinned to that node's CPUs (sched_setaffinity), so even without
             the binding the first touch would be local; each chunk's pages are populated
             (MADV_POPULATE_WRITE: a node out of memory, or a hugetlb pool that is short, is a
             CapacityError naming the node, not a SIGBUS), then ctypes.memmove (GIL released)
    verify   the placement stage's sampler on the replica regions, migrate strays, re-verify

Config read: ``replication.replicas`` (by the plan), ``replication.threads``,
``replication.chunk_bytes``, ``fastload.pages`` (for the pools named in a shortage) and
``placement.migrate`` / ``strict`` / ``sample_stride_bytes`` / ``interleave_tolerance`` for the
residency check.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from moe_service import memory, numa
from moe_service.config import WORK_CHUNK_BYTES
from moe_service.errors import StageError
from moe_service.layout import HUGETLB_PAGE_BYTES, PAGE_BYTES, Layout, Region, align_up
from moe_service.log import get_logger
from moe_service.numa import HugepagePool, Topology
from moe_service.sizes import GiB
from pipeline.context import PipelineContext
from pipeline.fastload import pool_snapshot, populate_range
from pipeline.placement import ResidencyReport, arena_address, log_residency, place
from pipeline.spec import Stage, register_stage

log = get_logger(__name__)


@dataclass(frozen=True)
class CopyTask:
    """Copy ``nbytes`` from arena offset ``src_offset`` to ``dst_offset`` (destination on ``node``)."""

    src_offset: int
    dst_offset: int
    nbytes: int
    node: int
    region: str


@dataclass
class ReplicationReport:
    bytes_copied: int = 0
    seconds: float = 0.0
    bytes_per_node: dict[int, int] = field(default_factory=dict)
    residency: ResidencyReport | None = None

    @property
    def gbps(self) -> float:
        """Copy rate in GB/s (10^9 bytes per second)."""
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0


def copy_tasks(layout: Layout, regions: list[Region] | None = None,
               chunk_bytes: int = WORK_CHUNK_BYTES) -> list[CopyTask]:
    """The copies of ``regions`` (default: the layout's replica regions), cut into chunks of at
    most ``chunk_bytes``, in region order. The node of a copy is its region's home node (-1
    for a region without one)."""
    out = []
    for r in layout.replica_regions() if regions is None else regions:
        node = r.home_node if r.home_node is not None else -1
        for c in r.copies:
            for lo in range(0, c.nbytes, chunk_bytes):
                n = min(chunk_bytes, c.nbytes - lo)
                out.append(CopyTask(c.src_arena_offset + lo, r.arena_offset + c.region_offset + lo, n, node, r.name))
    return out


def bind_regions(arena, regions: list[Region]) -> None:
    """mbind each ``bind``/``interleave`` region to its planned node(s), without moving pages
    already present (they are the placement check's business). Raises NumaError."""
    base = arena_address(arena)
    for r in regions:
        if r.policy == "bind":
            numa.mbind(base + r.arena_offset, r.nbytes, numa.MPOL_BIND, r.nodes)
        elif r.policy == "interleave":
            numa.mbind(base + r.arena_offset, r.nbytes, numa.MPOL_INTERLEAVE, r.nodes)


def _pin_thread(cpus: tuple[int, ...]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def replicate(arena, layout: Layout, topology: Topology | None = None, *, threads_per_node: int | None = None,
              chunk_bytes: int = WORK_CHUNK_BYTES, bind: bool = True, verify: bool = True,
              migrate: bool = True, strict: bool = True, step_bytes: int = numa.SAMPLE_STEP_BYTES,
              interleave_tolerance: float = 0.10, pages: str = "thp", populate: bool = True,
              progress: Callable[[int, int], None] | None = None) -> ReplicationReport:
    """Fill every replica region of ``layout`` in ``arena`` from the primaries.

    ``arena``: uint8 numpy array over the mapping (page aligned: mbind needs it when ``bind``).
    ``topology``: gives each destination node's CPUs (None: threads are not pinned).
    ``threads_per_node``: copy threads per destination node (None: one per usable CPU of
    that node, at least 1).
    ``progress(bytes_done, bytes_total)`` is called from copy threads after each chunk.
    ``populate``: fault each chunk's destination pages in with MADV_POPULATE_WRITE before the
    copy (``arena`` must then be a page-aligned mapping). ``pages``: fastload.pages of the
    arena (with 2m / 1g a shortage names the nodes' pools).
    ``migrate``, ``strict``, ``step_bytes``, ``interleave_tolerance``: the residency check's
    (:func:`pipeline.placement.place`).
    Returns bytes copied, seconds, GB/s, bytes per node and (``verify``) the residency of the
    replica regions after repair. Raises CapacityError (a destination node, or its hugetlb
    pool, out of memory), NumaError / StageError as :func:`place` does.
    """
    regions = layout.replica_regions()
    report = ReplicationReport()
    if not regions:
        return report
    base = arena_address(arena)
    if bind:
        bind_regions(arena, regions)
    page_kib = HUGETLB_PAGE_BYTES.get(pages, 0) // 1024
    pools: dict[int, HugepagePool] = pool_snapshot(layout, page_kib)
    populate = populate and memory.populate_write_supported()
    if page_kib and not populate:
        raise StageError(f"replication: fastload.pages = {pages} needs MADV_POPULATE_WRITE (Linux 5.14+)")
    by_name = {r.name: r for r in regions}
    tasks = copy_tasks(layout, regions, chunk_bytes)
    total = sum(t.nbytes for t in tasks)
    by_node: dict[int, list[CopyTask]] = {}
    for t in tasks:
        by_node.setdefault(t.node, []).append(t)
    done = 0
    lock = threading.Lock()

    def run(task: CopyTask) -> None:
        nonlocal done
        if populate:  # fault the destination in first: a shortage is an error here, not a SIGBUS in memmove
            r = by_name[task.region]
            lo = task.dst_offset - task.dst_offset % PAGE_BYTES
            hi = min(align_up(task.dst_offset + task.nbytes, PAGE_BYTES), r.arena_offset + r.nbytes)
            populate_range(base, r, lo, hi, layout, stage="replication", page_kib=page_kib, pools=pools)
        ctypes.memmove(base + task.dst_offset, base + task.src_offset, task.nbytes)
        with lock:
            done += task.nbytes
            now = done
        if progress is not None:
            progress(now, total)

    t0 = time.monotonic()
    executors: list[ThreadPoolExecutor] = []
    try:
        futures = []
        for node, node_tasks in by_node.items():
            cpus: tuple[int, ...] = ()
            if topology is not None and node >= 0 and node in topology.node_ids:
                cpus = tuple(topology.node(node).cpus)
            n_threads = threads_per_node if threads_per_node is not None else len(cpus)
            executor = ThreadPoolExecutor(max_workers=max(1, n_threads), initializer=_pin_thread,
                                          initargs=(cpus,), thread_name_prefix=f"replicate-n{node}")
            executors.append(executor)
            futures += [executor.submit(run, t) for t in node_tasks]
        for f in futures:
            f.result()
    finally:
        for executor in executors:  # on an error or interrupt: drop the chunks not started yet
            executor.shutdown(wait=True, cancel_futures=True)
    report.seconds = time.monotonic() - t0
    report.bytes_copied = total
    for node, node_tasks in by_node.items():
        report.bytes_per_node[node] = sum(t.nbytes for t in node_tasks)
    log.info("replication_copied", stage="replication", bytes=total, seconds=round(report.seconds, 3),
             gbps=round(report.gbps, 2), regions=len(regions), threads_per_node=threads_per_node)
    if verify:
        report.residency = place(arena, layout, regions, migrate=migrate, strict=strict, step_bytes=step_bytes,
                                 interleave_tolerance=interleave_tolerance, stage="replication")
    return report


@register_stage
class ReplicationStage(Stage):
    """Fills the replica regions of ``ctx.layout`` in ``ctx.arena`` (expert replicas, or the
    per-node copies of ``mirror``) from the primaries with threads pinned to each destination
    node, then verifies and repairs their residency; the replica columns of
    ``ctx.weights.expert_copies`` are valid afterwards. Adds the replica regions to
    ``ctx.residency``. Settings: ``[replication]`` replicas (read by the plan), threads,
    chunk_bytes; ``[fastload]`` pages; ``[placement]`` migrate, strict, sample_stride_bytes,
    interleave_tolerance."""

    name = "replication"
    requires = ("placement",)
    reads = ("arena", "layout")
    reads_if_present = ("topology", "residency")
    writes = ("residency",)
    summary = "copy expert replicas / mirror copies node to node, verify their residency"

    def skip_reason(self, ctx: PipelineContext) -> str | None:
        if ctx.layout is not None and not ctx.layout.replica_regions():
            return "the plan has no replica regions (replication.replicas = 0 and numa.policy is not mirror)"
        return None

    def run(self, ctx: PipelineContext) -> None:
        arena, layout = ctx.arena, ctx.layout
        if arena is None or layout is None:
            raise StageError("replication: there is no loaded arena to copy within (fastload did not run)")
        cfg, placement = ctx.config.replication, ctx.config.placement
        dest = {r.home_node for r in layout.replica_regions()}
        per_node = max(1, cfg.threads // max(len(dest), 1)) if cfg.threads else None
        last = {"t": 0.0}
        t0 = time.monotonic()

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last["t"] >= 2.0 or done == total:
                last["t"] = now
                gbps = done / max(now - t0, 1e-9) / 1e9
                ctx.status(f"replication {100 * done // max(total, 1)}% {done / GiB:.1f}/{total / GiB:.1f} GiB "
                           f"{gbps:.1f} GB/s")
                log.info("replication_progress", stage=self.name, bytes=done, total=total, gbps=round(gbps, 3))
            ctx.check_shutdown()

        report = replicate(arena, layout, ctx.topology, threads_per_node=per_node,
                           chunk_bytes=cfg.chunk_bytes, migrate=placement.migrate, strict=placement.strict,
                           step_bytes=placement.sample_stride_bytes,
                           interleave_tolerance=placement.interleave_tolerance, pages=ctx.config.fastload.pages,
                           progress=progress)
        if report.residency is not None:
            log_residency(report.residency, self.name)
            if ctx.residency is not None:
                ctx.residency.merge(report.residency)
            else:
                ctx.residency = report.residency
        ctx.status(f"replication: {report.bytes_copied / GiB:.1f} GiB copied in {report.seconds:.1f} s "
                   f"({report.gbps:.1f} GB/s)")
