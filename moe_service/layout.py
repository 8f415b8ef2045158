"""Where every byte of the model lives in memory: the arena, its regions, each tensor's copies.

The plan (pipeline/plan.py) computes a :class:`Layout` from the GGUF catalog, the NUMA
topology and the config. Every later step reads the same object:

- fastload reserves the whole ``arena_bytes`` as one anonymous mapping, binds each region to
  its node(s) with mbind *before* first touch, then populates and fills the primary regions'
  :class:`Extent` s from the model files;
- placement verifies each region's pages sit on its planned node(s);
- replication fills the replica regions from the primaries (:class:`CopyExtent`);
- pin registers regions with cudaHostRegister;
- the engine reads tensors in place through ``moe_service.weights.WeightStore``.

::

    arena: one virtual range, reserved whole, each region aligned to align_bytes (2 MiB; 1 GiB
           with fastload.pages = 1g)
    | node0 experts | node1 experts | ... | dense (interleave) | replicas node1 | replicas node0 |
      bind {0}        bind {1}              interleave {0..n}   bind {1}         bind {0}

Grouping regions by node keeps the kernel's VMA count at about one per region whatever the
number of layers, and 2 MiB alignment lets every region be backed by transparent huge pages
that lie wholly on its node. hugetlb pages (fastload.pages = 2m / 1g) need more: mbind splits
a hugetlb mapping only at page boundaries, so regions are aligned to the hugetlb page size
(:func:`region_align_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from moe_service.sizes import GiB, MiB

REGION_ALIGN_BYTES = 2 * MiB
"""Regions start and end on 2 MiB boundaries (one x86-64 transparent huge page) at least."""

HUGETLB_PAGE_BYTES = {"2m": 2 * MiB, "1g": GiB}
"""fastload.pages values that take hugetlb pages, and their page size in bytes."""

SLAB_ALIGN_BYTES = 64
"""Tensors and expert slabs start on a cache line inside their region."""

PAGE_BYTES = 4096

DIO_MIN_ALIGN_BYTES = 32
"""Extents whose file offset is a multiple of this (GGUF's default alignment) are placed
congruent to it modulo 4 KiB (:func:`dio_offset`)."""


def align_up(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment`` (a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)


def dio_offset(offset: int, file_offset: int) -> int:
    """Where a file extent starting at ``file_offset`` goes in a region, at or after ``offset``:
    the first offset with the same remainder modulo :data:`PAGE_BYTES` as ``file_offset``,
    so that fastload's O_DIRECT reads (address and file offset on 4 KiB boundaries together)
    land straight in the arena instead of going through a bounce buffer; regions start on
    2 MiB boundaries, so a region offset keeps its remainder in the arena. Costs less than
    4 KiB of padding per extent, and nothing between extents that follow each other in the
    file (their spacing is the file's). The extent then starts on a cache line
    (:data:`SLAB_ALIGN_BYTES`) when its file offset does, else on the file's own 32-byte
    boundary (GGUF's default general.alignment: where llama.cpp computes on it through mmap).
    A ``file_offset`` not 32-byte aligned gets ``align_up(offset, 64)`` (bounce buffer).
    Used by :func:`plain_layout`; the NUMA plan (pipeline/plan.py) keeps every slab on a
    cache line and its direct reads go through the bounce buffer (one memcpy per byte, what
    a buffered read costs too), because the padding could add a page to a region sized
    to whole hugetlb pages."""
    if file_offset % DIO_MIN_ALIGN_BYTES:
        return align_up(offset, SLAB_ALIGN_BYTES)
    return offset + (file_offset - offset) % PAGE_BYTES


def region_align_bytes(pages: str) -> int:
    """Region alignment for fastload.pages ``pages`` ('thp', '4k', '2m', '1g'): the hugetlb page
    size for '2m' / '1g', else :data:`REGION_ALIGN_BYTES`."""
    return max(REGION_ALIGN_BYTES, HUGETLB_PAGE_BYTES.get(pages, 0))


@dataclass(frozen=True)
class Extent:
    """Bytes of one model file copied into a region by fastload.

    ``[file_offset, file_offset + nbytes)`` of shard ``shard`` lands at
    ``[region_offset, region_offset + nbytes)`` of its region (offsets relative to the region).
    """

    shard: int
    file_offset: int
    nbytes: int
    region_offset: int


@dataclass(frozen=True)
class CopyExtent:
    """Bytes copied arena to arena by replication: ``nbytes`` from ``src_arena_offset``
    (inside a primary region) to ``region_offset`` of the replica region."""

    src_arena_offset: int
    nbytes: int
    region_offset: int


RegionPolicy = Literal["bind", "interleave", "local"]
RegionRole = Literal["primary", "replica"]


@dataclass
class Region:
    """A slice of the arena with one memory policy, aligned to the layout's ``align_bytes``.

    ``policy``: ``bind`` (all pages on ``nodes[0]``), ``interleave`` (pages round-robin over
    ``nodes``) or ``local`` (no policy: first touch decides; used on one-node hosts and by the
    ``local`` plan policy). ``used_bytes`` <= ``nbytes``; the tail is padding.
    """

    name: str
    role: RegionRole
    policy: RegionPolicy
    nodes: tuple[int, ...]
    arena_offset: int
    nbytes: int
    used_bytes: int = 0
    extents: list[Extent] = field(default_factory=list)
    copies: list[CopyExtent] = field(default_factory=list)

    @property
    def home_node(self) -> int | None:
        """The single node a ``bind`` region lives on; None for interleave/local regions."""
        return self.nodes[0] if self.policy == "bind" and len(self.nodes) == 1 else None


@dataclass
class ExpertPlacement:
    """Copies of every expert slab of one (layer, kind) expert tensor.

    ``offsets``: int64 [E, C] arena byte offset of copy c of expert e (-1: no copy c);
    ``nodes``: int32 [E, C] the node holding that copy (-1 for interleaved/local memory or no
    copy). Column 0 is the primary copy; columns 1.. are replicas, nearest-first is not implied.
    """

    layer: int
    kind: str
    slab_bytes: int
    offsets: np.ndarray
    nodes: np.ndarray

    @property
    def n_expert(self) -> int:
        return int(self.offsets.shape[0])


@dataclass
class Layout:
    """The whole memory layout of a loaded model (see module docstring).

    ``tensors``: name -> arena offsets of that tensor's copies (index 0 the primary) for every
    tensor stored whole (dense tensors, norms, embeddings; in ``mirror`` mode one per node).
    ``experts``: (layer, kind) -> :class:`ExpertPlacement` for every expert tensor, whose slabs
    may be spread over several regions. ``warnings`` are recorded by the planner (e.g.
    numa_balancing=1) and logged by the pipeline. ``align_bytes``: every region's offset and
    size are multiples of it (:func:`region_align_bytes` of the pages the plan was made for).
    """

    regions: list[Region]
    arena_bytes: int
    tensors: dict[str, list[int]]
    experts: dict[tuple[int, str], ExpertPlacement]
    nodes: tuple[int, ...] = (0,)
    policy: str = "local"
    replicas: int = 0
    warnings: list[str] = field(default_factory=list)
    align_bytes: int = REGION_ALIGN_BYTES

    def bytes_per_node(self) -> dict[int, int]:
        """Used bytes each node will hold (interleaved regions split evenly), for reports."""
        out = {n: 0 for n in self.nodes}
        for r in self.regions:
            if r.policy == "bind":
                out[r.nodes[0]] = out.get(r.nodes[0], 0) + r.used_bytes
            else:
                spread = r.nodes or self.nodes
                for n in spread:
                    out[n] = out.get(n, 0) + r.used_bytes // len(spread)
        return out

    def primary_regions(self) -> list[Region]:
        return [r for r in self.regions if r.role == "primary"]

    def replica_regions(self) -> list[Region]:
        return [r for r in self.regions if r.role == "replica"]


def plain_layout(catalog, align_bytes: int = REGION_ALIGN_BYTES) -> Layout:
    """The simplest layout: one ``local`` region holding every tensor once, in file order,
    each at its file offset's remainder modulo 4 KiB (:func:`dio_offset`: direct I/O lands in
    place; tensors that follow each other in the file keep the file's spacing).

    Used on hosts where placement does not matter (tests, tools, one-node hosts with the
    ``local`` policy). Expert tensors are stored whole, so each slab e sits at the tensor's
    offset + e * slab_bytes. ``catalog`` is a ``moe_service.gguf_model.GGUFModel``; the region
    is padded to ``align_bytes``.
    """
    region = Region(name="all", role="primary", policy="local", nodes=(), arena_offset=0, nbytes=0)
    tensors: dict[str, list[int]] = {}
    off = 0
    for t in catalog.tensors.values():
        off = dio_offset(off, t.file_offset)
        region.extents.append(Extent(t.shard, t.file_offset, t.nbytes, off))
        tensors[t.name] = [off]
        off += t.nbytes
    region.used_bytes = off
    region.nbytes = align_up(max(off, 1), align_bytes)
    experts: dict[tuple[int, str], ExpertPlacement] = {}
    for layer, kinds in catalog.expert_layers.items():
        for kind, et in kinds.items():
            base = tensors[et.tensor.name][0]
            offs = (base + np.arange(et.n_expert, dtype=np.int64) * et.slab_bytes).reshape(-1, 1)
            experts[(layer, kind)] = ExpertPlacement(
                layer, kind, et.slab_bytes, offs, np.full_like(offs, -1, dtype=np.int32)
            )
    return Layout([region], region.nbytes, tensors, experts, nodes=(0,), policy="local", align_bytes=align_bytes)
