"""The pin stage: page-lock every placed region with cudaHostRegister, so the GPU reads experts
straight from where placement put them (DMA from pinned pages; pageable memory goes through
a staging copy at a fraction of the bandwidth).

::

    layout regions (primary + replica, dense included)
      -> page-aligned chunks of at most pin.chunk_bytes (one call of >= 512 GiB fails on
         recent drivers; the default 64 GiB stays far below)
      -> cudaHostRegister(base + arena_offset, nbytes, flags) per chunk, in arena order
         flags = cudaHostRegisterReadOnly (8) when the device attribute
                 cudaDevAttrHostRegisterReadOnlySupported (113) is 1, else Default (0)
      -> close(): cudaHostUnregister per chunk, in reverse order

Pinned pages cannot be migrated, which is why pin runs after placement (pipeline/spec.py
ORDER_RULES). On a failed call every chunk registered so far is unregistered (reverse order),
the CUDA error state is cleared (cudaGetLastError: a failed runtime call leaves its error to be
reported by the next unrelated check) and a :class:`~moe_service.errors.PinError` names the
region, offset, size, flags and the CUDA error.

``pin.mode``: ``auto`` pins when torch sees a CUDA device and otherwise skips with the reason
(logged and sent as STATUS); ``required`` refuses a start without one (preflight fails first,
exit 4; the stage itself raises PinError, exit 5); ``off`` skips.

The CUDA calls go through a :class:`CudaRuntime` (real: :class:`TorchCudart`, torch's cudart
binding plus the few calls it lacks from the same libcudart via ctypes), so tests inject a fake
that records the calls.
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from collections.abc import Callable

from moe_service.config import Settings
from moe_service.engine.device import cuda_absent_reason
from moe_service.errors import PinError
from moe_service.layout import PAGE_BYTES, Layout, align_up
from moe_service.log import get_logger
from moe_service.sizes import gib_text
from pipeline.checks import Check, Status
from pipeline.context import PipelineContext
from pipeline.products import CUDA_SUCCESS, CudaRuntime, PinChunk, PinnedRegions
from pipeline.products import clear_cuda_error as _clear_error
from pipeline.products import cuda_error_text as _cuda_error
from pipeline.spec import Stage, register_stage

log = get_logger(__name__)

# CUDA runtime constants (driver_types.h)
CUDA_HOST_REGISTER_DEFAULT = 0x00
CUDA_HOST_REGISTER_READ_ONLY = 0x08
CUDA_DEV_ATTR_HOST_REGISTER_SUPPORTED = 99
CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113

FLAG_NAMES = {CUDA_HOST_REGISTER_DEFAULT: "cudaHostRegisterDefault", CUDA_HOST_REGISTER_READ_ONLY: "cudaHostRegisterReadOnly"}


def flags_name(flags: int) -> str:
    return FLAG_NAMES.get(flags, f"{flags:#x}")


# ---------------------------------------------------------------------------------------------
# The CUDA runtime, behind a small interface


def _loaded_cudart_paths(maps: str = "/proc/self/maps") -> list[str]:
    """Shared objects mapped into this process that may hold torch's CUDA runtime: every
    ``libcudart.so*`` (pip wheels of torch load nvidia-cuda-runtime's), then
    ``libtorch_cuda.so`` (builds that link the runtime statically into it)."""
    cudart: list[str] = []
    torch_cuda: list[str] = []
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                base = os.path.basename(path)
                if base.startswith("libcudart.so") and path not in cudart:
                    cudart.append(path)
                elif base.startswith("libtorch_cuda.so") and path not in torch_cuda:
                    torch_cuda.append(path)
    except OSError:
        pass
    return cudart + torch_cuda


class TorchCudart:
    """The real CUDA runtime as torch loaded it.

    cudaHostRegister/cudaHostUnregister go through ``torch.cuda.cudart()`` (torch's binding,
    which releases the GIL). torch does not bind cudaGetLastError, cudaGetErrorName or
    cudaDeviceGetAttribute, so those come from the libcudart that torch itself mapped into the
    process (found in /proc/self/maps): the same runtime instance, hence the same per-thread
    error state. Constructing this initialises CUDA. Raises PinError when torch has no CUDA or
    its runtime library cannot be found.
    """

    def __init__(self) -> None:
        import torch

        reason = cuda_absent_reason()
        if reason is not None:
            raise PinError(f"cannot pin: {reason}")
        self._rt = torch.cuda.cudart()  # initialises CUDA; maps libcudart
        lib = None
        candidates = _loaded_cudart_paths()
        for path in candidates:
            try:
                candidate = ctypes.CDLL(path)
                candidate.cudaGetLastError  # noqa: B018  (raises AttributeError when absent)
                candidate.cudaDeviceGetAttribute  # noqa: B018
            except (OSError, AttributeError):
                continue
            lib = candidate
            break
        if lib is None:
            raise PinError(
                "cannot pin: no library mapped into the process exports torch's CUDA runtime "
                f"(looked at {', '.join(candidates) or 'no libcudart.so* or libtorch_cuda.so'}), so "
                "cudaGetLastError/cudaDeviceGetAttribute cannot be called on it"
            )
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaDeviceGetAttribute.restype = ctypes.c_int
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaGetDevice.restype = ctypes.c_int
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self._lib = lib

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return int(self._rt.cudaHostRegister(ptr, size, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._rt.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:
        return int(self._lib.cudaGetLastError())

    def cudaGetErrorName(self, error: int) -> str:
        return (self._lib.cudaGetErrorName(error) or b"?").decode()

    def cudaGetErrorString(self, error: int) -> str:
        return (self._lib.cudaGetErrorString(error) or b"?").decode()

    def cudaDeviceGetAttribute(self, attr: int, device: int) -> tuple[int, int]:
        value = ctypes.c_int(0)
        err = int(self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, device))
        return err, int(value.value)

    def cudaGetDevice(self) -> tuple[int, int]:
        dev = ctypes.c_int(0)
        err = int(self._lib.cudaGetDevice(ctypes.byref(dev)))
        return err, int(dev.value)


def register_flags(rt: CudaRuntime, device: int | None = None) -> tuple[int, str]:
    """(flags, why): cudaHostRegisterReadOnly when ``device`` (default: the current one) reports
    cudaDevAttrHostRegisterReadOnlySupported = 1, else cudaHostRegisterDefault. A failed
    attribute query counts as unsupported (its error is cleared)."""
    if device is None:
        err, device = rt.cudaGetDevice()
        if err != CUDA_SUCCESS:
            _clear_error(rt)
            device = 0
    err, value = rt.cudaDeviceGetAttribute(CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, device)
    if err != CUDA_SUCCESS:
        _clear_error(rt)
        return CUDA_HOST_REGISTER_DEFAULT, f"device {device}: read-only support unknown ({_cuda_error(rt, err)})"
    if value == 1:
        return CUDA_HOST_REGISTER_READ_ONLY, f"device {device} supports read-only registration"
    return CUDA_HOST_REGISTER_DEFAULT, f"device {device} lacks read-only registration (attribute 113 = {value})"


# ---------------------------------------------------------------------------------------------
# What to register


def plan_pin_chunks(layout: Layout, chunk_bytes: int, page_bytes: int = PAGE_BYTES) -> list[PinChunk]:
    """Every region of ``layout`` (primary and replica, expert and dense) split into contiguous
    page-aligned chunks of at most ``chunk_bytes`` (rounded down to whole pages), in arena order.

    A region's pinned range is its used bytes rounded up to a whole page (the padding after it
    is never read); regions with nothing in them are left out. Pure: touches no memory.
    Raises ValueError when a region does not start on a page boundary.
    """
    step = (chunk_bytes // page_bytes) * page_bytes
    if step <= 0:
        raise ValueError(f"pin.chunk_bytes ({chunk_bytes}) is smaller than one page ({page_bytes})")
    chunks: list[PinChunk] = []
    for r in sorted(layout.regions, key=lambda r: r.arena_offset):
        if r.arena_offset % page_bytes:
            raise ValueError(f"region {r.name!r} starts at arena offset {r.arena_offset}, not on a page boundary")
        total = min(align_up(r.used_bytes, page_bytes), max(r.nbytes, r.used_bytes))
        off = 0
        while off < total:
            n = min(step, total - off)
            chunks.append(PinChunk(r.name, r.role, r.arena_offset + off, off, n))
            off += n
    return chunks


# ---------------------------------------------------------------------------------------------
# Registering


def pin_chunks(
    rt: CudaRuntime,
    base_address: int,
    chunks: list[PinChunk],
    flags: int,
    *,
    check_shutdown: Callable[[], None] | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> PinnedRegions:
    """cudaHostRegister each chunk at ``base_address + chunk.arena_offset`` with ``flags``.

    ``check_shutdown`` runs before each call (it raises to stop); ``on_progress(done_bytes,
    total_bytes, seconds)`` after each. Returns the :class:`PinnedRegions`. On a failed call,
    or when ``check_shutdown`` raises, the chunks registered so far are unregistered in reverse
    order and the CUDA error is cleared; a failed call raises PinError naming the region,
    offset, size, flags and the CUDA error (name and text), with the same as attributes
    ``chunk`` (:class:`PinChunk`), ``flags`` and ``cuda_error`` (the cudaError_t number).
    """
    pinned = PinnedRegions(rt, base_address, flags)
    total = sum(c.nbytes for c in chunks)
    done = 0
    t0 = time.monotonic()
    try:
        for i, c in enumerate(chunks):
            if check_shutdown is not None:
                check_shutdown()
            ptr = base_address + c.arena_offset
            err = rt.cudaHostRegister(ptr, c.nbytes, flags)
            if err != CUDA_SUCCESS:
                what = _cuda_error(rt, err)
                _clear_error(rt)
                registered = len(pinned.chunks)
                error = PinError(
                    f"cudaHostRegister failed for region {c.region!r} ({c.role}) at region offset "
                    f"{c.region_offset} (address {ptr:#x}), {c.nbytes} bytes ({gib_text(c.nbytes)}), "
                    f"flags {flags} ({flags_name(flags)}), chunk {i + 1} of {len(chunks)}: {what}; "
                    f"the {registered} chunk(s) registered before it were unregistered"
                )
                error.chunk, error.flags, error.cuda_error = c, flags, err
                raise error
            pinned.chunks.append(c)
            done += c.nbytes
            if on_progress is not None:
                on_progress(done, total, time.monotonic() - t0)
    except BaseException:
        pinned.unpin()
        raise
    pinned.seconds = time.monotonic() - t0
    return pinned


# ---------------------------------------------------------------------------------------------
# Preflight


def _probe_flags() -> tuple[int | None, str]:
    """The flags the stage will use on this host, or (None, why unknown)."""
    try:
        return register_flags(TorchCudart())
    except Exception as e:
        return None, f"flags decided at pin time ({type(e).__name__}: {e})"


def pin_preflight(
    config: Settings,
    layout: Layout,
    *,
    cuda_reason: Callable[[], str | None] = cuda_absent_reason,
    probe_flags: Callable[[], tuple[int | None, str]] = _probe_flags,
    memlock: Callable[[], tuple[int, int]] = lambda: resource.getrlimit(resource.RLIMIT_MEMLOCK),
) -> list[Check]:
    """What the pin stage will do on this host, as preflight checks (run_preflight lists them).

    ``pin``: off -> ok (nothing pinned); auto without CUDA -> ok (skipped, with the reason);
    required without CUDA -> fail (the start is refused here, exit 4); with CUDA -> ok, with
    bytes, chunk count and flags. ``memlock`` (when something will be pinned, or pinning is
    required): RLIMIT_MEMLOCK soft limit must be unlimited or at least the bytes to pin
    (LimitMEMLOCK=infinity in the unit); short: fail with ``required``, warn with ``auto``
    (the driver may still accept the registration; if it does not, the stage fails naming
    the chunk). ``config``: Settings (reads ``pin.mode``, ``pin.chunk_bytes``). The keyword
    arguments replace the host probes (tests).
    """
    mode = config.pin.mode
    chunks = plan_pin_chunks(layout, config.pin.chunk_bytes)
    pin_bytes = sum(c.nbytes for c in chunks)
    numbers: dict[str, int | None] = {"pin_bytes": pin_bytes, "chunks": len(chunks), "chunk_bytes": config.pin.chunk_bytes,
               "regions": len({c.region for c in chunks})}
    if mode == "off":
        return [Check("pin", "ok", "pin.mode = off: nothing is pinned", numbers)]
    checks: list[Check] = []
    reason = cuda_reason()
    if reason is not None:
        if mode == "required":
            checks.append(Check(
                "pin", "fail",
                f"pin.mode = required but {reason}; use pin.mode = auto (or off) on hosts without a GPU",
                numbers))
        else:
            return [Check("pin", "ok", f"pin.mode = auto: pin will be skipped ({reason})", numbers)]
    else:
        flags, why = probe_flags()
        numbers["flags"] = flags
        shown = f"flags {flags} ({flags_name(flags)}: {why})" if flags is not None else why
        checks.append(Check(
            "pin", "ok",
            f"pin registers {gib_text(pin_bytes)} ({pin_bytes} bytes) of {numbers['regions']} region(s) in "
            f"{len(chunks)} call(s) of at most {gib_text(config.pin.chunk_bytes)}, {shown}",
            numbers))
    soft, hard = memlock()
    unlimited = soft == resource.RLIM_INFINITY
    ok = unlimited or soft >= pin_bytes
    shown = "unlimited" if unlimited else f"{soft} bytes ({gib_text(soft)})"
    status: Status = "ok" if ok else ("fail" if mode == "required" else "warn")
    checks.append(Check(
        "memlock", status,
        f"RLIMIT_MEMLOCK is {shown}" + ("" if ok else
            f", less than the {pin_bytes} bytes ({gib_text(pin_bytes)}) pin registers; set "
            "LimitMEMLOCK=infinity in the unit (ulimit -l unlimited outside systemd)"),
        {"needed_bytes": pin_bytes, "available_bytes": -1 if unlimited else soft,
         "hard_bytes": -1 if hard == resource.RLIM_INFINITY else hard}))
    return checks


# ---------------------------------------------------------------------------------------------
# The stage


def _arena_and_layout(ctx: PipelineContext) -> tuple[int, int, Layout]:
    """(base address, arena bytes, layout) from ``ctx.arena`` (uint8 numpy array) and
    ``ctx.layout`` (the stage's declared reads)."""
    arena, layout = ctx.arena, ctx.layout
    if arena is None or layout is None:
        raise PinError("pin needs the loaded arena and its layout, but no earlier stage provided them")
    return int(arena.ctypes.data), int(arena.nbytes), layout


@register_stage
class PinStage(Stage):
    """cudaHostRegister every placed region (module docstring). Reads ``ctx.arena`` and
    ``ctx.layout``; writes ``ctx.pins`` (:class:`PinnedRegions`). Settings: ``[pin]`` mode,
    chunk_bytes. ``runtime_factory`` builds the CUDA runtime (tests replace it). Its preflight
    checks are :func:`pin_preflight`."""

    name = "pin"
    requires = ("placement",)
    reads = ("arena", "layout")
    writes = ("pins",)
    summary = "page-lock the placed regions for the GPU (cudaHostRegister)"

    runtime_factory: Callable[[], CudaRuntime] = TorchCudart
    cuda_reason: Callable[[], str | None] = staticmethod(cuda_absent_reason)

    @classmethod
    def preflight_checks(cls, config: Settings, layout: Layout) -> list[Check]:
        return pin_preflight(config, layout)

    def skip_reason(self, ctx: PipelineContext) -> str | None:
        mode = ctx.config.pin.mode
        if mode == "off":
            return "pin.mode = off"
        if mode == "auto":
            reason = self.cuda_reason()
            if reason is not None:
                return f"pin.mode = auto and {reason}; expert regions stay pageable"
        return None

    def run(self, ctx: PipelineContext) -> None:
        cfg = ctx.config.pin
        reason = self.cuda_reason()
        if reason is not None:  # mode required (auto skipped, off skipped)
            raise PinError(f"pin.mode = required but {reason}; use pin.mode = auto (or off) on hosts without a GPU")
        base, arena_bytes, layout = _arena_and_layout(ctx)
        chunks = plan_pin_chunks(layout, cfg.chunk_bytes)
        if chunks and chunks[-1].arena_offset + chunks[-1].nbytes > arena_bytes:
            last = chunks[-1]
            raise PinError(f"region {last.region!r} ends at arena byte {last.arena_offset + last.nbytes}, "
                           f"past the arena's {arena_bytes} bytes")
        rt = self.runtime_factory()
        flags, why = register_flags(rt)
        total = sum(c.nbytes for c in chunks)
        log.info("pin_start", stage="pin", bytes=total, chunks=len(chunks), flags=flags,
                 flags_name=flags_name(flags), why=why, chunk_bytes=cfg.chunk_bytes)
        last_status = [0.0]

        def progress(done: int, total_bytes: int, seconds: float) -> None:
            now = time.monotonic()
            if now - last_status[0] >= 1.0 or done == total_bytes:
                last_status[0] = now
                gbps = done / seconds / 1e9 if seconds > 0 else 0.0
                ctx.status(f"pin: {done * 100 // max(total_bytes, 1)}% of {gib_text(total_bytes)} ({gbps:.1f} GB/s)")
                log.info("pin_progress", stage="pin", bytes=done, total_bytes=total_bytes,
                         seconds=round(seconds, 3), gbps=round(gbps, 2))

        pins = ctx.pins = pin_chunks(rt, base, chunks, flags, check_shutdown=ctx.check_shutdown,
                                     on_progress=progress)
        gbps = total / pins.seconds / 1e9 if pins.seconds > 0 else 0.0
        log.info("pin_done", stage="pin", bytes=total, chunks=len(chunks), flags=flags,
                 seconds=round(pins.seconds, 3), gbps=round(gbps, 2))
        ctx.status(f"pin: {gib_text(total)} pinned in {len(chunks)} call(s), flags {flags}")

    def close(self, ctx: PipelineContext) -> None:
        pins = ctx.pins
        if pins is None:
            return
        n, nbytes = len(pins.chunks), pins.nbytes
        failures = pins.unpin()
        ctx.pins = None
        log.info("pin_released", stage="pin", chunks=n, bytes=nbytes, failures=failures)
