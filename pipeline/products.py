"""The products the stages hand on through the context (``ctx.pins``, ``ctx.residency``):
:class:`PinnedRegions` (what the pin stage registered, and how to release it) and
:class:`ResidencyReport` (what placement and replication found on each node).

A module below both the context (:mod:`pipeline.context`, which names them) and the stages
that make them (:mod:`pipeline.pin`, :mod:`pipeline.placement`), so that the context imports
no stage and no stage is imported for its types. Also here: the small CUDA runtime interface
that :class:`PinnedRegions` releases through (:class:`CudaRuntime`; the real one,
``pipeline.pin.TorchCudart``, stays with the stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from moe_service.log import get_logger

log = get_logger("pipeline.pin")

CUDA_SUCCESS = 0


# ---------------------------------------------------------------------------------------------
# The CUDA runtime, behind a small interface


class CudaRuntime(Protocol):
    """The CUDA runtime calls the pin stage makes, with C semantics: each returns the
    cudaError_t as an int (0 = cudaSuccess); value-returning calls return (error, value)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int: ...
    def cudaHostUnregister(self, ptr: int) -> int: ...
    def cudaGetLastError(self) -> int: ...
    def cudaGetErrorName(self, error: int) -> str: ...
    def cudaGetErrorString(self, error: int) -> str: ...
    def cudaDeviceGetAttribute(self, attr: int, device: int) -> tuple[int, int]: ...
    def cudaGetDevice(self) -> tuple[int, int]: ...


def cuda_error_text(rt: CudaRuntime, err: int) -> str:
    """``cudaErrorHostMemoryAlreadyRegistered (712): part of the range is already registered``."""
    try:
        return f"{rt.cudaGetErrorName(err)} ({err}): {rt.cudaGetErrorString(err)}"
    except Exception:
        return f"CUDA error {err}"


def clear_cuda_error(rt: CudaRuntime) -> None:
    """Reset the runtime's last error after a failed call we handled (it is per host thread)."""
    try:
        rt.cudaGetLastError()
    except Exception as e:  # clearing must never hide the original failure
        log.warning("pin_clear_error_failed", stage="pin", error=str(e))


# ---------------------------------------------------------------------------------------------
# The pin stage's product


@dataclass(frozen=True)
class PinChunk:
    """One cudaHostRegister call: ``nbytes`` at ``arena_offset`` (page aligned), which is
    ``region_offset`` bytes into region ``region``."""

    region: str
    role: str
    arena_offset: int
    region_offset: int
    nbytes: int


@dataclass
class PinnedRegions:
    """What the pin stage registered (``ctx.pins``): base address, flags and the chunks in
    registration order. :meth:`unpin` unregisters them in reverse order."""

    rt: CudaRuntime
    base_address: int
    flags: int
    chunks: list[PinChunk] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def covers(self, arena_offset: int, nbytes: int) -> bool:
        """Whether ``[arena_offset, arena_offset + nbytes)`` lies inside registered chunks."""
        end = arena_offset + nbytes
        for c in self.chunks:
            if c.arena_offset <= arena_offset < c.arena_offset + c.nbytes:
                if end <= c.arena_offset + c.nbytes:
                    return True
                arena_offset = c.arena_offset + c.nbytes
        return False

    def unpin(self) -> int:
        """cudaHostUnregister every chunk, last first. Failures are logged (and the CUDA error
        cleared), never raised: the others are still released. Returns the failures."""
        failures = 0
        while self.chunks:
            c = self.chunks.pop()
            err = self.rt.cudaHostUnregister(self.base_address + c.arena_offset)
            if err != CUDA_SUCCESS:
                failures += 1
                log.error("pin_unregister_failed", stage="pin", region=c.region, offset=c.region_offset,
                          bytes=c.nbytes, error=cuda_error_text(self.rt, err))
                clear_cuda_error(self.rt)
        return failures


# ---------------------------------------------------------------------------------------------
# Placement's product


@dataclass
class RegionResidency:
    """Sampled residency of one region.

    ``node_samples``: node -> samples found there; ``absent``: samples never touched;
    ``errors``: other move_pages errors; ``stray``: present samples on a node the plan does
    not allow (bind: not the home node; interleave: outside the region's nodes).
    ``sample_bytes``: bytes each sample stands for (the step).
    """

    name: str
    role: str
    policy: str
    planned_nodes: tuple[int, ...]
    used_bytes: int
    samples: int
    node_samples: dict[int, int]
    absent: int
    errors: int
    stray: int
    sample_bytes: int

    @property
    def present(self) -> int:
        return sum(self.node_samples.values())

    @property
    def ok(self) -> bool:
        return self.stray == 0 and self.absent == 0 and self.errors == 0

    def bytes_per_node(self) -> dict[int, int]:
        """Estimated used bytes on each node (used_bytes split by sample shares)."""
        if not self.present:
            return {}
        return {n: self.used_bytes * c // self.present for n, c in self.node_samples.items()}

    def share(self) -> dict[int, float]:
        """Fraction of present samples on each node."""
        p = self.present
        return {n: c / p for n, c in sorted(self.node_samples.items())} if p else {}

    def interleave_imbalance(self) -> float:
        """Largest |share - 1/N| / (1/N) over the region's nodes (0 = perfectly even)."""
        if self.policy != "interleave" or not self.planned_nodes or not self.present:
            return 0.0
        even = 1.0 / len(self.planned_nodes)
        sh = self.share()
        return max(abs(sh.get(n, 0.0) - even) / even for n in self.planned_nodes)


@dataclass
class ResidencyReport:
    """Residency of the checked regions, after any repair, plus what was migrated."""

    regions: list[RegionResidency] = field(default_factory=list)
    migrated: list[str] = field(default_factory=list)
    before: list[RegionResidency] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""

    def merge(self, other: ResidencyReport) -> None:
        """Add ``other``'s regions and migrations (the replication stage's check of the replica
        regions) to this report (placement's, of the primaries)."""
        self.regions.extend(other.regions)
        self.migrated.extend(other.migrated)

    def bytes_per_node(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.regions:
            for n, b in r.bytes_per_node().items():
                out[n] = out.get(n, 0) + b
        return dict(sorted(out.items()))

    @property
    def stray_samples(self) -> int:
        return sum(r.stray for r in self.regions)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.regions)

    def on_plan_fraction(self) -> float:
        """Fraction of sampled pages (bind and interleave regions) on an allowed node."""
        present = sum(r.present for r in self.regions if r.policy != "local")
        stray = sum(r.stray for r in self.regions if r.policy != "local")
        return 1.0 if present == 0 else (present - stray) / present

    def to_dict(self) -> dict:
        return {
            "note": self.note,
            "bytes_per_node": {str(k): v for k, v in self.bytes_per_node().items()},
            "on_plan_fraction": self.on_plan_fraction(),
            "migrated": list(self.migrated),
            "regions": [
                {"name": r.name, "role": r.role, "policy": r.policy, "nodes": list(r.planned_nodes),
                 "samples": r.samples, "node_samples": {str(k): v for k, v in r.node_samples.items()},
                 "absent": r.absent, "stray": r.stray}
                for r in self.regions
            ],
        }
