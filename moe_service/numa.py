"""NUMA topology from sysfs/procfs, and thin ctypes wrappers over the memory-policy syscalls.

Two halves:

1. :class:`Topology` describes the host as the kernel shows it: memory nodes, the CPUs of
   each node this process may run on, the distance matrix, free memory and hugepage pools per
   node, the node of each NVIDIA GPU, THP mode and numa_balancing. Everything is read under an
   injectable ``root`` so tests describe any machine with a fake tree::

       root/sys/devices/system/node/{online,has_memory}
       root/sys/devices/system/node/nodeN/{cpulist,distance,meminfo}
       root/sys/devices/system/node/nodeN/hugepages/hugepages-{2048,1048576}kB/{nr,free}_hugepages
       root/sys/devices/system/cpu/online
       root/proc/self/cgroup  -> root/sys/fs/cgroup/<path>/cpuset.{cpus,mems}.effective (v2)
                                 root/sys/fs/cgroup/cpuset/<path>/cpuset.effective_{cpus,mems} (v1)
       root/proc/self/status  (Cpus_allowed_list: the affinity of a fake root)
       root/proc/{meminfo,cpuinfo}, root/proc/sys/kernel/numa_balancing
       root/sys/kernel/mm/transparent_hugepage/{enabled,defrag}
       root/sys/bus/pci/devices/*/{vendor,class,device,numa_node}

2. :func:`mbind`, :func:`set_mempolicy`, :func:`get_mempolicy`, :func:`move_pages` call the
   kernel through libc ``syscall`` (x86-64 numbers 237, 238, 239, 279; aarch64 235, 237, 236,
   239) and turn a failure into :class:`~moe_service.errors.NumaError` naming the operation,
   address range, nodes and strerror. :func:`page_nodes` samples which node holds each page of
   a range (move_pages query mode, one 4 KiB page per 2 MiB step by default).

Constants and semantics are those of mbind(2), set_mempolicy(2), get_mempolicy(2) and
move_pages(2).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import platform
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_service.errors import NumaError
from moe_service.sizes import MiB

# --- memory policy constants (linux/mempolicy.h) -------------------------------------------

MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4

MPOL_F_NODE = 1 << 0
MPOL_F_ADDR = 1 << 1
MPOL_F_MEMS_ALLOWED = 1 << 2

MPOL_MF_STRICT = 1 << 0
MPOL_MF_MOVE = 1 << 1
MPOL_MF_MOVE_ALL = 1 << 2

MODE_NAMES = {
    MPOL_DEFAULT: "default",
    MPOL_PREFERRED: "preferred",
    MPOL_BIND: "bind",
    MPOL_INTERLEAVE: "interleave",
    MPOL_LOCAL: "local",
}

PAGE_BYTES = 4096
SAMPLE_STEP_BYTES = 2 * MiB
"""Default residency sampling step: one 4 KiB page per 2 MiB (one per x86-64 huge page)."""

NODEMASK_BITS = 1024
"""Width of every nodemask we pass (16 unsigned longs); the kernel's MAX_NUMNODES is <= 1024."""

_SYSCALLS = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "move_pages": 279},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237, "move_pages": 239},
}

MOVE_PAGES_BATCH = 16384
"""Pages per move_pages call (the kernel handles any count; batches bound our array sizes)."""


# --- small parsers -------------------------------------------------------------------------


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist/nodelist such as ``0-3,8,10-11`` (empty text -> [])."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            step = 1
            if ":" in hi:  # 0-31:2/4 style (rare): take the stride, ignore the group size
                hi, rest = hi.split(":", 1)
                step = int(rest.split("/", 1)[0])
            out.extend(range(int(lo), int(hi) + 1, step))
        else:
            out.append(int(part))
    return out


def node_ids_in(node_dir: Path) -> list[int]:
    """Ids of the ``nodeN`` directories under ``node_dir`` (``/sys/devices/system/node``),
    ascending; [] when it cannot be listed."""
    try:
        names = [p.name for p in node_dir.iterdir()]
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def node_cpus(root: Path | str = Path("/")) -> dict[int, list[int]]:
    """node -> its CPUs (``nodeN/cpulist``, every CPU, allowed or not) for every node directory
    under ``root/sys/devices/system/node``, CPU-less nodes included (empty list); a node whose
    cpulist cannot be read is left out; {} without NUMA sysfs. (:meth:`Topology.read` is the
    full picture: memory nodes, allowed CPUs, meminfo; this is the CPU map a worker pool needs.)"""
    node_dir = Path(root) / "sys/devices/system/node"
    out: dict[int, list[int]] = {}
    for nid in node_ids_in(node_dir):
        text = _read(node_dir / f"node{nid}" / "cpulist")
        if text is not None:
            out[nid] = parse_cpulist(text)
    return out


L2_DEFAULT_BYTES = 512 << 10
"""The L2 size :func:`l2_cache_bytes` gives where sysfs does not say (AMD Zen 2-4's per core)."""


def l2_cache_bytes(root: Path | str = Path("/")) -> int:
    """Bytes of CPU 0's level-2 cache (``sys/devices/system/cpu/cpu0/cache/indexN/`` with
    ``level`` 2 and ``type`` Unified or Data, ``size`` such as ``2048K``), or
    :data:`L2_DEFAULT_BYTES` where it cannot be read (no sysfs, a VM that hides it). The
    blocked multi-item matmuls size their row and item blocks from it (quant/tiles_iq_blocked)."""
    cache = Path(root) / "sys/devices/system/cpu/cpu0/cache"
    for index in sorted(cache.glob("index*")) if cache.is_dir() else ():
        level, kind, size = ((_read(index / name) or "").strip() for name in ("level", "type", "size"))
        if level != "2" or kind not in ("Unified", "Data") or not size:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
        digits = size[:-1] if unit != 1 else size
        if digits.isdigit() and int(digits) > 0:
            return int(digits) * unit
    return L2_DEFAULT_BYTES


def format_cpulist(cpus: Iterable[int]) -> str:
    """Inverse of :func:`parse_cpulist`: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    items = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError, PermissionError, OSError):
        return None


def _meminfo_kib(text: str, prefix: str = "") -> dict[str, int]:
    """``Key: value kB`` lines (optionally prefixed ``Node N``) -> {key: value in KiB or count}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if prefix and line.startswith(prefix):
            line = line[len(prefix) :]
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key and fields:
            try:
                out[key.strip()] = int(fields[0])
            except ValueError:
                pass
    return out


def _bracketed(text: str | None) -> str | None:
    """``always [madvise] never`` -> ``madvise``."""
    if text is None:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip() or None


# --- topology ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HugepagePool:
    """One per-node hugetlb pool: ``nr`` pages reserved, ``free`` not in use, of ``size_kib``."""

    size_kib: int
    nr: int
    free: int

    @property
    def free_bytes(self) -> int:
        return self.free * self.size_kib * 1024


def hugepage_pools(node: int, root: Path | str = Path("/")) -> dict[int, HugepagePool]:
    """Node ``node``'s hugetlb pools as the kernel reports them now: page size in KiB -> pool,
    from root/sys/devices/system/node/nodeN/hugepages/hugepages-<size>kB/{nr,free}_hugepages
    (empty when the node or the kernel has none)."""
    pools: dict[int, HugepagePool] = {}
    base = Path(root) / f"sys/devices/system/node/node{node}/hugepages"
    for hp in sorted(base.glob("hugepages-*kB")):
        size_kib = int(hp.name[len("hugepages-") : -2])
        nr = int((_read(hp / "nr_hugepages") or "0").strip() or 0)
        free = int((_read(hp / "free_hugepages") or "0").strip() or 0)
        pools[size_kib] = HugepagePool(size_kib, nr, free)
    return pools


def hugepage_pool_path(node: int, size_kib: int) -> str:
    """The sysfs file that sets node ``node``'s pool of ``size_kib`` KiB pages."""
    return f"/sys/devices/system/node/node{node}/hugepages/hugepages-{size_kib}kB/nr_hugepages"


@dataclass(frozen=True)
class NodeInfo:
    """One NUMA node with memory.

    ``cpus``: CPUs of the node that are online and that this process may run on (affinity and
    cgroup cpuset applied); empty for a memory-only node (CXL, HBM, or all its CPUs excluded).
    ``mem_available_bytes``: MemFree plus reclaimable page cache and slab (Active(file) +
    Inactive(file) + SReclaimable) from nodeN/meminfo: what a large anonymous allocation can
    get on this node without swapping.
    ``hugepages``: size in KiB -> pool (2048 and 1048576 where the kernel has them).
    """

    node: int
    cpus: tuple[int, ...]
    mem_total_bytes: int
    mem_free_bytes: int
    mem_available_bytes: int
    hugepages: dict[int, HugepagePool] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuInfo:
    """An NVIDIA PCI display/3D controller: ``pci_address`` (``0000:17:00.0``), ``device_id``
    (``0x2335``) and the NUMA node the kernel reports (-1 when firmware gives none)."""

    pci_address: str
    device_id: str
    numa_node: int


@dataclass(frozen=True)
class Topology:
    """The host's NUMA layout as read from sysfs/procfs (see module docstring).

    ``nodes``: memory nodes this process may allocate on, ascending. ``distances``: node ->
    node -> SLIT distance (10 = local). ``mem_available_bytes``/``mem_total_bytes``: whole
    host, from /proc/meminfo. ``numa_balancing``: the sysctl (None when absent: kernel without
    NUMA balancing). ``thp_enabled``/``thp_defrag``: the bracketed word of the sysfs files.
    ``cpu_flags``: flags of the first processor in /proc/cpuinfo.
    """

    nodes: tuple[NodeInfo, ...]
    distances: dict[int, dict[int, int]]
    gpus: tuple[GpuInfo, ...] = ()
    thp_enabled: str | None = None
    thp_defrag: str | None = None
    numa_balancing: int | None = None
    mem_total_bytes: int = 0
    mem_available_bytes: int = 0
    cpu_flags: frozenset[str] = frozenset()
    root: str = "/"

    # -- queries --

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.node for n in self.nodes)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def is_multi_node(self) -> bool:
        return len(self.nodes) > 1

    def node(self, node: int) -> NodeInfo:
        """The :class:`NodeInfo` of node id ``node``; NumaError when it is not a memory node."""
        for n in self.nodes:
            if n.node == node:
                return n
        raise NumaError(f"NUMA node {node} is not a memory node of this host (nodes {list(self.node_ids)})")

    def distance(self, a: int, b: int) -> int:
        """SLIT distance from node ``a`` to node ``b`` (10 local, 20 typical remote); a missing
        entry counts as 10 for a == b and 20 otherwise."""
        row = self.distances.get(a, {})
        return row.get(b, 10 if a == b else 20)

    def cpus(self, nodes: Iterable[int] | None = None) -> list[int]:
        """Allowed CPUs of ``nodes`` (all nodes when None), ascending."""
        want = set(self.node_ids if nodes is None else nodes)
        return sorted(c for n in self.nodes if n.node in want for c in n.cpus)

    def gpu_nodes(self) -> list[int]:
        """NUMA node of each NVIDIA GPU in PCI order (-1 where the kernel knows none)."""
        return [g.numa_node for g in self.gpus]

    # -- reading --

    @classmethod
    def read(cls, root: Path | str = Path("/"), affinity: Iterable[int] | None = None) -> Topology:
        """Read the topology under ``root``.

        ``affinity``: CPUs this process may use; default ``os.sched_getaffinity(0)`` when
        ``root`` is ``/``, else ``Cpus_allowed_list`` of ``root/proc/self/status`` (all CPUs
        when that file is absent). A kernel without ``/sys/devices/system/node`` is described
        as one node 0 holding every CPU and all of /proc/meminfo.
        """
        root = Path(root)
        is_live = root.resolve() == Path("/")
        meminfo = _meminfo_kib(_read(root / "proc/meminfo") or "")
        mem_total = meminfo.get("MemTotal", 0) * 1024
        mem_available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0)) * 1024

        online_text = _read(root / "sys/devices/system/cpu/online")
        online_cpus = set(parse_cpulist(online_text)) if online_text is not None else None
        if affinity is not None:
            allowed = set(affinity)
        elif is_live:
            allowed = set(os.sched_getaffinity(0))
        else:
            status = _read(root / "proc/self/status") or ""
            m = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
            allowed = set(parse_cpulist(m.group(1))) if m else None
        cg_cpus, cg_mems = _cgroup_cpuset(root)

        def cpu_ok(c: int) -> bool:
            return (
                (online_cpus is None or c in online_cpus)
                and (allowed is None or c in allowed)
                and (cg_cpus is None or c in cg_cpus)
            )

        node_dir = root / "sys/devices/system/node"
        ids: list[int] = []
        if node_dir.is_dir():
            has_mem = _read(node_dir / "has_memory")
            if has_mem is None:
                has_mem = _read(node_dir / "online")
            if has_mem is not None:
                ids = parse_cpulist(has_mem)
            else:
                ids = node_ids_in(node_dir)
            mems_allowed = cg_mems
            if mems_allowed is None:
                status = _read(root / "proc/self/status") or ""
                m = re.search(r"^Mems_allowed_list:\s*(\S+)", status, re.M)
                mems_allowed = set(parse_cpulist(m.group(1))) if m else None
            if mems_allowed is not None:
                ids = [i for i in ids if i in mems_allowed]

        nodes: list[NodeInfo] = []
        distances: dict[int, dict[int, int]] = {}
        if not ids:
            cpu_all = online_cpus if online_cpus is not None else set(allowed or {0})
            nodes.append(
                NodeInfo(0, tuple(sorted(c for c in cpu_all if cpu_ok(c))), mem_total,
                         meminfo.get("MemFree", 0) * 1024, mem_available)
            )
            distances = {0: {0: 10}}
        else:
            all_online = parse_cpulist(_read(node_dir / "online") or "") or ids
            for nid in ids:
                d = node_dir / f"node{nid}"
                cpus = tuple(c for c in parse_cpulist(_read(d / "cpulist") or "") if cpu_ok(c))
                mi = _meminfo_kib(_read(d / "meminfo") or "", prefix=f"Node {nid} ")
                free_b = mi.get("MemFree", 0) * 1024
                avail_b = free_b + 1024 * (
                    mi.get("Active(file)", 0) + mi.get("Inactive(file)", 0) + mi.get("SReclaimable", 0)
                )
                total_b = mi.get("MemTotal", 0) * 1024
                pools = hugepage_pools(nid, root)
                nodes.append(NodeInfo(nid, cpus, total_b, free_b, avail_b, pools))
                row_text = (_read(d / "distance") or "").split()
                # the distance file lists one entry per online node, in online-node order
                row = {o: int(v) for o, v in zip(all_online, row_text, strict=False)}
                distances[nid] = {o: row.get(o, 10 if o == nid else 20) for o in ids}
            if len(nodes) == 1 and mem_available:
                # One node: /proc/meminfo is authoritative (some VMs under-report nodeN/meminfo
                # when memory was hot-plugged or ballooned).
                n = nodes[0]
                nodes[0] = NodeInfo(n.node, n.cpus, max(n.mem_total_bytes, mem_total),
                                    max(n.mem_free_bytes, meminfo.get("MemFree", 0) * 1024),
                                    max(n.mem_available_bytes, mem_available), n.hugepages)

        bal = _read(root / "proc/sys/kernel/numa_balancing")
        return cls(
            nodes=tuple(nodes),
            distances=distances,
            gpus=tuple(_read_gpus(root)),
            thp_enabled=_bracketed(_read(root / "sys/kernel/mm/transparent_hugepage/enabled")),
            thp_defrag=_bracketed(_read(root / "sys/kernel/mm/transparent_hugepage/defrag")),
            numa_balancing=int(bal.strip()) if bal and bal.strip().lstrip("-").isdigit() else None,
            mem_total_bytes=mem_total,
            mem_available_bytes=mem_available,
            cpu_flags=_cpu_flags(_read(root / "proc/cpuinfo") or ""),
            root=str(root),
        )

    def describe(self) -> dict:
        """A JSON-able summary (node ids as strings) for logs and ``moe-service plan``."""
        return {
            "nodes": [
                {
                    "node": n.node,
                    "cpus": format_cpulist(n.cpus),
                    "mem_total_bytes": n.mem_total_bytes,
                    "mem_available_bytes": n.mem_available_bytes,
                    "hugepages": {str(k): {"nr": p.nr, "free": p.free} for k, p in n.hugepages.items()},
                }
                for n in self.nodes
            ],
            "distances": {str(a): {str(b): d for b, d in row.items()} for a, row in self.distances.items()},
            "gpus": [{"pci": g.pci_address, "device": g.device_id, "node": g.numa_node} for g in self.gpus],
            "thp_enabled": self.thp_enabled,
            "numa_balancing": self.numa_balancing,
        }


def _cgroup_cpuset(root: Path) -> tuple[set[int] | None, set[int] | None]:
    """(cpus, mems) of this process's cgroup cpuset, v2 first then v1; None where unknown."""
    text = _read(root / "proc/self/cgroup")
    if not text:
        return None, None
    cpus = mems = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        rel = path.strip().lstrip("/")
        if hier == "0" and controllers == "":
            base = root / "sys/fs/cgroup" / rel
            c = _read(base / "cpuset.cpus.effective")
            m = _read(base / "cpuset.mems.effective")
            if c is not None and c.strip():
                cpus = set(parse_cpulist(c))
            if m is not None and m.strip():
                mems = set(parse_cpulist(m))
        elif "cpuset" in controllers.split(","):
            base = root / "sys/fs/cgroup/cpuset" / rel
            c = _read(base / "cpuset.effective_cpus")
            m = _read(base / "cpuset.effective_mems")
            if c is not None and c.strip() and cpus is None:
                cpus = set(parse_cpulist(c))
            if m is not None and m.strip() and mems is None:
                mems = set(parse_cpulist(m))
    return cpus, mems


def _read_gpus(root: Path) -> list[GpuInfo]:
    out = []
    for dev in sorted((root / "sys/bus/pci/devices").glob("*")):
        vendor = (_read(dev / "vendor") or "").strip().lower()
        cls = (_read(dev / "class") or "").strip().lower()
        if vendor != "0x10de" or not cls.startswith("0x03"):  # 0x03xxxx: display / 3D controller
            continue
        node_text = (_read(dev / "numa_node") or "-1").strip()
        out.append(GpuInfo(dev.name, (_read(dev / "device") or "").strip(), int(node_text or -1)))
    return out


def _cpu_flags(cpuinfo: str) -> frozenset[str]:
    for line in cpuinfo.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(rest.split())
    return frozenset()


# --- syscalls ------------------------------------------------------------------------------

_libc = None


def _syscall(name: str, *args) -> int:
    """Call syscall ``name`` with integer/pointer ``args``; returns the result or -errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise NumaError(f"{name}: NUMA syscalls are not wired for machine type {platform.machine()!r}")
    ctypes.set_errno(0)
    rc = _libc.syscall(ctypes.c_long(nums[name]), *args)
    if rc < 0:
        return -ctypes.get_errno()
    return rc


def _err(op: str, err: int, detail: str) -> NumaError:
    name = errno_mod.errorcode.get(err, str(err))
    return NumaError(f"{op}({detail}) failed: {name} ({os.strerror(err)})")


def nodemask(nodes: Iterable[int]) -> tuple[ctypes.Array, int]:
    """(unsigned long[16] bitmask with each node's bit set, maxnode) for the policy syscalls.

    ``maxnode`` is ``NODEMASK_BITS + 1`` because the kernel reads ``maxnode - 1`` bits (as
    libnuma passes ``size + 1``). Raises NumaError for a node outside 0..1023.
    """
    arr = (ctypes.c_ulong * (NODEMASK_BITS // 64))()
    for n in nodes:
        if not 0 <= n < NODEMASK_BITS:
            raise NumaError(f"NUMA node {n} is outside 0..{NODEMASK_BITS - 1}")
        arr[n // 64] |= 1 << (n % 64)
    return arr, NODEMASK_BITS + 1


def nodes_of_mask(mask: ctypes.Array) -> list[int]:
    """Node ids whose bit is set in a mask built like :func:`nodemask`."""
    return [w * 64 + b for w in range(len(mask)) for b in range(64) if mask[w] >> b & 1]


def _flag_names(flags: int) -> str:
    names = [n for bit, n in ((MPOL_MF_STRICT, "strict"), (MPOL_MF_MOVE, "move"), (MPOL_MF_MOVE_ALL, "move_all"))
             if flags & bit]
    return "|".join(names) or "0"


def mbind(addr: int, nbytes: int, mode: int, nodes: Sequence[int] = (), flags: int = 0) -> None:
    """Set the memory policy of ``[addr, addr + nbytes)`` (addr page aligned; the kernel rounds
    the length up to pages). ``mode``: MPOL_BIND / MPOL_INTERLEAVE / MPOL_PREFERRED with
    ``nodes``, MPOL_DEFAULT / MPOL_LOCAL without. ``flags``: MPOL_MF_MOVE migrates pages already
    present that break the policy; MPOL_MF_STRICT makes that an error (EIO) when some cannot.

    Raises NumaError naming the range, mode, nodes and strerror (EINVAL: bad node or unaligned
    address; EFAULT: range not mapped; EIO: strict and pages could not move; ENOMEM).
    """
    if addr % PAGE_BYTES:
        raise NumaError(f"mbind(addr=0x{addr:x}): address is not {PAGE_BYTES}-byte aligned")
    mask, maxnode = nodemask(nodes) if nodes else (None, 0)
    rc = _syscall(
        "mbind", ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_long(mode),
        mask if mask is not None else ctypes.c_void_p(0), ctypes.c_ulong(maxnode), ctypes.c_ulong(flags),
    )
    if rc < 0:
        raise _err(
            "mbind", -rc,
            f"addr=0x{addr:x}, len={nbytes}, mode={MODE_NAMES.get(mode, mode)}, nodes={list(nodes)}, "
            f"flags={_flag_names(flags)}",
        )


def set_mempolicy(mode: int, nodes: Sequence[int] = ()) -> None:
    """Set the calling thread's default policy for new allocations (set_mempolicy(2)).

    Raises NumaError naming the mode, nodes and strerror.
    """
    mask, maxnode = nodemask(nodes) if nodes else (None, 0)
    rc = _syscall("set_mempolicy", ctypes.c_long(mode),
                  mask if mask is not None else ctypes.c_void_p(0), ctypes.c_ulong(maxnode))
    if rc < 0:
        raise _err("set_mempolicy", -rc, f"mode={MODE_NAMES.get(mode, mode)}, nodes={list(nodes)}")


def get_mempolicy(addr: int | None = None, flags: int = 0) -> tuple[int, list[int]]:
    """(mode, nodes) of the thread policy, or of the VMA at ``addr`` with MPOL_F_ADDR.

    With ``MPOL_F_NODE | MPOL_F_ADDR`` the first value is instead the node holding the page at
    ``addr`` (the kernel faults it in when absent: use :func:`move_pages` to query without
    touching). Raises NumaError naming the address and strerror.
    """
    mode = ctypes.c_int(0)
    mask, maxnode = nodemask(())
    if addr is not None:
        flags |= MPOL_F_ADDR
    rc = _syscall("get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(maxnode),
                  ctypes.c_void_p(addr or 0), ctypes.c_ulong(flags))
    if rc < 0:
        where = f"addr=0x{addr:x}" if addr is not None else "thread"
        raise _err("get_mempolicy", -rc, f"{where}, flags={flags}")
    return mode.value, nodes_of_mask(mask)


def move_pages(addrs: Sequence[int] | np.ndarray, nodes: Sequence[int] | np.ndarray | None = None,
               flags: int = 0, pid: int = 0) -> np.ndarray:
    """Query (``nodes=None``) or move pages of process ``pid`` (0 = this one).

    ``addrs``: page addresses (any address inside the page). ``nodes``: target node per page,
    or None to only ask where each page is. ``flags``: MPOL_MF_MOVE (pages mapped only by us)
    or MPOL_MF_MOVE_ALL. Returns int32 [len(addrs)] status: the node holding each page after
    the call, or a negative errno (-ENOENT: page not present (-EFAULT on kernels before about
    6.4 for never-touched anonymous pages), -EFAULT: not mapped, -EBUSY / -ENOMEM: could not
    move). Raises NumaError when the call itself fails.
    """
    a = np.ascontiguousarray(np.asarray(addrs, dtype=np.uint64))
    tgt = None if nodes is None else np.ascontiguousarray(np.asarray(nodes, dtype=np.int32))
    if tgt is not None and tgt.shape != a.shape:
        raise ValueError(f"move_pages: {a.size} addresses but {tgt.size} target nodes")
    status = np.full(a.size, -errno_mod.ENOENT, dtype=np.int32)
    for lo in range(0, a.size, MOVE_PAGES_BATCH):
        hi = min(lo + MOVE_PAGES_BATCH, a.size)
        rc = _syscall(
            "move_pages", ctypes.c_long(pid), ctypes.c_ulong(hi - lo),
            ctypes.c_void_p(a.ctypes.data + lo * 8),
            ctypes.c_void_p(0) if tgt is None else ctypes.c_void_p(tgt.ctypes.data + lo * 4),
            ctypes.c_void_p(status.ctypes.data + lo * 4), ctypes.c_long(flags),
        )
        if rc < 0:
            span = f"0x{int(a[lo]):x}..0x{int(a[hi - 1]) + PAGE_BYTES:x}"
            what = "query" if tgt is None else f"to nodes {sorted(set(tgt[lo:hi].tolist()))}"
            raise _err("move_pages", -rc, f"{hi - lo} pages {span}, {what}, flags={_flag_names(flags)}")
    return status


def sample_addresses(addr: int, nbytes: int, step_bytes: int = SAMPLE_STEP_BYTES,
                     seed: int | None = None) -> np.ndarray:
    """uint64 addresses of the pages sampled in ``[addr, addr + nbytes)``: one page in each
    ``step_bytes`` window starting at the page holding ``addr`` (at least one page when
    nbytes > 0).

    ``seed=None`` takes the first page of each window. With a seed the page inside each window
    is drawn at random (reproducibly): interleaved 4 KiB pages go round-robin, so a fixed
    2 MiB stride (512 pages) would see one node only on 2, 4 or 8 nodes.
    """
    if nbytes <= 0:
        return np.zeros(0, dtype=np.uint64)
    start = addr - addr % PAGE_BYTES
    end = addr + nbytes
    n = (end - start + step_bytes - 1) // step_bytes
    base = start + np.arange(n, dtype=np.uint64) * np.uint64(step_bytes)
    if seed is not None and step_bytes > PAGE_BYTES:
        pages = np.random.default_rng(seed).integers(0, step_bytes // PAGE_BYTES, size=n, dtype=np.uint64)
        cand = base + pages * np.uint64(PAGE_BYTES)
        base = np.where(cand < end, cand, base)  # the last window may be short
    return base.astype(np.uint64)


def page_nodes(addr: int, nbytes: int, step_bytes: int = SAMPLE_STEP_BYTES,
               seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Which node each sampled page of ``[addr, addr + nbytes)`` is on, without touching it.

    Returns (addresses uint64 [S], status int32 [S]): status >= 0 is the node, -ENOENT (or
    -EFAULT on older kernels) an absent page (never touched), other negatives errno values. One 4 KiB page per
    ``step_bytes`` window (2 MiB: one sample per transparent huge page); ``seed``: see
    :func:`sample_addresses`. Raises NumaError.
    """
    addrs = sample_addresses(addr, nbytes, step_bytes, seed)
    return addrs, move_pages(addrs)


def status_counts(status: np.ndarray) -> tuple[dict[int, int], int, int]:
    """({node: samples}, absent samples, other errors) of a move_pages status array.

    Absent = never touched: -ENOENT on recent kernels, -EFAULT on older ones (6.1 answers a
    missing anonymous page with -EFAULT through FOLL_DUMP); callers query mapped ranges only,
    so -EFAULT cannot mean "not mapped" here.
    """
    nodes, counts = np.unique(status[status >= 0], return_counts=True)
    absent = int(np.count_nonzero((status == -errno_mod.ENOENT) | (status == -errno_mod.EFAULT)))
    other = int(np.count_nonzero(status < 0)) - absent
    return {int(n): int(c) for n, c in zip(nodes, counts, strict=True)}, absent, other


@contextmanager
def run_on_cpus(cpus: Iterable[int]) -> Iterator[None]:
    """Pin the calling thread to ``cpus`` for the block, then restore its previous affinity.

    With an empty ``cpus`` nothing changes (a memory-only node has no CPUs to run on).
    """
    want = set(cpus)
    if not want:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, want)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def read_numa_maps(pid: int | str = "self", root: Path | str = Path("/")) -> list[dict]:
    """Parse /proc/PID/numa_maps: one dict per mapping with ``start`` (int), ``policy`` (str),
    ``pages`` ({node: pages}) and ``page_kib`` (kernelpagesize_kB, default 4)."""
    out = []
    text = _read(Path(root) / f"proc/{pid}/numa_maps") or ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        entry = {"start": int(fields[0], 16), "policy": fields[1], "pages": {}, "page_kib": 4}
        for f in fields[2:]:
            k, _, v = f.partition("=")
            if k.startswith("N") and k[1:].isdigit() and v.isdigit():
                entry["pages"][int(k[1:])] = int(v)
            elif k == "kernelpagesize_kB" and v.isdigit():
                entry["page_kib"] = int(v)
        out.append(entry)
    return out
