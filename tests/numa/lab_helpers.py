"""What the lab tests share: the service config they plan with, and independent residency
checks (move_pages in query mode on sampled pages of every expert slab copy)."""

from __future__ import annotations

import numpy as np

from moe_service import memory, numa
from moe_service.config import Settings, load_config
from moe_service.layout import Layout

SLAB_STEP_BYTES = 64 * 1024  # pages sampled inside each expert slab (plus its last page)


NO_GPU_TABLES = {"pin": {"mode": "off"}, "engine": {"device": "cpu"}}
"""The VM has no GPU: saying so keeps preflight from importing torch (a minute, emulated)."""


def lab_config(policy: str = "expert_shard", *, replicas: int = 0, pages: str = "thp", **tables) -> Settings:
    """Settings through the real loader: numa.policy, replication.replicas, fastload.pages, a
    0.1 GiB node reserve (the VM's nodes have 1.5 GiB each), no GPU, and any other ``tables``."""
    return load_config(data={"numa": {"policy": policy, "node_reserve_gib": 0.1},
                             "replication": {"replicas": replicas}, "fastload": {"pages": pages},
                             **NO_GPU_TABLES, **tables})


def slab_residency(arena: np.ndarray, layout: Layout, columns: slice) -> tuple[int, list[str]]:
    """Query the node of sampled pages of every expert slab copy in ``columns`` of each
    ExpertPlacement; returns (pages checked, one line per slab copy off its planned node)."""
    base = memory.address_of(arena)
    bad, checked = [], 0
    for (layer, kind), p in sorted(layout.experts.items()):
        rel = np.append(np.arange(0, p.slab_bytes, SLAB_STEP_BYTES, dtype=np.uint64), np.uint64(p.slab_bytes - 1))
        offs = p.offsets[:, columns]
        want = p.nodes[:, columns]
        e_idx, c_idx = np.nonzero(offs >= 0)
        addrs = (base + offs[e_idx, c_idx].astype(np.uint64)[:, None] + rel[None, :]).ravel()
        status = numa.move_pages(addrs).reshape(len(e_idx), len(rel))
        checked += status.size
        for i in np.nonzero((status != want[e_idx, c_idx][:, None]).any(axis=1))[0]:
            found = {int(n): int(c) for n, c in zip(*np.unique(status[i], return_counts=True), strict=True)}
            bad.append(f"layer {layer} {kind} expert {e_idx[i]} copy {c_idx[i]}: planned node "
                       f"{want[e_idx[i], c_idx[i]]}, pages found {found}")
    return checked, bad


def file_bytes(catalog, offset: int, nbytes: int, shard: int = 0) -> np.ndarray:
    """``nbytes`` of shard ``shard`` at ``offset``, read with plain file I/O (uint8 [nbytes])."""
    with open(catalog.shards[shard].path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(nbytes), dtype=np.uint8)
