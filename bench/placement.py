"""Balance simulation (``moe-service bench placement``): how evenly a token's experts spread over nodes.

A decode step waits for the slowest node, and a node's time is about the number of expert
slabs it must read, so the figure of merit is E[max over nodes of the experts that node
computes for one token]. This simulation measures it for:

    homes      contiguous   (expert e on node e*N//E: the planner's expert_shard default)
               round_robin  (expert e on node e % N: numa.expert_homes = "round_robin")
    replicas   k = 0, 1, N-1 extra copies per expert, placed by the planner's own rule
               (pipeline.plan.replica_chunks: farthest nodes first, ties balanced)
    assignment each picked expert goes to the least-loaded node holding a copy, greedily in
               pick order within the token (ties: the primary, then the lower copy column),
               as the engine's scheduler does (:func:`assign_greedy`)

Routing traces::

    synthetic  a group-limited router shaped like DeepSeek-V3: E=256 experts in 8 groups of
               32, keep the top-4 groups (group score = sum of its top-2 expert scores), then
               the top-k (6 or 8) experts of those groups. Scores are sigmoid(logits) with
               logits = group affinity of the token (N(0, 0.5) per token and group, shared by
               the group's experts) + per-token expert noise N(0, 1) + expert popularity
               N(0, 0.3) fixed per expert. These parameters are a modelling choice, not
               measured from a real model: the "uniform" rows (top-k drawn uniformly, no
               groups) bound the other end.
    --trace    a real trace: .npy int array [tokens, k] of expert ids (one layer), e.g.
               recorded from a real model's router.

The embedded demo model is no source of real traces: its router is zero and it uses all 8 of
its 8 experts, so every token picks every expert; the output says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_service.numa import NodeInfo, Topology
from pipeline.plan import home_members, replica_chunks

REFERENCE = {("contiguous", 0): 2.8, ("contiguous", 1): 2.2}
"""Reference E[max experts per node per token] for 4 nodes, top-6 of 256 (from the issue):
2.8 without replicas, 2.2 with one replica per expert."""

SNC4_DISTANCES = [[10, 12, 21, 21], [12, 10, 21, 21], [21, 21, 10, 12], [21, 21, 12, 10]]


# --- routing --------------------------------------------------------------------------------


def group_limited_picks(n_tokens: int, n_expert: int = 256, n_group: int = 8, n_group_used: int = 4,
                        top_k: int = 6, group_sigma: float = 0.5, noise_sigma: float = 1.0,
                        popularity_sigma: float = 0.3, seed: int = 0) -> np.ndarray:
    """Synthetic group-limited routing: int64 [n_tokens, top_k] expert ids, best first.

    Follows llama.cpp's build_moe_ffn group limit: a group's score is the sum of its top-2
    expert scores; the best ``n_group_used`` groups are kept; the top ``top_k`` experts among
    them are picked. See the module docstring for the score model.
    """
    rng = np.random.default_rng(seed)
    per_group = n_expert // n_group
    popularity = rng.normal(0.0, popularity_sigma, n_expert)
    out = np.empty((n_tokens, top_k), dtype=np.int64)
    for lo in range(0, n_tokens, 4096):  # bounded memory
        t = min(4096, n_tokens - lo)
        affinity = rng.normal(0.0, group_sigma, (t, n_group))
        logits = np.repeat(affinity, per_group, axis=1) + rng.normal(0.0, noise_sigma, (t, n_expert)) + popularity
        scores = 1.0 / (1.0 + np.exp(-logits))                                   # [T, E]
        grouped = scores.reshape(t, n_group, per_group)                            # [T, G, E/G]
        group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)              # [T, G]
        keep = np.argsort(-group_score, axis=1)[:, :n_group_used]                  # [T, Gu]
        mask = np.zeros((t, n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        masked = np.where(np.repeat(mask, per_group, axis=1), scores, -np.inf)     # [T, E]
        out[lo:lo + t] = np.argsort(-masked, axis=1)[:, :top_k]
    return out


def uniform_picks(n_tokens: int, n_expert: int = 256, top_k: int = 6, seed: int = 0) -> np.ndarray:
    """top_k distinct experts per token drawn uniformly: int64 [n_tokens, top_k]."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n_tokens, n_expert)), axis=1)[:, :top_k].astype(np.int64)


# --- placement --------------------------------------------------------------------------------


def synthetic_topology(n_nodes: int, distances: list[list[int]] | None = None) -> Topology:
    """A Topology of ``n_nodes`` nodes with one CPU each and the given SLIT matrix (default 10/20)."""
    dist = distances or [[10 if a == b else 20 for b in range(n_nodes)] for a in range(n_nodes)]
    nodes = tuple(NodeInfo(n, (n,), 1 << 40, 1 << 40, 1 << 40) for n in range(n_nodes))
    return Topology(nodes=nodes, distances={a: {b: dist[a][b] for b in range(n_nodes)} for a in range(n_nodes)},
                    mem_total_bytes=n_nodes << 40, mem_available_bytes=n_nodes << 40)


def expert_homes(n_expert: int, n_nodes: int, rule: str) -> np.ndarray:
    """int64 [E]: home node of each expert under the planner's ``contiguous`` or ``round_robin`` rule."""
    homes = np.empty(n_expert, dtype=np.int64)
    for node, members in enumerate(home_members(n_expert, n_nodes, rule)):
        homes[members] = node
    return homes


def copy_nodes(homes: np.ndarray, replicas: int, topology: Topology) -> np.ndarray:
    """int32 [E, 1 + replicas]: the node of every copy of every expert, column 0 the home.

    Replicas follow the planner (pipeline.plan.replica_chunks): a home node's experts, in
    expert order, are split into chunks whose copies go to the farthest nodes, ties balanced.
    """
    n_expert = homes.size
    out = np.full((n_expert, 1 + replicas), -1, dtype=np.int32)
    out[:, 0] = homes
    if replicas == 0:
        return out
    load: dict[int, int] = {}
    for h in topology.node_ids:
        members = np.nonzero(homes == h)[0]
        for lo, hi, targets in replica_chunks(h, topology.node_ids, replicas, topology, 0, members.size, load):
            out[members[lo:hi], 1:] = targets
    return out


def assign_greedy(picks: np.ndarray, copies: np.ndarray, n_nodes: int) -> np.ndarray:
    """Node that computes each picked expert: int32 [T, K].

    ``picks``: int [T, K] expert ids in pick order; ``copies``: int [E, C] node of each copy
    (-1 = none). For each token, slot by slot, the expert goes to the copy whose node has the
    fewest experts of this token so far; ties go to the lowest copy column (the primary first).
    """
    t_idx = np.arange(picks.shape[0])
    load = np.zeros((picks.shape[0], n_nodes), dtype=np.int32)               # [T, N]
    out = np.empty(picks.shape, dtype=np.int32)
    for j in range(picks.shape[1]):
        cand = copies[picks[:, j]]                                            # [T, C]
        cand_load = np.where(cand >= 0, load[t_idx[:, None], np.maximum(cand, 0)], np.iinfo(np.int32).max)
        choice = cand[t_idx, np.argmin(cand_load, axis=1)]                    # [T]
        out[:, j] = choice
        load[t_idx, choice] += 1
    return out


def max_per_node(picks: np.ndarray, copies: np.ndarray, n_nodes: int) -> float:
    """E over tokens of max over nodes of experts computed there (greedy assignment)."""
    nodes = assign_greedy(picks, copies, n_nodes)
    counts = np.zeros((picks.shape[0], n_nodes), dtype=np.int32)
    np.add.at(counts, (np.arange(picks.shape[0])[:, None], nodes), 1)
    return float(counts.max(axis=1).mean())


# --- the benchmark -----------------------------------------------------------------------------


def run_balance(n_tokens: int = 20000, node_counts: tuple[int, ...] = (2, 4), top_ks: tuple[int, ...] = (6, 8),
                n_expert: int = 256, seed: int = 0, trace: np.ndarray | None = None,
                group_sigma: float = 0.5) -> dict:
    """Every (trace, topology, homes, replicas) combination: a JSON-able dict with ``rows``.

    Topologies: each node count with flat distances (10/20), and for 4 nodes also SNC-like
    distances (two sockets of two nodes: 12 inside a socket, 21 across), which change where
    replicas go (farthest first) and so the balance.
    """
    traces: dict[str, np.ndarray] = {}
    for k in top_ks:
        traces[f"group-limited top-{k}/{n_expert}"] = group_limited_picks(
            n_tokens, n_expert, top_k=k, group_sigma=group_sigma, seed=seed)
        traces[f"uniform top-{k}/{n_expert}"] = uniform_picks(n_tokens, n_expert, top_k=k, seed=seed)
    if trace is not None:
        traces[f"trace top-{trace.shape[1]}/{int(trace.max()) + 1}"] = trace
    topologies = [(n, "flat", None) for n in node_counts] + [(4, "snc", SNC4_DISTANCES) for n in node_counts if n == 4]
    rows = []
    for name, picks in traces.items():
        e = max(n_expert, int(picks.max()) + 1)
        for n_nodes, dist_name, dist in topologies:
            topo = synthetic_topology(n_nodes, dist)
            for homes_rule in ("contiguous", "round_robin"):
                homes = expert_homes(e, n_nodes, homes_rule)
                for replicas in sorted({0, 1, n_nodes - 1}):
                    value = max_per_node(picks, copy_nodes(homes, replicas, topo), n_nodes)
                    ref = None
                    if n_nodes == 4 and picks.shape[1] == 6 and e == 256 and not name.startswith("trace"):
                        ref = REFERENCE.get((homes_rule, replicas))
                    rows.append({"trace": name, "nodes": n_nodes, "distances": dist_name, "homes": homes_rule,
                                 "replicas": replicas, "top_k": int(picks.shape[1]),
                                 "e_max_experts_per_node": round(value, 4),
                                 "ideal": -(-picks.shape[1] // n_nodes), "reference": ref})
    return {"tokens": n_tokens, "seed": seed, "group_sigma": group_sigma, "rows": rows,
            "notes": ["snc: SNC-like distances (12 within a socket, 21 across) decide where replicas go",
                      "ideal = ceil(top_k / nodes), what perfect balance gives",
                      "reference: the figures given for 4 nodes, top-6 of 256 (2.8 without replicas, 2.2 with one)",
                      "demo model: not a source of real traces (zero router, all 8 of 8 experts used: "
                      "every token loads every expert); pass --trace FILE.npy for a real router's picks"]}


def format_balance(result: dict) -> str:
    """The table ``moe-service bench placement`` prints."""
    lines = [f"E[max experts per node per token], {result['tokens']} tokens, greedy least-loaded copy",
             "",
             f"{'trace':<28} {'nodes':>5} {'dist':<5} {'homes':<12} {'replicas':>8} {'E[max]':>7} {'ideal':>5} "
             f"{'reference':>9}"]
    for r in result["rows"]:
        ref = f"{r['reference']:.1f}" if r["reference"] is not None else ""
        lines.append(f"{r['trace']:<28} {r['nodes']:>5} {r['distances']:<5} {r['homes']:<12} {r['replicas']:>8} "
                     f"{r['e_max_experts_per_node']:>7.3f} {r['ideal']:>5} {ref:>9}")
    lines.append("")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-service bench placement", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20000, help="tokens simulated per trace (default 20000)")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="node counts (default 2 4)")
    p.add_argument("--top-k", type=int, nargs="+", default=[6, 8], help="experts per token (default 6 8)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-sigma", type=float, default=0.5,
                   help="spread of the per-token group affinity in the synthetic router (default 0.5)")
    p.add_argument("--trace", type=Path, help="a real routing trace: .npy int array [tokens, k] of expert ids")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    a = p.parse_args(argv)
    trace = np.load(a.trace).astype(np.int64) if a.trace else None
    result = run_balance(a.tokens, tuple(a.nodes), tuple(a.top_k), a.experts, a.seed, trace, a.group_sigma)
    print(json.dumps(result, indent=1) if a.json else format_balance(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
