"""Preflight: refuse a start that cannot succeed, before a single byte is allocated.

``run_preflight(catalog, topology, layout, config)`` runs every check, logs each one
(``preflight_check`` events), and returns a :class:`PreflightReport`; with ``raise_on_fail``
(the default) a failing check raises :class:`~moe_service.errors.CapacityError` (memory) or
:class:`~moe_service.errors.PreflightError` (anything else) whose message carries the
numbers (needed vs available). Checks::

    memory.node<N>      the plan's bytes on node N vs its MemFree + reclaimable        fail
                        less numa.node_reserve_gib           (fastload.pages thp, 4k)
    memory.host         arena bytes vs /proc/meminfo MemAvailable                    fail
    hugepages.node<N>   hugetlb pages the plan puts on node N vs the free pages of    fail
                        its pool, with the command that raises the pool (pages 2m, 1g)
    hugepages.host      the arena's pages vs the free pages of every pool             fail
    thp                 transparent_hugepage/enabled: never -> 4 KiB faults, 512x more  warn
                        (fastload.pages = thp)
    <stage checks>      each declared stage's own checks (Stage.preflight_checks):    warn, fail
                        pin, memlock: what the pin stage will register and
                        RLIMIT_MEMLOCK for it (pipeline.pin.pin_preflight)
    engine.device       engine.device = cuda without a usable CUDA device              fail
                        (the prepare step's DevicePlan, or its refusal)
    numa_balancing      kernel.numa_balancing=1 on a multi-node plan migrates pages     warn
    cpu_flags           :data:`CPU_FLAGS` in /proc/cpuinfo (x86-64)                     fail
    catalog             every shard present with its size, every tensor inside its      fail
                        shard, plus the catalog's own problems when it lists any
    architecture        the architecture is supported and every hyperparameter and     fail
                        tensor agrees with it (moe_service.engine.arch.check_model);
                        engine.experts_per_token within the model's experts
    plan                warnings the planner recorded                                  warn

The memory checks are the plan's own capacity rule (pipeline.plan.node_capacity).
"""

from __future__ import annotations

import os
import platform

from moe_service.config import Settings
from moe_service.engine.device import DevicePlan, resolve_device
from moe_service.errors import PreflightError
from moe_service.gguf_model import GGUFModel
from moe_service.layout import Layout
from moe_service.log import get_logger
from moe_service.numa import Topology
from pipeline.checks import Check, PreflightReport, Status, format_report
from pipeline.plan import kv_capacity, node_capacity, prefix_disk_capacity

__all__ = ["CPU_FLAGS", "Check", "PreflightReport", "Status", "catalog_problems", "format_report", "run_preflight"]

log = get_logger(__name__)

CPU_FLAGS = ("avx2", "fma", "f16c")
"""CPU features the expert kernels are compiled for (moe_service/engine/quant/): AVX2
vpmaddubsw/vpmaddwd block dot products (SSSE3 pshufb comes with it), FMA accumulation
(llvm.fma.v8f32) and F16C vcvtph2ps for the block scales (inline assembly: a CPU without it
faults with an illegal instruction)."""


def run_preflight(catalog: GGUFModel, topology: Topology, layout: Layout, config: Settings, *,
                  device: DevicePlan | PreflightError | None = None, raise_on_fail: bool = True) -> PreflightReport:
    """Run every check (module docstring) for starting ``layout`` of ``catalog`` on ``topology``.

    ``config``: the Settings (numa.node_reserve_gib, fastload.pages, pipeline.stages and what
    their checks read, engine.device). ``device``: what the prepare step resolved
    engine.device to (moe_service.engine.device.resolve_device), or the PreflightError it
    raised; None resolves it here. Raises CapacityError / PreflightError when a check fails
    and ``raise_on_fail``; returns the report otherwise.
    """
    import pipeline.stages  # noqa: F401  (registers every stage: their checks)
    from pipeline.spec import STAGES

    report = PreflightReport()
    add = report.checks.append

    # -- memory: ordinary pages or the nodes' hugetlb pools --
    for cap in node_capacity(layout, topology, config):
        add(Check(cap.name, "ok" if cap.ok else "fail", cap.sentence(), cap.numbers(), capacity=True))

    # -- the KV cache: its budget, and its node's memory beside the weights (pipeline.plan.kv_capacity) --
    if getattr(catalog, "params", None) is not None:  # (placement-only test catalogs have no model params)
        try:
            kv = kv_capacity(catalog, layout, topology, config)
            add(Check("kv_cache", "ok" if kv["fits"] else "fail", "; ".join(kv["reasons"]) or kv["sentence"],
                      {k: kv[k] for k in ("kv_type", "n_seq", "n_ctx", "bytes_per_token", "state_bytes_per_seq",
                                          "total_bytes", "budget_bytes", "node", "node_need_bytes",
                                          "node_available_bytes")},
                      capacity=True))
        except ValueError as e:  # a kv_type the model's head dims cannot take
            add(Check("kv_cache", "fail", str(e)))

    # -- the prefix cache's disk store: room on its file system (pipeline.plan.prefix_disk_capacity) --
    disk = prefix_disk_capacity(config)
    if disk is not None:
        add(Check("prefix_cache_disk", "ok" if disk["fits"] else "fail", "; ".join(disk["reasons"]) or disk["sentence"],
                  {k: disk[k] for k in ("dir", "budget_bytes", "stored_bytes", "free_bytes")}, capacity=True))

    # -- THP --
    pages = config.fastload.pages
    if pages == "thp":
        thp = topology.thp_enabled
        if thp == "never":
            add(Check("thp", "warn", "transparent_hugepage/enabled is never: the load faults 4 KiB pages "
                      "(512x more faults than 2 MiB pages); set it to madvise", {"thp_enabled": thp}))
        else:
            add(Check("thp", "ok", f"transparent_hugepage/enabled is {thp}", {"thp_enabled": thp}))

    # -- the declared stages' own checks (pin: pinning and memlock) --
    for name in config.pipeline.stages:
        stage = STAGES.get(name)
        if stage is not None:
            report.checks.extend(stage.preflight_checks(config, layout))

    # -- the dense part's device --
    if device is None:
        try:
            device = resolve_device(config.engine.device, topology.gpus)
        except PreflightError as e:
            device = e
    if isinstance(device, PreflightError):
        add(Check("engine.device", "fail", str(device)))
    else:
        add(Check("engine.device", "ok", f"engine.device = {config.engine.device}: the dense part runs on "
                  f"{device.device} ({device.dense})", {"device": device.device}))

    # -- numa balancing --
    if topology.numa_balancing == 1 and len(layout.nodes) > 1:
        add(Check("numa_balancing", "warn", "kernel.numa_balancing=1 migrates pages away from their planned "
                  "nodes; set it to 0 (sysctl -w kernel.numa_balancing=0)", {"numa_balancing": 1}))
    else:
        add(Check("numa_balancing", "ok", f"kernel.numa_balancing={topology.numa_balancing}",
                  {"numa_balancing": topology.numa_balancing}))

    # -- CPU features --
    if platform.machine() in ("x86_64", "AMD64"):
        if not topology.cpu_flags:
            add(Check("cpu_flags", "warn", "no flags line in /proc/cpuinfo: CPU features not checked"))
        else:
            missing = [f for f in CPU_FLAGS if f not in topology.cpu_flags]
            add(Check("cpu_flags", "fail" if missing else "ok",
                      f"the CPU lacks {', '.join(missing)} (the expert kernels need {', '.join(CPU_FLAGS)})"
                      if missing else f"CPU has {', '.join(CPU_FLAGS)}", {"missing": missing}))

    # -- catalog --
    problems = catalog_problems(catalog)
    add(Check("catalog", "fail" if problems else "ok",
              "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
              if problems else f"{len(catalog.shards)} shard(s), {len(catalog.tensors)} tensors in place",
              {"problems": len(problems)}))

    # -- architecture --
    if hasattr(catalog, "metadata") and hasattr(getattr(catalog, "params", None), "arch"):  # a bare catalog (no arch name): no check
        from moe_service.engine.arch import check_model

        arch_problems = [p.message for p in check_model(catalog)]
        n_expert, k = getattr(catalog.params, "n_expert", 0), config.engine.experts_per_token
        if k and k > n_expert:
            arch_problems.append(f"engine.experts_per_token = {k} but the model has {n_expert} experts per layer "
                                 "(0 = the model's own top-k)")
        add(Check("architecture", "fail" if arch_problems else "ok",
                  "; ".join(arch_problems[:5]) + (f" (and {len(arch_problems) - 5} more)" if len(arch_problems) > 5
                                                  else "") if arch_problems
                  else f"{catalog.params.arch}: hyperparameters and tensors agree", {"problems": len(arch_problems)}))

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
        shard_bytes = sizes.get(t.shard)
        if shard_bytes is not None and t.file_offset + t.nbytes > shard_bytes:
            out.append(f"{by_index[t.shard].path}: tensor {t.name} ends at byte {t.file_offset + t.nbytes}, "
                       f"past the end of the file ({shard_bytes} bytes)")
    extra = getattr(catalog, "problems", None)
    if callable(extra):
        extra = extra()
    if extra:
        out.extend(str(p) for p in extra)
    return out
