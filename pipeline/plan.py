"""The placement plan: where every tensor and every expert slab lives, before anything is allocated.

``plan(catalog, topology, numa_cfg, replication_cfg, gpu_node)`` is pure: it reads the GGUF
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

Capacity: :func:`check_capacity` compares the bytes each node must hold with what it has
(nodeN/meminfo MemFree + reclaimable, less ``numa.node_reserve_gib``); ``plan(strict=True)``
raises :class:`~moe_service.errors.CapacityError` naming the node and both numbers.
:func:`plan_summary` / :func:`format_plan` give ``moe-service plan`` its JSON and its table.

Config read (attributes of ``numa_cfg`` / ``replication_cfg``; pydantic models or any object):
``numa.policy`` (str, default "expert_shard"), ``numa.expert_homes`` (str, default
"contiguous"), ``numa.nodes`` (list[int], default [] = every
memory node with CPUs this process may use), ``numa.node_reserve_gib`` (float, default 1.0),
``replication.replicas`` (int, default 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from moe_service.errors import CapacityError, ConfigError
from moe_service.layout import (
    REGION_ALIGN_BYTES,
    SLAB_ALIGN_BYTES,
    CopyExtent,
    ExpertPlacement,
    Extent,
    Layout,
    Region,
    align_up,
)
from moe_service.numa import Topology

POLICIES = ("expert_shard", "interleave", "mirror", "local")
GIB = 1024**3
DEFAULT_NODE_RESERVE_GIB = 1.0


def _cfg(obj, name: str, default):
    value = getattr(obj, name, default) if obj is not None else default
    return default if value is None else value


def _sections(numa_cfg, replication_cfg=None):
    """Accept either the ``numa``/``replication`` sections or the whole Settings object
    (anything with a ``numa`` attribute) as ``numa_cfg``."""
    if numa_cfg is not None and hasattr(numa_cfg, "numa"):
        settings = numa_cfg
        return settings.numa, replication_cfg if replication_cfg is not None else getattr(settings, "replication", None)
    return numa_cfg, replication_cfg


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

    def __init__(self, name: str, role: str, policy: str, nodes: tuple[int, ...]):
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

    def finish(self, arena_offset: int) -> Region:
        self.region.used_bytes = self.off
        self.region.nbytes = align_up(max(self.off, 1), REGION_ALIGN_BYTES)
        self.region.arena_offset = arena_offset
        return self.region


@dataclass
class _Slots:
    """Region-relative placement of each copy, resolved to arena offsets once regions are laid out."""

    tensors: dict[str, list[tuple[_RegionBuilder, int]]] = field(default_factory=dict)
    experts: dict[tuple[int, str], list[list[tuple[_RegionBuilder, int, int]]]] = field(default_factory=dict)


def select_nodes(topology: Topology, numa_cfg) -> tuple[int, ...]:
    """Nodes the plan uses: ``numa.nodes`` when set (each must be a memory node), else every
    memory node with at least one allowed CPU (all memory nodes if none has CPUs)."""
    want = list(_cfg(numa_cfg, "nodes", []) or [])
    ids = topology.node_ids
    if want:
        bad = [n for n in want if n not in ids]
        if bad:
            raise ConfigError(f"numa.nodes: {bad} are not memory nodes this process may use "
                              f"(available: {list(ids)})")
        return tuple(sorted(set(want)))
    with_cpus = tuple(n.node for n in topology.nodes if n.cpus)
    return with_cpus or ids


def plan(catalog, topology: Topology, numa_cfg=None, replication_cfg=None, gpu_node: int | None = None,
         *, strict: bool = True) -> Layout:
    """Compute the :class:`Layout` of ``catalog`` on ``topology`` (allocates nothing).

    ``catalog``: a GGUFModel (or any object with ``tensors`` {name: TensorInfo with shard,
    file_offset, nbytes} and ``expert_layers`` {layer: {kind: ExpertTensor with tensor,
    n_expert, slab_bytes, slab(e)}}). ``gpu_node``: when a GPU runs the dense part, its NUMA
    node: dense tensors are bound there instead of interleaved. ``strict``: raise
    CapacityError when a node cannot hold its share (else the caller reads
    :func:`check_capacity`). Raises ConfigError for an unknown policy, bad node list or too
    many replicas. ``numa_cfg`` may also be the whole Settings (then ``replication_cfg`` defaults
    to its ``replication`` section).
    """
    numa_cfg, replication_cfg = _sections(numa_cfg, replication_cfg)
    policy = str(_cfg(numa_cfg, "policy", "expert_shard"))
    if policy not in POLICIES:
        raise ConfigError(f"numa.policy: unknown policy {policy!r} (choose one of {', '.join(POLICIES)})")
    replicas = int(_cfg(replication_cfg, "replicas", 0))
    nodes = select_nodes(topology, numa_cfg)
    if replicas < 0 or replicas > max(len(nodes) - 1, 0):
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
        layout = _plan_single(catalog, nodes[0], policy)
    elif policy == "local":
        layout = _plan_single(catalog, None, policy)
        layout.nodes = nodes
    elif policy == "interleave":
        layout = _plan_interleave(catalog, nodes)
    elif policy == "mirror":
        layout = _plan_mirror(catalog, nodes)
    else:
        homes_rule = str(_cfg(numa_cfg, "expert_homes", "contiguous"))
        home_members(1, 1, homes_rule)  # validates the rule name
        layout = _plan_expert_shard(catalog, topology, nodes, replicas, gpu_node, homes_rule)
    if replicas and layout.replicas != replicas:
        warnings.append(f"replication.replicas={replicas} ignored: policy {policy!r} on {len(nodes)} node(s) "
                        "has no per-node expert homes to replicate")
    layout.warnings.extend(warnings)
    if strict:
        problems = check_capacity(layout, topology, numa_cfg)
        if problems:
            raise CapacityError(f"the {policy!r} plan does not fit this host: " + "; ".join(problems))
    return layout


def _expert_names(catalog) -> set[str]:
    return {et.tensor.name for kinds in catalog.expert_layers.values() for et in kinds.values()}


def _resolve(layout_regions: list[_RegionBuilder], slots: _Slots, catalog, n_copies_max: int,
             nodes: tuple[int, ...], policy: str, replicas: int) -> Layout:
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
    return Layout(regions, arena, tensors, experts, nodes=nodes, policy=policy, replicas=replicas)


def _lay_out(builders: list[_RegionBuilder], start: int = 0) -> int:
    off = start
    for b in builders:
        b.finish(off)
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


def _plan_single(catalog, node: int | None, policy: str) -> Layout:
    b = _RegionBuilder("all", "primary", "local", ())
    slots = _Slots()
    _whole_tensors(b, catalog, slots, -1 if node is None else node)
    _lay_out([b])
    return _resolve([b], slots, catalog, 1, (node,) if node is not None else (0,), policy, 0)


def _plan_interleave(catalog, nodes: tuple[int, ...]) -> Layout:
    b = _RegionBuilder("all", "primary", "interleave", nodes)
    slots = _Slots()
    _whole_tensors(b, catalog, slots, -1)
    _lay_out([b])
    return _resolve([b], slots, catalog, 1, nodes, "interleave", 0)


def _plan_mirror(catalog, nodes: tuple[int, ...]) -> Layout:
    first = _RegionBuilder(f"mirror.node{nodes[0]}", "primary", "bind", (nodes[0],))
    slots = _Slots()
    _whole_tensors(first, catalog, slots, nodes[0])
    _lay_out([first])
    builders = [first]
    for n in nodes[1:]:
        b = _RegionBuilder(f"mirror.node{n}", "replica", "bind", (n,))
        b.add_copy(first.region.arena_offset, first.region.used_bytes)
        builders.append(b)
    # Each copy region is the first region byte for byte (one CopyExtent), so copy c of
    # anything lives at (its offset in the first region) + region c's start.
    _lay_out(builders[1:], start=first.region.nbytes)
    for name, copies in slots.tensors.items():
        _b0, off = copies[0]
        copies.extend((b, off) for b in builders[1:])
        slots.tensors[name] = copies
    for per in slots.experts.values():
        for copies in per:
            _b0, off, _n = copies[0]
            copies.extend((b, off, b.region.nodes[0]) for b in builders[1:])
    return _resolve(builders, slots, catalog, len(nodes), nodes, "mirror", len(nodes) - 1)


def _plan_expert_shard(catalog, topology: Topology, nodes: tuple[int, ...], replicas: int,
                       gpu_node: int | None, homes_rule: str = "contiguous") -> Layout:
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
    end = _lay_out(primaries)

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
        _lay_out(replica_builders, start=end)
    layout = _resolve(primaries + replica_builders, slots, catalog, 1 + replicas, nodes, "expert_shard", replicas)
    return layout


# --- capacity ------------------------------------------------------------------------------


def node_need_bytes(layout: Layout) -> dict[int, int]:
    """Bytes each node must supply for ``layout``: whole bound regions (2 MiB padding
    included, as fastload populates whole regions) plus an even share of interleaved ones.
    ``local`` regions count against the layout's first node on a one-node plan and are left
    out otherwise (first touch decides)."""
    need = {n: 0 for n in layout.nodes}
    for r in layout.regions:
        if r.policy == "bind":
            need[r.nodes[0]] = need.get(r.nodes[0], 0) + r.nbytes
        elif r.policy == "interleave":
            for n in r.nodes:
                need[n] = need.get(n, 0) + -(-r.nbytes // len(r.nodes))
        elif len(layout.nodes) == 1:
            need[layout.nodes[0]] = need.get(layout.nodes[0], 0) + r.nbytes
    return need


def check_capacity(layout: Layout, topology: Topology, numa_cfg=None) -> list[str]:
    """One sentence per node (and for the whole host) that cannot hold its share of ``layout``,
    with needed vs available bytes; [] when everything fits. Available = the node's MemFree +
    reclaimable (see NodeInfo) less ``numa.node_reserve_gib``."""
    numa_cfg, _ = _sections(numa_cfg)
    reserve = int(float(_cfg(numa_cfg, "node_reserve_gib", DEFAULT_NODE_RESERVE_GIB)) * GIB)
    problems = []
    for node, need in sorted(node_need_bytes(layout).items()):
        try:
            info = topology.node(node)
        except Exception:
            problems.append(f"node {node} is not a memory node of this host")
            continue
        avail = max(info.mem_available_bytes - reserve, 0)
        if need > avail:
            problems.append(
                f"node {node} needs {need / GIB:.1f} GiB ({need} bytes) but has {avail / GIB:.1f} GiB "
                f"({avail} bytes) available after reserving {reserve / GIB:.1f} GiB"
            )
    total = layout.arena_bytes
    host_avail = topology.mem_available_bytes or sum(n.mem_available_bytes for n in topology.nodes)
    if host_avail and total > host_avail:
        problems.append(f"the host needs {total / GIB:.1f} GiB ({total} bytes) in all but MemAvailable is "
                        f"{host_avail / GIB:.1f} GiB ({host_avail} bytes)")
    return problems


# --- summary -------------------------------------------------------------------------------


def plan_summary(layout: Layout, topology: Topology, numa_cfg=None) -> dict:
    """JSON-able description of a plan for ``moe-service plan --json`` (node ids as strings).

    Keys: policy, replicas, nodes, arena_bytes, bytes_per_node (used bytes, interleave split
    evenly), need_bytes_per_node (with region padding), available_bytes_per_node,
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
    reasons = check_capacity(layout, topology, numa_cfg)
    avail = {}
    for n in layout.nodes:
        try:
            avail[str(n)] = topology.node(n).mem_available_bytes
        except Exception:
            avail[str(n)] = 0
    return {
        "policy": layout.policy,
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


def format_plan(summary: dict) -> str:
    """Human table of a :func:`plan_summary` for ``moe-service plan``."""
    g = GIB
    lines = [
        f"policy {summary['policy']}, replicas {summary['replicas']}, "
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
    lines += ["", "regions:"]
    for r in summary["regions"]:
        lines.append(f"  {r['name']:<18} {r['role']:<8} {r['policy']:<10} nodes {r['nodes']!s:<14} "
                     f"{r['used_bytes'] / g:>8.2f} GiB at +{r['arena_offset'] / g:.2f} GiB")
    lines.append("")
    lines.append("fits: yes" if summary["fits"] else "fits: NO")
    lines += [f"  - {r}" for r in summary["reasons"]]
    lines += [f"warning: {w}" for w in summary["warnings"]]
    return "\n".join(lines)
