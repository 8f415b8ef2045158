"""The CPU kernel backend the Model calls: quantized matmuls and embedding rows read in place
from the arena, and the fused MoE step, over one persistent worker pool pinned once per core
and grouped by NUMA node."""

from __future__ import annotations

import numpy as np

from moe_service.engine import quant
from moe_service.engine.moe import MoE
from moe_service.engine.pool import WorkerPool
from moe_service.log import get_logger

log = get_logger(__name__)


class CpuOps:
    """Kernels over the placed arena.

    ``topology``: moe_service.numa.Topology (workers are grouped by its nodes' usable CPUs;
    None: read from sysfs by the pool); ``threads``: worker count including the calling thread
    (0: every usable CPU); ``fused_moe``: the fused MoE step (False: the single-threaded
    per-expert reference path, the kill switch ``engine.fused_moe = false``).
    """

    def __init__(self, topology=None, threads: int = 0, fused_moe: bool = True):
        nodes = None
        if topology is not None:
            nodes = {n.node: list(n.cpus) for n in topology.nodes if n.cpus}
        self.pool = WorkerPool(nodes, n_threads=threads or None)
        self.moe_step = MoE(self.pool)
        self.fused_moe = fused_moe
        log.info(
            "engine_workers",
            workers=self.pool.n_workers,
            nodes=len(self.pool.node_ids),
            cpus=[cpu for cpu, _ in self.pool.slots],
            fused_moe=fused_moe,
        )

    def matmul(self, arena: np.ndarray, mats, x: np.ndarray) -> list[np.ndarray]:
        """x float32 [T, n_cols] times each weight's transpose: float32 [T, n_rows] per weight,
        all weights in one dispatch (e.g. q, k and v)."""
        return self.pool.matmul(arena, mats, x)

    def get_rows(self, arena: np.ndarray, mat, ids: np.ndarray) -> np.ndarray:
        """Embedding lookup: float32 [len(ids), n_cols], row ids[i] of ``mat`` dequantized
        (raises ValueError naming the tensor for an id outside [0, n_rows))."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= mat.n_rows):
            raise ValueError(f"{mat.name}: token id out of range [0, {mat.n_rows}) (got {ids.min()}..{ids.max()})")
        out = np.empty(ids.size * mat.n_cols, dtype=np.float32)
        quant.dequantize_rows(arena, mat.offset, mat.ggml_type, mat.n_cols, quant.row_bytes(mat.ggml_type, mat.n_cols), ids, out)
        return out.reshape(ids.size, mat.n_cols)

    def moe(self, arena: np.ndarray, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts) -> np.ndarray:
        """The routed experts of one layer: float32 [T, H] (see moe_service.engine.moe.MoE.forward)."""
        return self.moe_step.forward(arena, x, ids, weights, experts, fused=self.fused_moe)

    def close(self) -> None:
        """Stop and join the worker threads."""
        self.pool.close()
