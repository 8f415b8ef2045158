"""Which torch device the dense part runs on, decided once from ``engine.device``.

``auto`` takes the first CUDA device when torch sees one, else the CPU; ``cuda`` insists on a
CUDA device (a start without one is refused); ``cpu`` never touches CUDA. The answer comes with
the dense mode the engine uses there (moe_service.engine.model.Model's ``dense``):

=========  ==================  ===========================================================
device     dense mode          what runs where
=========  ==================  ===========================================================
cuda:0     ``torch``           dense matrices dequantized once on the GPU (torch_quant), the
                               dense path in torch there; routed experts on the CPU nodes,
                               big prefills optionally offloaded (engine.offload)
cpu        ``quant``           dense matrices read in place by the quantized CPU kernels
=========  ==================  ===========================================================

The service resolves it once, in the prepare step, into ``ctx.device`` (a :class:`DevicePlan`,
which also names the GPU's NUMA node for the plan's dense region); preflight reports it and
the engine stage builds the model there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from moe_service.errors import PreflightError

if TYPE_CHECKING:
    from moe_service.numa import GpuInfo

DenseMode = Literal["torch", "quant"]


@dataclass(frozen=True)
class DevicePlan:
    """Where the dense part runs: ``device`` (torch device string, ``cpu`` or ``cuda:N``),
    ``dense`` (the Model's dense mode there), ``wanted`` (the ``engine.device`` it came from)
    and ``gpu_node``: the NUMA node of the first NVIDIA GPU in sysfs when the device is a GPU
    and the firmware gives it one, else None (the plan binds the dense tensors there)."""

    device: str
    dense: DenseMode
    wanted: str = "auto"
    gpu_node: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def cuda_absent_reason() -> str | None:
    """None when torch can use a CUDA device, else one sentence saying why not (a CPU build of
    torch, no driver or no visible GPU). Never raises; does not create a CUDA context."""
    import torch  # here, not at module level: the pipeline imports this without needing torch yet

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            return "torch sees no CUDA device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"
    except Exception as e:  # a broken driver install raises from the availability probe
        return f"the CUDA probe failed: {type(e).__name__}: {e}"
    return None


def cuda_available() -> bool:
    """Whether torch can use at least one CUDA device."""
    return cuda_absent_reason() is None


def resolve_device(wanted: str, gpus: Sequence[GpuInfo] = ()) -> DevicePlan:
    """``engine.device`` (``wanted``: auto | cpu | cuda) -> the :class:`DevicePlan`:
    ``cuda:<current>`` with dense mode ``torch``, or ``cpu`` with ``quant`` (module docstring).
    ``gpus``: the host's NVIDIA GPUs from sysfs (moe_service.numa.Topology.gpus), which give
    ``gpu_node`` when the device is a GPU.

    Raises PreflightError when ``wanted`` is ``cuda`` and no CUDA device is usable.
    """
    if wanted == "cpu":
        return DevicePlan("cpu", "quant", wanted)
    import torch

    reason = cuda_absent_reason()
    if reason is None:
        node = gpus[0].numa_node if gpus else -1
        return DevicePlan(f"cuda:{torch.cuda.current_device()}", "torch", wanted, node if node >= 0 else None)
    if wanted == "cuda":
        raise PreflightError(f"engine.device = cuda but {reason}; set engine.device = auto or cpu on this host")
    return DevicePlan("cpu", "quant", wanted)
