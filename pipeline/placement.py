"""Placement: check that every region of the arena sits on its planned node(s), repair strays.

Runs after fastload, which bound each region with mbind before first touch, so on a healthy
host this stage only looks. For each region (primary regions here; the replication stage
checks its own)::

    sample   move_pages(query) on one 4 KiB page per 2 MiB window of the used bytes
             (the page inside each window drawn at random with a fixed seed: a fixed
              stride would alias with 4 KiB interleave)
    judge    bind:        every present sample on the home node
             interleave:  every sample on one of the region's nodes; spread reported
             local:       reported only
    repair   mbind(region, same policy, MPOL_MF_MOVE): the kernel migrates every page of
             the range that breaks the policy (not only the sampled ones), then re-sample;
             up to 3 passes (a page that is busy at that moment is skipped silently)
    report   residency table (bytes per node per region) -> log event placement_residency,
             STATUS line, ctx.residency for /metrics

A sample that is absent (-ENOENT; -EFAULT on older kernels) in a region fastload filled means a page was never written:
reported, and an error under ``placement.strict``. On a one-node host (or a one-node plan)
the stage records that there is nothing to place and does nothing else.

Config read (:class:`~moe_service.config.PlacementConfig`): ``verify``, ``migrate``,
``strict`` (fail when pages remain off-node after migration), ``sample_stride_bytes``,
``interleave_tolerance`` (warn when a node's share of an interleaved region is off by more
than this fraction of the even share).
"""

from __future__ import annotations

import time

from moe_service import numa
from moe_service.errors import NumaError, StageError
from moe_service.layout import Layout, Region
from moe_service.log import get_logger
from moe_service.numa import Topology
from moe_service.sizes import GiB
from pipeline.context import PipelineContext
from pipeline.products import RegionResidency, ResidencyReport
from pipeline.spec import Stage, register_stage

log = get_logger(__name__)

MIGRATE_ATTEMPTS = 3
"""mbind(MPOL_MF_MOVE) passes over a region with strays before placement gives up on it."""

_POLICY_MODE = {"bind": numa.MPOL_BIND, "interleave": numa.MPOL_INTERLEAVE}


def arena_address(arena) -> int:
    """Base address of ``arena`` (a numpy array, or an int address as is)."""
    return int(arena) if isinstance(arena, int) else int(arena.ctypes.data)


def region_residency(base_addr: int, region: Region, step_bytes: int = numa.SAMPLE_STEP_BYTES,
                     seed: int | None = 0) -> RegionResidency:
    """Sample the used bytes of ``region`` (arena at ``base_addr``) with move_pages in query mode.

    Raises NumaError when move_pages itself fails (e.g. the range is not mapped).
    """
    _addrs, status = numa.page_nodes(base_addr + region.arena_offset, region.used_bytes, step_bytes, seed)
    nodes, absent, errors = numa.status_counts(status)
    if region.policy == "bind":
        stray = sum(c for n, c in nodes.items() if n != region.nodes[0])
    elif region.policy == "interleave":
        stray = sum(c for n, c in nodes.items() if n not in region.nodes)
    else:
        stray = 0
    return RegionResidency(region.name, region.role, region.policy, tuple(region.nodes), region.used_bytes,
                           int(status.size), nodes, absent, errors, stray, step_bytes)


def verify_residency(arena, layout: Layout, regions: list[Region] | None = None,
                     step_bytes: int = numa.SAMPLE_STEP_BYTES, seed: int | None = 0) -> ResidencyReport:
    """Residency of ``regions`` (default: the layout's primary regions) of ``arena``.

    ``arena``: the numpy array over the mapping fastload filled (or its base address). At most
    one page per ``step_bytes`` is sampled. Nothing is moved. Raises NumaError.
    """
    base = arena_address(arena)
    regs = layout.primary_regions() if regions is None else regions
    return ResidencyReport(regions=[region_residency(base, r, step_bytes, seed) for r in regs])


def migrate_region(arena, region: Region) -> None:
    """Move the pages of ``region`` that break its policy: mbind(MPOL_MF_MOVE) over the whole
    region with its planned policy and nodes. Raises NumaError (e.g. ENOMEM on a full node)."""
    mode = _POLICY_MODE.get(region.policy)
    if mode is None:
        return
    numa.mbind(arena_address(arena) + region.arena_offset, region.nbytes, mode, region.nodes, numa.MPOL_MF_MOVE)


def place(arena, layout: Layout, regions: list[Region] | None = None, *, migrate: bool = True,
          strict: bool = True, step_bytes: int = numa.SAMPLE_STEP_BYTES,
          interleave_tolerance: float = 0.10, stage: str = "placement") -> ResidencyReport:
    """Verify ``regions`` (default: primary regions), migrate strays, verify again.

    Returns the report after repair (``before`` holds the first look, ``migrated`` the regions
    moved). With ``strict``: raises NumaError naming the region, its node(s) and the stray
    sample count when pages are still off-node after migration, and StageError when sampled
    pages of a filled region are absent. Interleave imbalance beyond ``interleave_tolerance``
    is logged as a warning only.
    """
    t0 = time.monotonic()
    regs = layout.primary_regions() if regions is None else regions
    first = verify_residency(arena, layout, regs, step_bytes)
    report = ResidencyReport(regions=list(first.regions), before=list(first.regions))
    for i, (region, res) in enumerate(zip(regs, first.regions, strict=True)):
        if res.stray and migrate and region.policy in _POLICY_MODE:
            log.warning("placement_strays", stage=stage, region=region.name, policy=region.policy,
                        nodes=list(region.nodes), stray_samples=res.stray, samples=res.samples,
                        found=res.node_samples)
            report.migrated.append(region.name)
            for attempt in range(1, MIGRATE_ATTEMPTS + 1):
                migrate_region(arena, region)
                report.regions[i] = region_residency(arena_address(arena), region, step_bytes)
                if not report.regions[i].stray:
                    break
                # a page busy at that moment (on a per-CPU LRU list, under I/O) is skipped by the
                # kernel without an error: the next pass usually takes it
                log.info("placement_migrate_again", stage=stage, region=region.name, attempt=attempt,
                         stray_samples=report.regions[i].stray)
    report.seconds = time.monotonic() - t0
    for res in report.regions:
        # with 2 MiB pages a node's share of a region is off by up to one page: judge only
        # regions big enough for that to stay inside the tolerance
        judged = res.used_bytes * interleave_tolerance >= len(res.planned_nodes) * numa.SAMPLE_STEP_BYTES
        if res.policy == "interleave" and judged and res.interleave_imbalance() > interleave_tolerance:
            log.warning("placement_interleave_uneven", stage=stage, region=res.name,
                        share={str(k): round(v, 3) for k, v in res.share().items()},
                        tolerance=interleave_tolerance)
    if strict:
        bad = [r for r in report.regions if r.stray]
        if bad:
            r = bad[0]
            raise NumaError(
                f"region {r.name} ({r.policy} {list(r.planned_nodes)}): {r.stray} of {r.present} sampled pages "
                f"are on other nodes {r.node_samples} after migration"
                + (f" (and {len(bad) - 1} more regions)" if len(bad) > 1 else "")
            )
        missing = [r for r in report.regions if r.absent or r.errors]
        if missing:
            r = missing[0]
            raise StageError(
                f"region {r.name}: {r.absent} of {r.samples} sampled pages were never written "
                f"and {r.errors} could not be queried (the load did not fill it)"
            )
    return report


def format_residency(report: ResidencyReport) -> str:
    """Table: one row per region (policy, planned nodes, share of samples per node), then bytes
    per node in all."""
    nodes = sorted({n for r in report.regions for n in r.node_samples} | {n for r in report.regions
                                                                           for n in r.planned_nodes})
    head = f"{'region':<18} {'policy':<10} {'planned':<12} " + " ".join(f"{'N' + str(n):>7}" for n in nodes)
    lines = [head]
    for r in report.regions:
        sh = r.share()
        row = " ".join(f"{100 * sh.get(n, 0.0):>6.1f}%" for n in nodes)
        flag = "" if r.ok else f"  stray {r.stray}, absent {r.absent}"
        lines.append(f"{r.name:<18} {r.policy:<10} {str(list(r.planned_nodes)):<12} {row}{flag}")
    bpn = report.bytes_per_node()
    lines.append(f"{'bytes':<18} {'':<10} {'':<12} " + " ".join(f"{bpn.get(n, 0) / GiB:>6.2f}G" for n in nodes))
    return "\n".join(lines)


def log_residency(report: ResidencyReport, stage: str = "placement") -> None:
    """One ``placement_residency`` event per node (bytes, share) and one summary event."""
    total = sum(report.bytes_per_node().values()) or 1
    for n, b in report.bytes_per_node().items():
        log.info("placement_residency", stage=stage, node=n, bytes=b, share=round(b / total, 4))
    log.info("placement_verified", stage=stage, regions=len(report.regions), migrated=len(report.migrated),
             on_plan_fraction=round(report.on_plan_fraction(), 6), seconds=round(report.seconds, 3))


def status_line(report: ResidencyReport) -> str:
    """ASCII STATUS text for systemd, e.g. ``placement: 100.0% of sampled pages on plan; N0 12.1G N1 12.1G``."""
    bpn = " ".join(f"N{n} {b / GiB:.1f}G" for n, b in report.bytes_per_node().items())
    moved = f", migrated {len(report.migrated)} region(s)" if report.migrated else ""
    return f"placement: {100 * report.on_plan_fraction():.1f}% of sampled pages on plan{moved}; {bpn}"


def single_node_reason(layout: Layout | None, topology: Topology | None) -> str | None:
    """Why there is nothing to place (one-node host, one-node plan, only local regions), or None."""
    if topology is not None and not topology.is_multi_node:
        return f"one NUMA node on this host (node {topology.node_ids[0]})"
    if layout is not None and len(layout.nodes) <= 1:
        return f"the plan uses one node ({list(layout.nodes)})"
    if layout is not None and all(r.policy == "local" for r in layout.primary_regions()):
        return f"policy {layout.policy!r} binds nothing"
    return None


@register_stage
class PlacementStage(Stage):
    """Verifies the residency of every primary region fastload filled (``ctx.arena``,
    ``ctx.layout``), migrates stray pages and re-verifies; sets ``ctx.residency`` (a
    :class:`ResidencyReport`; on a one-node host an empty report whose ``note`` says why).
    Settings: ``[placement]`` verify, migrate, strict, sample_stride_bytes, interleave_tolerance."""

    name = "placement"
    requires = ("fastload",)
    reads = ("arena", "layout")
    reads_if_present = ("topology",)
    writes = ("residency",)
    summary = "verify every region's pages are on their planned node(s), migrate strays"

    def skip_reason(self, ctx: PipelineContext) -> str | None:
        return None if ctx.config.placement.verify else "placement.verify = false"

    def run(self, ctx: PipelineContext) -> None:
        arena, layout = ctx.arena, ctx.layout
        if arena is None or layout is None:
            raise StageError("placement: there is no loaded arena to check (fastload did not fill ctx.arena)")
        reason = single_node_reason(layout, ctx.topology)
        if reason:
            ctx.residency = ResidencyReport(note=f"nothing to place: {reason}")
            log.info("placement_nothing_to_place", stage=self.name, reason=reason)
            ctx.status(f"placement: nothing to place ({reason})")
            return
        cfg = ctx.config.placement
        ctx.status(f"placement: checking {len(layout.primary_regions())} regions")
        report = place(arena, layout, migrate=cfg.migrate, strict=cfg.strict,
                       step_bytes=cfg.sample_stride_bytes, interleave_tolerance=cfg.interleave_tolerance,
                       stage=self.name)
        ctx.residency = report
        log_residency(report, self.name)
        ctx.status(status_line(report))
