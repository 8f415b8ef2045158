"""Model weights in memory, read in place by the engine.

A :class:`WeightStore` pairs the arena (one uint8 numpy array over the anonymous mapping that
fastload filled, or any buffer for tests) with the :class:`~moe_service.layout.Layout` that
says where each tensor and each expert slab copy lives. Nothing is dequantized: kernels read
the GGUF block bytes at these offsets.
"""

from __future__ import annotations

import os

import numpy as np

from moe_service.layout import Layout, plain_layout
from moe_service.memory import pread_full, reserve_thp_arena


class WeightStore:
    """Tensor and expert-slab lookup over a filled arena.

    ``arena``: uint8 [arena_bytes], placed per ``layout`` (which node each region is on is the
    layout's business; the store only maps names to offsets). ``catalog`` is the GGUFModel the
    layout was planned from (shapes, types).
    """

    def __init__(self, arena: np.ndarray, layout: Layout, catalog):
        if arena.dtype != np.uint8 or arena.ndim != 1:
            raise TypeError(f"arena must be a 1-D uint8 array (got {arena.dtype}, {arena.ndim}-D)")
        if arena.nbytes < layout.arena_bytes:
            raise ValueError(f"arena holds {arena.nbytes} bytes, the layout needs {layout.arena_bytes}")
        self.arena = arena
        self.layout = layout
        self.catalog = catalog

    def tensor_offset(self, name: str, copy: int = 0) -> int:
        """Arena byte offset of copy ``copy`` (0 = primary) of a tensor stored whole.

        Raises KeyError naming the tensor when it is absent or stored only as expert slabs.
        """
        try:
            return self.layout.tensors[name][copy]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not stored whole in this layout") from None

    def tensor(self, name: str, copy: int = 0) -> np.ndarray:
        """uint8 view [nbytes] of a tensor's bytes in the arena (no copy is made)."""
        off = self.tensor_offset(name, copy)
        return self.arena[off : off + self.catalog.tensors[name].nbytes]

    def has_tensor(self, name: str) -> bool:
        return name in self.catalog.tensors

    def expert_copies(self, layer: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets int64 [E, C], nodes int32 [E, C]) of every copy of every expert slab of the
        ``kind`` ('gate', 'up', 'down' or 'gate_up') expert tensor of ``layer``; -1 = no copy."""
        p = self.layout.experts[(layer, kind)]
        return p.offsets, p.nodes

    @classmethod
    def load_simple(cls, catalog) -> WeightStore:
        """Read every tensor of ``catalog`` into one plain numpy buffer (:func:`plain_layout`).

        No NUMA policy, no parallelism: for tests, tools and small models. The service loads
        through the fastload stage instead. Raises ModelFileError naming the shard file and the
        offset when it ends early (:func:`moe_service.memory.pread_full`, fastload's read loop).
        """
        layout = plain_layout(catalog)
        arena = reserve_thp_arena(layout.arena_bytes)  # huge pages, as fastload's arena
        view = memoryview(arena)
        fds: dict[int, int] = {}
        try:
            for ext in layout.regions[0].extents:
                path = catalog.shards[ext.shard].path
                if ext.shard not in fds:
                    fds[ext.shard] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                pread_full(fds[ext.shard], view[ext.region_offset : ext.region_offset + ext.nbytes],
                           ext.file_offset, path=path)
        finally:
            view.release()
            for fd in fds.values():
                os.close(fd)
        return cls(arena, layout, catalog)
