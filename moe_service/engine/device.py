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
"""

from __future__ import annotations

from moe_service.errors import PreflightError


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


def resolve_device(config) -> tuple[str, str]:
    """``engine.device`` -> (torch device string, dense mode): ``("cuda:0", "torch")`` or
    ``("cpu", "quant")`` (module docstring). ``config``: the Settings (reads
    ``config.engine.device``: auto | cpu | cuda).

    Raises PreflightError when ``engine.device = cuda`` and no CUDA device is usable.
    """
    wanted = config.engine.device
    if wanted == "cpu":
        return "cpu", "quant"
    import torch

    reason = cuda_absent_reason()
    if reason is None:
        return f"cuda:{torch.cuda.current_device()}", "torch"
    if wanted == "cuda":
        raise PreflightError(f"engine.device = cuda but {reason}; set engine.device = auto or cpu on this host")
    return "cpu", "quant"
