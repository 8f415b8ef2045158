"""The placement plan: where every tensor and every expert slab lives, before anything is allocated.

``plan(catalog, topology, config, gpu_node=...)`` is pure: it reads the GGUF
catalog (sizes, offsets), the NUMA :class:`~moe_service.numa.Topology` and the config, and
returns a :class:`~moe_service.layout.Layout`. Policies (``numa.policy``)::

    expert_shard  expert e of each layer -> node e * N // E (a node's experts are contiguous in
                  the file: one extent per (tensor, node)), or e % N with
                  numa.expert_homes = "round_robin"; one bind region per node;
                  dense tensors interleaved over all nodes, or bound to the GPU's node
                  | experts node0 | experts node1 | ... | dense | replicas node0 | replicas node1 |
    interleave    one region holding every tensor, pages interleaved over all nodes
    mirror        a full copy of the model per node; the first node's copy is read from the
                  file, the others are copied from it by the replication stage
    local         one region without a policy (first touch decides)

``replication.replicas = k`` adds k copies of every expert slab (expert_shard only) on the
k nodes farthest from its home by the distance matrix; when several nodes tie, a home node's
experts are split into contiguous chunks spread over the tied nodes, least-loaded first, so
replica bytes balance and every copy is still one extent per (tensor, home, target).

A one-node host (or a one-node selection) always gets the trivial plan: one ``local`` region.

Regions are aligned to ``layout.align_bytes``: 2 MiB, or the hugetlb page size with
``fastload.pages`` = 2m / 1g (mbind splits a hugetlb mapping only at page boundaries).

Capacity: :func:`node_capacity` compares the bytes each node must hold with what it has
(nodeN/meminfo MemFree + reclaimable less ``numa.node_reserve_gib``; with hugetlb pages, the
free pages of the node's pool); :func:`check_capacity` gives one sentence per shortfall, which
the preflight stage and ``moe-service plan`` report. ``plan(strict=True)`` raises
:class:`~moe_service.errors.CapacityError` naming the node and both numbers.
:func:`plan_summary` / :func:`format_plan` give ``moe-service plan`` its JSON and its table.

Config read (:class:`~moe_service.config.Settings`): ``numa.policy``, ``numa.expert_homes``,
``numa.nodes``, ``numa.node_reserve_gib``, ``replication.replicas``, ``fastload.pages``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moe_service.config import NumaConfig, Settings
from moe_service.errors import CapacityError, ConfigError, NumaError
from moe_service.layout import (
    HUGETLB_PAGE_BYTES,
    SLAB_ALIGN_BYTES,
    CopyExtent,
    ExpertPlacement,
    Extent,
    Layout,
    Region,
    RegionPolicy,
    RegionRole,
    align_up,
    region_align_bytes,
)
from moe_service.numa import Topology, hugepage_pool_path
from moe_service.sizes import GiB, KiB, MiB, gib_text

if TYPE_CHECKING:
    from moe_service.gguf_model import GGUFModel


def expert_home(e: int, n_expert: int, n_nodes: int) -> int:
    """Index (into the plan's node list) of expert ``e``'s home under ``expert_shard``:
    ``e * n_nodes // n_expert``, so each node holds one contiguous run of experts."""
    return e * n_nodes // n_expert


def home_ranges(n_expert: int, n_nodes: int) -> list[tuple[int, int]]:
    """[lo, hi) expert range homed on each node index under ``expert_shard``."""
    bounds = [0] * (n_nodes + 1)
    for i in range(n_nodes + 1):
        # smallest e with e * n_nodes // n_expert >= i  <=>  e >= ceil(i * n_expert / n_nodes)
        bounds[i] = min(n_expert, -(-i * n_expert // n_nodes))
    return [(bounds[i], bounds[i + 1]) for i in range(n_nodes)]


HOME_RULES = ("contiguous", "round_robin")


def home_members(n_expert: int, n_nodes: int, rule: str = "contiguous") -> list[list[int]]:
    """Experts homed on each node index, ascending: ``contiguous`` (e * N // E, the
    expert_shard default: one run of the file per node) or ``round_robin`` (e % N: spreads
    each group of consecutive experts over every node, which balances group-limited routers
    better; see bench/placement.py). Raises ConfigError for another rule."""
    if rule == "contiguous":
        return [list(range(lo, hi)) for lo, hi in home_ranges(n_expert, n_nodes)]
    if rule == "round_robin":
        return [list(range(i, n_expert, n_nodes)) for i in range(n_nodes)]
    raise ConfigError(f"numa.expert_homes: unknown rule {rule!r} (choose one of {', '.join(HOME_RULES)})")


def replica_chunks(home: int, candidates: Iterable[int], k: int, topology: Topology,
                   lo: int, hi: int, load: dict[int, int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Split experts [lo, hi) homed on node ``home`` into chunks with their k replica nodes.

    Returns [(chunk_lo, chunk_hi, target nodes)], farthest nodes first: whole distance tiers
    are taken while they fit in k; the tier that is only partly needed (m of its t nodes) is
    shared out by splitting the range into t contiguous chunks, chunk j going to tier nodes
    j, j+1, .. j+m-1 (mod t), the tier ordered by ``load`` (experts already given to each
    node, updated here) so ties balance bytes. Every expert gets k distinct nodes != home.
    """
    others = [n for n in candidates if n != home]
    if k <= 0 or hi <= lo:
        return [(lo, hi, ())] if hi > lo else []
    if k > len(others):
        raise ConfigError(f"replication.replicas={k} needs {k} nodes besides node {home}, "
                          f"the plan has {len(others)}")
    tiers: dict[int, list[int]] = {}
    for n in others:
        tiers.setdefault(topology.distance(home, n), []).append(n)
    full: list[int] = []
    partial: list[int] = []
    m = 0
    for dist in sorted(tiers, reverse=True):
        tier = tiers[dist]
        need = k - len(full)
        if need <= 0:
            break
        if len(tier) <= need:
            full.extend(sorted(tier))
        else:
            partial, m = sorted(tier, key=lambda n: (load.get(n, 0), n)), need
            break
    count = hi - lo
    for n in full:
        load[n] = load.get(n, 0) + count
    if not partial:
        return [(lo, hi, tuple(full))]
    t = len(partial)
    chunks = []
    for j in range(t):
        c_lo = lo + j * count // t
        c_hi = lo + (j + 1) * count // t
        if c_hi <= c_lo:
            continue
        picks = tuple(partial[(j + i) % t] for i in range(m))
        for n in picks:
            load[n] = load.get(n, 0) + (c_hi - c_lo)
        chunks.append((c_lo, c_hi, tuple(full) + picks))
    return chunks


class _RegionBuilder:
    """Accumulates a region's contents at region-relative offsets, merging adjacent extents."""

    def __init__(self, name: str, role: RegionRole, policy: RegionPolicy, nodes: tuple[int, ...]):
        self.region = Region(name=name, role=role, policy=policy, nodes=nodes, arena_offset=0, nbytes=0)
        self.off = 0

    def add_file(self, shard: int, file_offset: int, nbytes: int) -> int:
        """Place ``nbytes`` read from the file at the next cache-line offset; returns it."""
        off = align_up(self.off, SLAB_ALIGN_BYTES)
        ext = self.region.extents
        if ext and ext[-1].shard == shard and ext[-1].file_offset + ext[-1].nbytes == file_offset \
                and ext[-1].region_offset + ext[-1].nbytes == off:
            last = ext[-1]
            ext[-1] = Extent(shard, last.file_offset, last.nbytes + nbytes, last.region_offset)
        else:
            ext.append(Extent(shard, file_offset, nbytes, off))
        self.off = off + nbytes
        return off

    def add_copy(self, src_arena_offset: int, nbytes: int) -> int:
        """Place ``nbytes`` copied from the arena at the next cache-line offset; returns it."""
        off = align_up(self.off, SLAB_ALIGN_BYTES)
        cps = self.region.copies
        if cps and cps[-1].src_arena_offset + cps[-1].nbytes == src_arena_offset \
                and cps[-1].region_offset + cps[-1].nbytes == off:
            last = cps[-1]
            cps[-1] = CopyExtent(last.src_arena_offset, last.nbytes + nbytes, last.region_offset)
        else:
            cps.append(CopyExtent(src_arena_offset, nbytes, off))
        self.off = off + nbytes
        return off

    def finish(self, arena_offset: int, align_bytes: int) -> Region:
        self.region.used_bytes = self.off
        self.region.nbytes = align_up(max(self.off, 1), align_bytes)
        self.region.arena_offset = arena_offset
        return self.region


@dataclass
class _Slots:
    """Region-relative placement of each copy, resolved to arena offsets once regions are laid out."""

    tensors: dict[str, list[tuple[_RegionBuilder, int]]] = field(default_factory=dict)
    experts: dict[tuple[int, str], list[list[tuple[_RegionBuilder, int, int]]]] = field(default_factory=dict)


def select_nodes(topology: Topology, numa: NumaConfig) -> tuple[int, ...]:
    """Nodes the plan uses: ``numa.nodes`` when set (each must be a memory node), else every
    memory node with at least one allowed CPU (all memory nodes if none has CPUs)."""
    want = list(numa.nodes)
    ids = topology.node_ids
    if want:
        bad = [n for n in want if n not in ids]
        if bad:
            raise ConfigError(f"numa.nodes: {bad} are not memory nodes this process may use "
                              f"(available: {list(ids)})")
        return tuple(sorted(set(want)))
    with_cpus = tuple(n.node for n in topology.nodes if n.cpus)
    return with_cpus or ids


def plan(catalog: GGUFModel, topology: Topology, config: Settings, *, gpu_node: int | None = None,
         strict: bool = True, replicate: bool = True) -> Layout:
    """Compute the :class:`Layout` of ``catalog`` on ``topology`` (allocates nothing).

    ``catalog``: a GGUFModel (or any object with ``tensors`` {name: TensorInfo with shard,
    file_offset, nbytes} and ``expert_layers`` {layer: {kind: ExpertTensor with tensor,
    n_expert, slab_bytes, slab(e)}}). ``config``: the Settings (module docstring lists what is
    read). ``gpu_node``: when a GPU runs the dense part, its NUMA node: dense tensors are bound
    there instead of interleaved. ``strict``: raise CapacityError when a node cannot hold its
    share (else the caller reads :func:`check_capacity`). ``replicate``: plan the copies on
    other nodes (``replication.replicas``, the ``mirror`` copies); False when no replication
    stage will fill them (pipeline.prepare.plan_layout): then no replica region exists, a
    ``mirror`` plan holds only its first node's copy, and a warning says what was left out.
    Raises ConfigError for a bad node list, too many replicas or a GPU node outside the plan.
    """
    policy = config.numa.policy
    replicas = config.replication.replicas
    align = region_align_bytes(config.fastload.pages)
    nodes = select_nodes(topology, config.numa)
    if replicas > max(len(nodes) - 1, 0):
        raise ConfigError(f"replication.replicas: must be 0..{max(len(nodes) - 1, 0)} on this host's "
                          f"{len(nodes)} node(s) (got {replicas})")
    if gpu_node is not None and gpu_node not in nodes:
        raise ConfigError(f"the GPU's NUMA node {gpu_node} is not among the plan's nodes {list(nodes)}")
    warnings: list[str] = []
    if topology.numa_balancing == 1 and len(nodes) > 1:
        warnings.append("kernel.numa_balancing=1: the kernel will migrate pages away from their planned "
                        "nodes; set it to 0 (sysctl -w kernel.numa_balancing=0)")
    no_cpu = [n for n in nodes if not topology.node(n).cpus]
    if no_cpu and len(nodes) > 1:
        warnings.append(f"nodes {no_cpu} have no CPUs this process may use: experts there are read remotely")

    if len(nodes) == 1:
        layout = _plan_single(catalog, nodes[0], policy, align)
    elif policy == "local":
        layout = _plan_single(catalog, None, policy, align)
        layout.nodes = nodes
    elif policy == "interleave":
        layout = _plan_interleave(catalog, nodes, align)
    elif policy == "mirror":
        layout = _plan_mirror(catalog, nodes, align, with_copies=replicate)
        if not replicate:
            warnings.append(f"numa.policy = mirror keeps one copy of the model, on node {nodes[0]}: the declared "
                            "stages lack replication, which copies it to the other nodes")
    else:
        layout = _plan_expert_shard(catalog, topology, nodes, replicas if replicate else 0, gpu_node,
                                    config.numa.expert_homes, align)
        if replicas and not replicate:
            warnings.append(f"replication.replicas = {replicas}: no replica regions planned, the declared stages "
                            "lack replication, which fills them")
    if replicas and replicate and layout.replicas != replicas:
        warnings.append(f"replication.replicas={replicas} ignored: policy {policy!r} on {len(nodes)} node(s) "
                        "has no per-node expert homes to replicate")
    layout.warnings.extend(warnings)
    if strict:
        problems = check_capacity(layout, topology, config)
        if problems:
            raise CapacityError(f"the {policy!r} plan does not fit this host: " + "; ".join(problems))
    return layout


def _expert_names(catalog) -> set[str]:
    return {et.tensor.name for kinds in catalog.expert_layers.values() for et in kinds.values()}


def _resolve(layout_regions: list[_RegionBuilder], slots: _Slots, catalog, n_copies_max: int,
             nodes: tuple[int, ...], policy: str, replicas: int, align_bytes: int) -> Layout:
    """Turn builders + slots into a Layout (regions must already be finished)."""
    tensors = {name: [b.region.arena_offset + off for b, off in copies] for name, copies in slots.tensors.items()}
    experts: dict[tuple[int, str], ExpertPlacement] = {}
    for (layer, kind), per_expert in slots.experts.items():
        et = catalog.expert_layers[layer][kind]
        offs = np.full((et.n_expert, n_copies_max), -1, dtype=np.int64)
        nds = np.full((et.n_expert, n_copies_max), -1, dtype=np.int32)
        for e, copies in enumerate(per_expert):
            for c, (b, off, node) in enumerate(copies):
                offs[e, c] = b.region.arena_offset + off
                nds[e, c] = node
        experts[(layer, kind)] = ExpertPlacement(layer, kind, et.slab_bytes, offs, nds)
    regions = [b.region for b in layout_regions]
    arena = max((r.arena_offset + r.nbytes for r in regions), default=0)
    return Layout(regions, arena, tensors, experts, nodes=nodes, policy=policy, replicas=replicas,
                  align_bytes=align_bytes)


def _lay_out(builders: list[_RegionBuilder], align_bytes: int, start: int = 0) -> int:
    off = start
    for b in builders:
        b.finish(off, align_bytes)
        off += b.region.nbytes
    return off


def _whole_tensors(b: _RegionBuilder, catalog, slots: _Slots, node: int) -> None:
    """Every tensor of the file, whole and in file order, into one builder (experts included)."""
    expert_of = {et.tensor.name: (layer, kind) for layer, kinds in catalog.expert_layers.items()
                 for kind, et in kinds.items()}
    for t in catalog.tensors.values():
        off = b.add_file(t.shard, t.file_offset, t.nbytes)
        slots.tensors.setdefault(t.name, []).append((b, off))
        key = expert_of.get(t.name)
        if key is not None:
            et = catalog.expert_layers[key[0]][key[1]]
            per = slots.experts.setdefault(key, [[] for _ in range(et.n_expert)])
            base_file = et.slab(0)[1]
            for e in range(et.n_expert):
                per[e].append((b, off + (et.slab(e)[1] - base_file), node))


def _plan_single(catalog, node: int | None, policy: str, align: int) -> Layout:
    b = _RegionBuilder("all", "primary", "local", ())
    slots = _Slots()
    _whole_tensors(b, catalog, slots, -1 if node is None else node)
    _lay_out([b], align)
    return _resolve([b], slots, catalog, 1, (node,) if node is not None else (0,), policy, 0, align)


def _plan_interleave(catalog, nodes: tuple[int, ...], align: int) -> Layout:
    b = _RegionBuilder("all", "primary", "interleave", nodes)
    slots = _Slots()
    _whole_tensors(b, catalog, slots, -1)
    _lay_out([b], align)
    return _resolve([b], slots, catalog, 1, nodes, "interleave", 0, align)


def _plan_mirror(catalog, nodes: tuple[int, ...], align: int, with_copies: bool = True) -> Layout:
    first = _RegionBuilder(f"mirror.node{nodes[0]}", "primary", "bind", (nodes[0],))
    slots = _Slots()
    _whole_tensors(first, catalog, slots, nodes[0])
    _lay_out([first], align)
    if not with_copies:
        return _resolve([first], slots, catalog, 1, nodes, "mirror", 0, align)
    builders = [first]
    for n in nodes[1:]:
        b = _RegionBuilder(f"mirror.node{n}", "replica", "bind", (n,))
        b.add_copy(first.region.arena_offset, first.region.used_bytes)
        builders.append(b)
    # Each copy region is the first region byte for byte (one CopyExtent), so copy c of
    # anything lives at (its offset in the first region) + region c's start.
    _lay_out(builders[1:], align, start=first.region.nbytes)
    for name, copies in slots.tensors.items():
        _b0, off = copies[0]
        copies.extend((b, off) for b in builders[1:])
        slots.tensors[name] = copies
    for per in slots.experts.values():
        for expert_copies in per:
            _b0, off, _n = expert_copies[0]
            expert_copies.extend((b, off, b.region.nodes[0]) for b in builders[1:])
    return _resolve(builders, slots, catalog, len(nodes), nodes, "mirror", len(nodes) - 1, align)


def _plan_expert_shard(catalog, topology: Topology, nodes: tuple[int, ...], replicas: int,
                       gpu_node: int | None, homes_rule: str, align: int) -> Layout:
    n_nodes = len(nodes)
    expert_names = _expert_names(catalog)
    node_b = {n: _RegionBuilder(f"experts.node{n}", "primary", "bind", (n,)) for n in nodes}
    if gpu_node is not None:
        dense = _RegionBuilder("dense", "primary", "bind", (gpu_node,))
    else:
        dense = _RegionBuilder("dense", "primary", "interleave", nodes)
    slots = _Slots()
    for t in catalog.tensors.values():
        if t.name not in expert_names:
            off = dense.add_file(t.shard, t.file_offset, t.nbytes)
            slots.tensors[t.name] = [(dense, off)]
    # expert tensors in file order; each node's experts in expert order (contiguous homes: one
    # run of the file per (tensor, node), merged into one extent)
    order = {name: i for i, name in enumerate(catalog.tensors)}
    ets = sorted((et for kinds in catalog.expert_layers.values() for et in kinds.values()),
                 key=lambda et: order.get(et.tensor.name, 0))
    for et in ets:
        per = slots.experts.setdefault((et.layer, et.kind), [[] for _ in range(et.n_expert)])
        for i, members in enumerate(home_members(et.n_expert, n_nodes, homes_rule)):
            b = node_b[nodes[i]]
            for e in members:
                shard, file_offset, nbytes = et.slab(e)
                per[e].append((b, b.add_file(shard, file_offset, nbytes), nodes[i]))
    primaries = [node_b[n] for n in nodes if node_b[n].off > 0] + ([dense] if dense.off > 0 else [])
    end = _lay_out(primaries, align)

    replica_builders: list[_RegionBuilder] = []
    if replicas > 0:
        rep_b = {n: _RegionBuilder(f"replicas.node{n}", "replica", "bind", (n,)) for n in nodes}
        candidates = [n for n in nodes if topology.node(n).cpus] or list(nodes)
        load: dict[int, int] = {}
        chunk_cache: dict[tuple[int, int], list] = {}
        for et in ets:
            per = slots.experts[(et.layer, et.kind)]
            for i, members in enumerate(home_members(et.n_expert, n_nodes, homes_rule)):
                key = (nodes[i], et.n_expert)
                if key not in chunk_cache:
                    chunk_cache[key] = replica_chunks(nodes[i], candidates, replicas, topology, 0, len(members), load)
                for c_lo, c_hi, targets in chunk_cache[key]:
                    for tgt in targets:
                        rb = rep_b[tgt]
                        for e in members[c_lo:c_hi]:
                            b0, off0, _ = per[e][0]
                            src = b0.region.arena_offset + off0
                            per[e].append((rb, rb.add_copy(src, et.slab_bytes), tgt))
        replica_builders = [rep_b[n] for n in nodes if rep_b[n].off > 0]
        _lay_out(replica_builders, align, start=end)
    layout = _resolve(primaries + replica_builders, slots, catalog, 1 + replicas, nodes, "expert_shard", replicas,
                      align)
    return layout


# --- capacity ------------------------------------------------------------------------------


def node_need_bytes(layout: Layout, regions: list[Region] | None = None) -> dict[int, int]:
    """Bytes each node must supply for ``layout`` (or only its ``regions``): whole bound regions
    (padding included, as fastload populates whole regions) plus an even share (rounded up)
    of interleaved ones. ``local`` regions count against the layout's first node on a one-node
    plan and are left out otherwise (first touch decides)."""
    need = {n: 0 for n in layout.nodes}
    for r in layout.regions if regions is None else regions:
        if r.policy == "bind":
            need[r.nodes[0]] = need.get(r.nodes[0], 0) + r.nbytes
        elif r.policy == "interleave":
            for n in r.nodes:
                need[n] = need.get(n, 0) + -(-r.nbytes // len(r.nodes))
        elif len(layout.nodes) == 1:
            need[layout.nodes[0]] = need.get(layout.nodes[0], 0) + r.nbytes
    return need


def _gib(n: int) -> str:
    """A size in the capacity sentences: one decimal and the exact byte count."""
    return gib_text(n, 1, exact=True)


def _page_name(page_kib: int) -> str:
    page_bytes = page_kib * KiB
    return f"{page_bytes // GiB} GiB" if page_bytes >= GiB else f"{page_bytes // MiB} MiB"


@dataclass(frozen=True)
class NodeCapacity:
    """What one node (``node``; None: the whole host) must hold for a plan, against what it has.

    Ordinary memory (``page_kib`` 0, fastload.pages thp or 4k): ``available_bytes`` is the
    node's MemFree + reclaimable less ``reserve_bytes`` (numa.node_reserve_gib); for the host,
    /proc/meminfo MemAvailable. hugetlb pages (``page_kib`` 2048 or 1048576): the free pages of
    the node's pool of that size (host: of every node's pool), ``pool_pages`` its
    nr_hugepages. ``needed_bytes`` comes from :func:`node_need_bytes` (host: the arena).
    """

    node: int | None
    needed_bytes: int
    available_bytes: int
    reserve_bytes: int = 0
    page_kib: int = 0
    pool_pages: int = 0

    @property
    def ok(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    @property
    def name(self) -> str:
        """The preflight check's name: memory.node1, memory.host, hugepages.node1, hugepages.host."""
        return ("hugepages." if self.page_kib else "memory.") + ("host" if self.node is None else f"node{self.node}")

    @property
    def needed_pages(self) -> int:
        return -(-self.needed_bytes // (self.page_kib * 1024)) if self.page_kib else 0

    @property
    def free_pages(self) -> int:
        return self.available_bytes // (self.page_kib * 1024) if self.page_kib else 0

    def raise_command(self) -> str | None:
        """The command that makes a short node pool big enough (None when it is not one)."""
        if self.ok or not self.page_kib or self.node is None:
            return None
        want = self.pool_pages + self.needed_pages - self.free_pages
        return f"echo {want} > {hugepage_pool_path(self.node, self.page_kib)}"

    def sentence(self) -> str:
        """One sentence with both numbers (and the fix, for a short hugetlb pool)."""
        where = "the host" if self.node is None else f"node {self.node}"
        if self.page_kib:
            size = _page_name(self.page_kib)
            if self.ok:
                pools = "its pool" if self.node is not None else "the nodes' pools"
                return f"{where}: {self.needed_pages} pages of {size} needed, {self.free_pages} free in {pools}"
            text = (f"{where} needs {self.needed_pages} hugetlb pages of {size} but "
                    f"{'its pool has' if self.node is not None else 'the pools have'} {self.free_pages} free "
                    f"(of {self.pool_pages})")
            cmd = self.raise_command()
            return text + (f"; raise it: {cmd}" if cmd else "")
        if self.node is None:
            if self.ok:
                return f"{_gib(self.needed_bytes)} needed of {_gib(self.available_bytes)} available"
            return f"the plan needs {_gib(self.needed_bytes)} and MemAvailable is {_gib(self.available_bytes)}"
        if self.ok:
            return f"node {self.node}: {_gib(self.needed_bytes)} needed of {_gib(self.available_bytes)} available"
        return (f"node {self.node} needs {_gib(self.needed_bytes)} but has {_gib(self.available_bytes)} available "
                f"(MemFree + reclaimable less {self.reserve_bytes / GiB:.1f} GiB reserve)")

    def numbers(self) -> dict:
        out = {"needed_bytes": self.needed_bytes, "available_bytes": self.available_bytes}
        if self.node is not None:
            out["node"] = self.node
        if self.page_kib:
            out.update(page_kib=self.page_kib, needed_pages=self.needed_pages, free_pages=self.free_pages,
                       pool_pages=self.pool_pages)
        elif self.node is not None:
            out["reserve_bytes"] = self.reserve_bytes
        return out


def node_capacity(layout: Layout, topology: Topology, config: Settings) -> list[NodeCapacity]:
    """Each node of ``layout`` (ascending), then the whole host: what it must hold vs what it
    has, in ordinary memory or, with ``fastload.pages`` = 2m / 1g, in its hugetlb pool."""
    page_bytes = HUGETLB_PAGE_BYTES.get(config.fastload.pages, 0)
    page_kib = page_bytes // 1024
    reserve = 0 if page_kib else int(config.numa.node_reserve_gib * GiB)
    out: list[NodeCapacity] = []
    for node, need in sorted(node_need_bytes(layout).items()):
        if page_bytes:  # an interleaved share is whole pages too
            need = align_up(need, page_bytes)
        try:
            info = topology.node(node)
        except NumaError:
            out.append(NodeCapacity(node, need, 0, reserve, page_kib))
            continue
        if page_kib:
            pool = info.hugepages.get(page_kib)
            out.append(NodeCapacity(node, need, pool.free_bytes if pool else 0, 0, page_kib, pool.nr if pool else 0))
        else:
            out.append(NodeCapacity(node, need, max(info.mem_available_bytes - reserve, 0), reserve))
    if page_kib:
        pools = [n.hugepages[page_kib] for n in topology.nodes if page_kib in n.hugepages]
        out.append(NodeCapacity(None, layout.arena_bytes, sum(p.free_bytes for p in pools), 0, page_kib,
                                sum(p.nr for p in pools)))
    else:
        host = topology.mem_available_bytes or sum(n.mem_available_bytes for n in topology.nodes)
        out.append(NodeCapacity(None, layout.arena_bytes, host))
    return out


def check_capacity(layout: Layout, topology: Topology, config: Settings) -> list[str]:
    """One sentence per node (and for the whole host) that cannot hold its share of ``layout``,
    with needed vs available numbers; [] when everything fits (:func:`node_capacity`)."""
    return [c.sentence() for c in node_capacity(layout, topology, config) if not c.ok]


def kv_budget(layout: Layout, topology: Topology, config: Settings) -> tuple[int, str] | None:
    """engine.kv_cache_gib = "auto": (bytes, the sentence that derives them) for the KV cache's
    node (engine.kv_node, -1: the plan's first node): its available memory (MemFree +
    reclaimable, as :func:`node_capacity` counts it) less numa.node_reserve_gib, less the
    weights' share of the node (none with hugetlb pages: those are not in MemAvailable), less
    serve.prefix_cache_gib (host memory, counted on this node; at most half of what the weights
    leave, since it grows on demand while the KV cache is allocated at start), never below 0. None when
    engine.kv_cache_gib is a number. The precedents: llama.cpp's ``--fit`` sizes the context
    from free device memory less a margin, vLLM's ``gpu_memory_utilization`` gives its KV
    cache what the weights leave of a fraction of the device."""
    if config.engine.kv_cache_gib != "auto":
        return None
    node = config.engine.kv_node if config.engine.kv_node >= 0 else layout.nodes[0]
    reserve = int(config.numa.node_reserve_gib * GiB)
    prefix = int(config.serve.prefix_cache_gib * GiB)
    cap = next((c for c in node_capacity(layout, topology, config) if c.node == node), None)
    try:
        info = topology.node(node)
    except NumaError:
        return 0, f"node {node} is not in this host's topology"
    if cap is not None and not cap.page_kib:
        avail, weights = cap.available_bytes, cap.needed_bytes  # available: already less the reserve
    else:  # hugetlb weights (or no weights on the node): the KV cache takes ordinary pages
        avail, weights = max(info.mem_available_bytes - reserve, 0), 0
    left = max(avail - weights, 0)
    # The prefix cache grows on demand up to its budget while the KV cache is allocated at start:
    # where both do not fit, the prefix cache's budget counts for at most half of what is left,
    # so a small host still starts (with its default 2 GiB prefix cache) and says so.
    counted = min(prefix, left // 2)
    budget = left - counted
    words = (f"node {node} has {(avail + reserve) / GiB:.2f} GiB available, less {weights / GiB:.2f} GiB of weights, "
             f"{reserve / GiB:.2f} GiB numa.node_reserve_gib and {counted / GiB:.2f} GiB serve.prefix_cache_gib")
    if counted < prefix:
        words += (f" (of its {prefix / GiB:.2f} GiB: counted up to half of what the weights leave, since the "
                  "prefix cache grows on demand and the KV cache is allocated at start)")
    return budget, words


def kv_capacity(catalog, layout: Layout, topology: Topology, config: Settings) -> dict:
    """The KV cache's plan (moe_service.engine.kv.plan_for_config) and whether it fits: its
    budget (engine.kv_cache_gib, or :func:`kv_budget` for ``auto``) and, beside the weights' share, the free memory of the node
    it is bound to (engine.kv_node, -1: the plan's first node). Returns the KVPlan's dict plus
    ``node``, ``node_need_bytes`` (weights + KV), ``node_available_bytes``, ``fits`` and
    ``reasons`` (sentences naming the numbers)."""
    from moe_service.engine import arch
    from moe_service.engine.kv import plan_for_config

    kvp = plan_for_config(catalog, config, *arch.kv_needs(catalog), auto_budget=kv_budget(layout, topology, config))
    node = kvp.node if kvp.node is not None else layout.nodes[0]
    out = kvp.to_dict()
    out["node"] = node
    out["sentence"] = kvp.sentence()
    reasons = [] if kvp.ok else [kvp.sentence()]
    cap = next((c for c in node_capacity(layout, topology, config) if c.node == node), None)
    need = kvp.total_bytes + (0 if cap is None or cap.page_kib else cap.needed_bytes)
    avail = None
    if cap is not None:  # with hugetlb weights, the KV cache (ordinary pages) competes with nothing planned
        avail = cap.available_bytes if not cap.page_kib else None
    if cap is not None and avail is not None and need > avail:
        reasons.append(f"node {node} cannot hold the KV cache beside its weights: weights {cap.needed_bytes / GiB:.2f} "
                       f"GiB + KV {kvp.total_bytes / GiB:.2f} GiB = {need / GiB:.2f} GiB > {avail / GiB:.2f} GiB "
                       f"available (lower engine.kv_cache_gib, model.context_tokens or serve.parallel, or use "
                       f"engine.kv_type = q8_0)")
    out.update(node_need_bytes=need, node_available_bytes=avail, fits=not reasons, reasons=reasons)
    return out


def prefix_disk_capacity(config: Settings) -> dict | None:
    """The prefix cache's disk store (serve.prefix_cache_dir, engine/prefix_store.py) and
    whether its file system can hold serve.prefix_cache_disk_gib: the blocks already stored
    there count as room (the store reuses it). None when the store is off (no directory, or
    serve.prefix_cache_gib = 0). Returns dir, budget_bytes, stored_bytes, free_bytes (of the
    nearest existing folder's file system), fits, reasons and a sentence."""
    from moe_service.engine.prefix_store import dir_bytes, resolve_store_dir

    serve = config.serve
    root = resolve_store_dir(serve.prefix_cache_dir)
    if root is None or serve.prefix_cache_gib <= 0:
        return None
    budget = int(serve.prefix_cache_disk_gib * GiB)
    stored = dir_bytes(root)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    reasons = []
    if free is not None and budget > free + stored:
        reasons.append(f"serve.prefix_cache_disk_gib = {serve.prefix_cache_disk_gib:g} GiB does not fit in {root}: "
                       f"its file system has {free / GiB:.2f} GiB free + {stored / GiB:.2f} GiB already stored = "
                       f"{(free + stored) / GiB:.2f} GiB (lower serve.prefix_cache_disk_gib or free space there)")
    sentence = (f"prefix cache on disk: {root}, up to {budget / GiB:.2f} GiB (serve.prefix_cache_disk_gib), "
                f"{stored / GiB:.2f} GiB stored now, "
                + (f"{free / GiB:.2f} GiB free on its file system" if free is not None else "free space unknown"))
    return {"dir": str(root), "budget_bytes": budget, "stored_bytes": stored, "free_bytes": free,
            "fits": not reasons, "reasons": reasons, "sentence": sentence}


# --- summary -------------------------------------------------------------------------------


def plan_summary(layout: Layout, topology: Topology, config: Settings) -> dict:
    """JSON-able description of a plan for ``moe-service plan --json`` (node ids as strings).

    Keys: policy, replicas, nodes, arena_bytes, bytes_per_node (used bytes, interleave split
    evenly), need_bytes_per_node (with region padding), available_bytes_per_node (what
    :func:`node_capacity` counts: free memory less the reserve, or free hugetlb pages),
    experts_per_node (expert copies per MoE layer on each node), primary_experts_per_node,
    regions (name, role, policy, nodes, arena_offset, nbytes, used_bytes), fits, reasons
    (why it does not fit), warnings.
    """
    n_layers = max(len({k[0] for k in layout.experts}), 1)
    copies: dict[int, int] = {n: 0 for n in layout.nodes}
    primary: dict[int, int] = {n: 0 for n in layout.nodes}
    for p in layout.experts.values():
        nodes = p.nodes
        for n in layout.nodes:
            copies[n] += int(np.count_nonzero(nodes == n))
            primary[n] += int(np.count_nonzero(nodes[:, 0] == n))
    n_kinds = max(len(layout.experts) // n_layers, 1)
    capacity = node_capacity(layout, topology, config)
    reasons = [c.sentence() for c in capacity if not c.ok]
    avail = {str(c.node): c.available_bytes for c in capacity if c.node is not None}
    return {
        "policy": layout.policy,
        "pages": config.fastload.pages,
        "align_bytes": layout.align_bytes,
        "replicas": layout.replicas,
        "nodes": list(layout.nodes),
        "arena_bytes": layout.arena_bytes,
        "bytes_per_node": {str(k): v for k, v in layout.bytes_per_node().items()},
        "need_bytes_per_node": {str(k): v for k, v in node_need_bytes(layout).items()},
        "available_bytes_per_node": avail,
        "experts_per_node": {str(n): copies[n] // (n_layers * n_kinds) for n in layout.nodes},
        "primary_experts_per_node": {str(n): primary[n] // (n_layers * n_kinds) for n in layout.nodes},
        "moe_layers": len({k[0] for k in layout.experts}),
        "regions": [
            {"name": r.name, "role": r.role, "policy": r.policy, "nodes": list(r.nodes),
             "arena_offset": r.arena_offset, "nbytes": r.nbytes, "used_bytes": r.used_bytes}
            for r in layout.regions
        ],
        "fits": not reasons,
        "reasons": reasons,
        "warnings": list(layout.warnings),
    }


def format_plan(summary: dict, regions: bool = True) -> str:
    """Human table of a :func:`plan_summary` for ``moe-service plan`` (``regions``: list them)."""
    g = GiB
    lines = [
        f"policy {summary['policy']}, replicas {summary['replicas']}, pages {summary['pages']}, "
        f"arena {summary['arena_bytes'] / g:.2f} GiB, {summary.get('moe_layers', 0)} MoE layers",
        "",
        f"{'node':>4}  {'planned GiB':>11}  {'needs GiB':>9}  {'avail GiB':>9}  {'experts/layer':>13}  {'primary':>7}",
    ]
    for n in summary["nodes"]:
        k = str(n)
        lines.append(
            f"{n:>4}  {summary['bytes_per_node'].get(k, 0) / g:>11.2f}  "
            f"{summary['need_bytes_per_node'].get(k, 0) / g:>9.2f}  "
            f"{summary['available_bytes_per_node'].get(k, 0) / g:>9.2f}  "
            f"{summary['experts_per_node'].get(k, 0):>13}  {summary['primary_experts_per_node'].get(k, 0):>7}"
        )
    if regions:
        lines += ["", "regions:"]
        for r in summary["regions"]:
            lines.append(f"  {r['name']:<18} {r['role']:<8} {r['policy']:<10} nodes {r['nodes']!s:<14} "
                         f"{r['used_bytes'] / g:>8.2f} GiB at +{r['arena_offset'] / g:.2f} GiB")
    lines.append("")
    lines.append("fits: yes" if summary["fits"] else "fits: NO")
    lines += [f"  - {r}" for r in summary["reasons"]]
    lines += [f"warning: {w}" for w in summary["warnings"]]
    return "\n".join(lines)
