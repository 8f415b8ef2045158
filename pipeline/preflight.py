"""Preflight: refuse a start that cannot succeed, before a single byte is allocated.

``run_preflight(catalog, topology, layout, config)`` runs every check, logs each one
(``preflight_check`` events), and returns a :class:`PreflightReport`; with ``raise_on_fail``
(the default) a failing check raises :class:`~moe_service.errors.CapacityError` (memory) or
:class:`~moe_service.errors.PreflightError` (anything else) whose message carries the
numbers (needed vs available). Checks::

    memory.host         arena bytes vs /proc/meminfo MemAvailable                    fail
    memory.node<N>      the plan's bytes on node N vs its MemFree + reclaimable        fail
                        (less numa.node_reserve_gib)
    hugepages.node<N>   hugetlb pages free on node N vs the bytes bound there, when     fail
                        fastload.hugepage_kib is 2048 or 1048576 (0 = THP, no check)
    thp                 transparent_hugepage/enabled: never -> 4 KiB faults, 512x more  warn
    memlock             RLIMIT_MEMLOCK vs the bytes pin registers, when pin.mode != off warn, fail
                        (fail when pin.mode = required)
    numa_balancing      kernel.numa_balancing=1 on a multi-node plan migrates pages     warn
    cpu_flags           preflight.cpu_flags (avx2 fma f16c) in /proc/cpuinfo (x86-64)   fail
    catalog             every shard present with its size, every tensor inside its      fail
                        shard, plus the catalog's own problems when it lists any
    plan                warnings the planner recorded                                  warn

Config read (all optional, defaults in brackets): ``numa.node_reserve_gib`` [1.0],
``fastload.hugepage_kib`` [0], ``pin.mode`` ["off"], ``preflight.cpu_flags``
[["avx2", "fma", "f16c"]].
"""

from __future__ import annotations

import os
import platform
import resource
from dataclasses import asdict, dataclass, field
from typing import Literal

from moe_service.errors import CapacityError, PreflightError
from moe_service.layout import Layout
from moe_service.log import get_logger
from moe_service.numa import Topology
from pipeline.plan import DEFAULT_NODE_RESERVE_GIB, GIB, node_need_bytes

log = get_logger(__name__)

Status = Literal["ok", "warn", "fail"]
DEFAULT_CPU_FLAGS = ("avx2", "fma", "f16c")


@dataclass
class Check:
    """One preflight check: ``name`` (``memory.node1``), ``status``, a one-sentence ``message``
    and the numbers behind it (``needed_bytes``, ``available_bytes``, ...)."""

    name: str
    status: Status
    message: str
    numbers: dict = field(default_factory=dict)
    capacity: bool = False  # a memory shortfall: raises CapacityError rather than PreflightError


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [{k: v for k, v in asdict(c).items() if k != "capacity"}
                                          for c in self.checks]}

    def raise_for_failures(self) -> None:
        """Raise CapacityError when a memory check failed, else PreflightError, else nothing."""
        fails = self.failures
        if not fails:
            return
        msg = "preflight refused the start: " + "; ".join(c.message for c in fails)
        if any(c.capacity for c in fails):
            raise CapacityError(msg)
        raise PreflightError(msg)


def format_report(report: PreflightReport) -> str:
    """Human table for ``moe-service check``."""
    lines = [f"{c.status.upper():<5} {c.name:<18} {c.message}" for c in report.checks]
    lines.append("preflight: " + ("passed" if report.ok else f"{len(report.failures)} check(s) failed"))
    return "\n".join(lines)


def _section(config, name: str):
    return getattr(config, name, None) if config is not None else None


def _get(section, name: str, default):
    value = getattr(section, name, default) if section is not None else default
    return default if value is None else value


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB ({n} bytes)"


def run_preflight(catalog, topology: Topology, layout: Layout, config=None, *,
                  raise_on_fail: bool = True) -> PreflightReport:
    """Run every check (module docstring) for starting ``layout`` of ``catalog`` on ``topology``.

    ``config``: the service config (sections numa, fastload, pin, preflight read through
    getattr, so any object with those attributes works). Raises CapacityError /
    PreflightError when a check fails and ``raise_on_fail``; returns the report otherwise.
    """
    numa_cfg = _section(config, "numa")
    reserve = int(float(_get(numa_cfg, "node_reserve_gib", DEFAULT_NODE_RESERVE_GIB)) * GIB)
    report = PreflightReport()
    add = report.checks.append

    # -- memory --
    need_total = layout.arena_bytes
    avail_total = topology.mem_available_bytes
    add(Check("memory.host", "ok" if need_total <= avail_total else "fail",
              f"the plan needs {_gib(need_total)} and MemAvailable is {_gib(avail_total)}"
              if need_total > avail_total else
              f"{_gib(need_total)} needed of {_gib(avail_total)} available",
              {"needed_bytes": need_total, "available_bytes": avail_total}, capacity=True))
    need_nodes = node_need_bytes(layout)
    for node, need in sorted(need_nodes.items()):
        try:
            info = topology.node(node)
        except Exception:
            add(Check(f"memory.node{node}", "fail", f"node {node} of the plan is not a memory node of this host",
                      {"needed_bytes": need}, capacity=True))
            continue
        avail = max(info.mem_available_bytes - reserve, 0)
        ok = need <= avail
        add(Check(f"memory.node{node}", "ok" if ok else "fail",
                  (f"node {node}: {_gib(need)} needed of {_gib(avail)} available" if ok else
                   f"node {node} needs {_gib(need)} but has {_gib(avail)} available "
                   f"(MemFree + reclaimable less {reserve / GIB:.1f} GiB reserve)"),
                  {"node": node, "needed_bytes": need, "available_bytes": avail, "reserve_bytes": reserve},
                  capacity=True))

    # -- hugepage pools --
    hp_kib = int(_get(_section(config, "fastload"), "hugepage_kib", 0))
    if hp_kib:
        page_bytes = hp_kib * 1024
        for node, need in sorted(need_nodes.items()):
            try:
                pool = topology.node(node).hugepages.get(hp_kib)
            except Exception:
                continue
            free = pool.free_bytes if pool else 0
            need_pages = -(-need // page_bytes)
            ok = free >= need
            add(Check(f"hugepages.node{node}", "ok" if ok else "fail",
                      f"node {node}: {need_pages} hugepages of {hp_kib} kB needed, "
                      f"{pool.free if pool else 0} free"
                      + ("" if ok else f" (echo {need_pages} > /sys/devices/system/node/node{node}/"
                                       f"hugepages/hugepages-{hp_kib}kB/nr_hugepages)"),
                      {"node": node, "needed_bytes": need, "available_bytes": free, "page_kib": hp_kib},
                      capacity=True))

    # -- THP --
    thp = topology.thp_enabled
    if thp == "never":
        add(Check("thp", "warn", "transparent_hugepage/enabled is never: the load faults 4 KiB pages "
                  "(512x more faults than 2 MiB pages); set it to madvise", {"thp_enabled": thp}))
    else:
        add(Check("thp", "ok", f"transparent_hugepage/enabled is {thp}", {"thp_enabled": thp}))

    # -- memlock for pinning --
    pin_mode = str(_get(_section(config, "pin"), "mode", "off"))
    if pin_mode != "off":
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        unlimited = soft == resource.RLIM_INFINITY
        ok = unlimited or soft >= need_total
        status: Status = "ok" if ok else ("fail" if pin_mode == "required" else "warn")
        shown = "unlimited" if unlimited else _gib(soft)
        add(Check("memlock", status,
                  f"RLIMIT_MEMLOCK is {shown}" + ("" if ok else
                  f" but pin.mode={pin_mode} pins {_gib(need_total)}; set LimitMEMLOCK=infinity in the unit"),
                  {"needed_bytes": need_total, "available_bytes": -1 if unlimited else soft}))

    # -- numa balancing --
    if topology.numa_balancing == 1 and len(layout.nodes) > 1:
        add(Check("numa_balancing", "warn", "kernel.numa_balancing=1 migrates pages away from their planned "
                  "nodes; set it to 0 (sysctl -w kernel.numa_balancing=0)", {"numa_balancing": 1}))
    else:
        add(Check("numa_balancing", "ok", f"kernel.numa_balancing={topology.numa_balancing}",
                  {"numa_balancing": topology.numa_balancing}))

    # -- CPU features --
    want = [str(f) for f in _get(_section(config, "preflight"), "cpu_flags", DEFAULT_CPU_FLAGS)]
    if platform.machine() in ("x86_64", "AMD64") and want:
        if not topology.cpu_flags:
            add(Check("cpu_flags", "warn", "no flags line in /proc/cpuinfo: CPU features not checked"))
        else:
            missing = [f for f in want if f not in topology.cpu_flags]
            add(Check("cpu_flags", "fail" if missing else "ok",
                      f"the CPU lacks {', '.join(missing)} (the expert kernels need {', '.join(want)})"
                      if missing else f"CPU has {', '.join(want)}", {"missing": missing}))

    # -- catalog --
    problems = catalog_problems(catalog)
    add(Check("catalog", "fail" if problems else "ok",
              "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
              if problems else f"{len(catalog.shards)} shard(s), {len(catalog.tensors)} tensors in place",
              {"problems": len(problems)}))

    for w in layout.warnings:
        if "numa_balancing" in w:
            continue  # reported above
        add(Check("plan", "warn", w))

    for c in report.checks:
        (log.warning if c.status != "ok" else log.info)(
            "preflight_check", stage="preflight", check=c.name, status=c.status, message=c.message)
    if raise_on_fail:
        report.raise_for_failures()
    return report


def catalog_problems(catalog) -> list[str]:
    """One sentence per problem of the catalog's files: a shard missing or of another size than
    when it was opened, a tensor reaching past its shard's end, plus whatever the catalog itself
    reports through a ``problems`` attribute/method when it has one."""
    out: list[str] = []
    sizes: dict[int, int] = {}
    for shard in getattr(catalog, "shards", []):
        try:
            size = os.path.getsize(shard.path)
        except OSError as e:
            out.append(f"{shard.path}: shard {shard.index} cannot be read ({e.strerror})")
            continue
        if size != shard.size_bytes:
            out.append(f"{shard.path}: shard {shard.index} is {size} bytes, the catalog read {shard.size_bytes}")
        sizes[shard.index] = min(size, shard.size_bytes)
    by_index = {s.index: s for s in getattr(catalog, "shards", [])}
    for t in catalog.tensors.values():
        size = sizes.get(t.shard)
        if size is not None and t.file_offset + t.nbytes > size:
            out.append(f"{by_index[t.shard].path}: tensor {t.name} ends at byte {t.file_offset + t.nbytes}, "
                       f"past the end of the file ({size} bytes)")
    extra = getattr(catalog, "problems", None)
    if callable(extra):
        extra = extra()
    if extra:
        out.extend(str(p) for p in extra)
    return out
