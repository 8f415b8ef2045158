"""The pin stage against a fake CUDA runtime that records every call: chunking, flags, rollback,
modes, preflight, and the stage inside the real runner and lifecycle."""

from __future__ import annotations

import resource

import numpy as np
import pytest

from moe_service.config import load_config
from moe_service.errors import Interrupted, PinError
from moe_service.layout import PAGE_BYTES, REGION_ALIGN_BYTES, Layout, Region
from pipeline import pin as pin_mod
from pipeline.context import PipelineContext
from pipeline.lifecycle import run_service
from pipeline.pin import (
    CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED,
    CUDA_HOST_REGISTER_READ_ONLY,
    PinStage,
    pin_chunks,
    pin_preflight,
    plan_pin_chunks,
    register_flags,
)
from pipeline.runner import PipelineRunner
from pipeline.spec import Stage, validate_stages

GiB = 1024**3
BASE = 0x7F00_0000_0000  # a fake arena address: nothing is dereferenced


class FakeCudart:
    """Records calls; register call number ``fail_on`` (1-based) returns ``fail_error``.

    Like the real runtime, a failed call sets the per-thread last error, which
    cudaGetLastError returns and resets."""

    ERRORS = {0: ("cudaSuccess", "no error"), 2: ("cudaErrorMemoryAllocation", "out of memory"),
              712: ("cudaErrorHostMemoryAlreadyRegistered", "part or all of the requested memory range is already mapped")}

    def __init__(self, read_only: int = 1, fail_on: int | None = None, fail_error: int = 2):
        self.calls: list[tuple] = []
        self.read_only = read_only
        self.fail_on = fail_on
        self.fail_error = fail_error
        self.last_error = 0
        self.registered: dict[int, int] = {}
        self.n_register = 0

    def cudaHostRegister(self, ptr, size, flags):
        self.n_register += 1
        self.calls.append(("register", ptr, size, flags))
        if self.n_register == self.fail_on:
            self.last_error = self.fail_error
            return self.fail_error
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        if self.registered.pop(ptr, None) is None:
            self.last_error = 1
            return 1
        return 0

    def cudaGetLastError(self):
        self.calls.append(("get_last_error",))
        err, self.last_error = self.last_error, 0
        return err

    def cudaGetErrorName(self, error):
        return self.ERRORS.get(error, ("cudaErrorInvalidValue", ""))[0]

    def cudaGetErrorString(self, error):
        return self.ERRORS.get(error, ("", "invalid argument"))[1]

    def cudaDeviceGetAttribute(self, attr, device):
        self.calls.append(("attribute", attr, device))
        return 0, (self.read_only if attr == CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED else 0)

    def cudaGetDevice(self):
        return 0, 0


def big_layout(total_bytes: int) -> Layout:
    """One region of ``total_bytes`` (no memory behind it: only offsets are used)."""
    r = Region("node0.experts", "primary", "bind", (0,), 0, total_bytes, used_bytes=total_bytes)
    return Layout([r], total_bytes, {}, {}, nodes=(0,))


def two_node_layout() -> Layout:
    """Primary expert regions on nodes 0 and 1, an interleaved dense region, one replica region
    (offsets as the planner lays them out: 2 MiB aligned, used bytes not page multiples)."""
    M = REGION_ALIGN_BYTES
    regions = [
        Region("node0.experts", "primary", "bind", (0,), 0, 4 * M, used_bytes=4 * M - 100),
        Region("node1.experts", "primary", "bind", (1,), 4 * M, 4 * M, used_bytes=3 * M + 5),
        Region("dense", "primary", "interleave", (0, 1), 8 * M, 2 * M, used_bytes=M),
        Region("node1.replicas", "replica", "bind", (1,), 10 * M, 2 * M, used_bytes=2 * M),
        Region("empty", "replica", "bind", (0,), 12 * M, 0, used_bytes=0),
    ]
    return Layout(regions, 12 * M, {}, {}, nodes=(0, 1), replicas=1)


# -- chunking ------------------------------------------------------------------------------------


def test_600e9_bytes_become_page_aligned_chunks_of_at_most_64_gib():
    chunks = plan_pin_chunks(big_layout(600 * 10**9), 64 * GiB)
    assert len(chunks) == 9  # 8 x 64 GiB + the rest
    pos = 0
    for c in chunks:
        assert c.arena_offset == pos, "chunks are contiguous"
        assert c.arena_offset % PAGE_BYTES == 0 and c.nbytes % PAGE_BYTES == 0
        assert 0 < c.nbytes <= 64 * GiB
        pos += c.nbytes
    assert pos == 600 * 10**9, "the range is covered exactly"
    assert [c.nbytes for c in chunks[:-1]] == [64 * GiB] * 8


def test_every_region_is_pinned_primary_replica_and_dense():
    layout = two_node_layout()
    chunks = plan_pin_chunks(layout, 3 * REGION_ALIGN_BYTES)
    by_region: dict[str, int] = {}
    for c in chunks:
        by_region[c.region] = by_region.get(c.region, 0) + c.nbytes
        assert c.nbytes <= 3 * REGION_ALIGN_BYTES
    M = REGION_ALIGN_BYTES
    # used bytes rounded up to whole pages; empty regions left out
    assert by_region == {"node0.experts": 4 * M, "node1.experts": 3 * M + PAGE_BYTES,
                         "dense": M, "node1.replicas": 2 * M}
    assert {c.role for c in chunks} == {"primary", "replica"}


def test_chunk_size_is_rounded_down_to_pages_and_unaligned_regions_are_refused():
    chunks = plan_pin_chunks(big_layout(10 * PAGE_BYTES), 3 * PAGE_BYTES + 100)
    assert [c.nbytes for c in chunks] == [3 * PAGE_BYTES] * 3 + [PAGE_BYTES]
    bad = Layout([Region("r", "primary", "local", (), 100, 4096, used_bytes=10)], 8192, {}, {})
    with pytest.raises(ValueError, match="region 'r' starts at arena offset 100"):
        plan_pin_chunks(bad, GiB)


# -- registering -----------------------------------------------------------------------------------


def test_registers_each_chunk_at_base_plus_offset_and_unpins_in_reverse():
    rt = FakeCudart()
    chunks = plan_pin_chunks(big_layout(600 * 10**9), 64 * GiB)
    pins = pin_chunks(rt, BASE, chunks, CUDA_HOST_REGISTER_READ_ONLY)
    regs = [c for c in rt.calls if c[0] == "register"]
    assert regs == [("register", BASE + c.arena_offset, c.nbytes, 8) for c in chunks]
    assert pins.nbytes == 600 * 10**9
    assert pins.covers(5, 64 * GiB + 10) and not pins.covers(600 * 10**9 - 1, 2)
    rt.calls.clear()
    assert pins.unpin() == 0
    assert rt.calls == [("unregister", BASE + c.arena_offset) for c in reversed(chunks)]
    assert rt.registered == {}


def test_failure_on_call_3_unregisters_2_and_1_clears_the_error_and_names_everything():
    rt = FakeCudart(fail_on=3, fail_error=712)
    layout = two_node_layout()
    chunks = plan_pin_chunks(layout, 2 * REGION_ALIGN_BYTES)
    with pytest.raises(PinError) as ei:
        pin_chunks(rt, BASE, chunks, 0)
    third = chunks[2]
    after = rt.calls[rt.calls.index(("register", BASE + third.arena_offset, third.nbytes, 0)) + 1:]
    assert after == [("get_last_error",),
                     ("unregister", BASE + chunks[1].arena_offset),
                     ("unregister", BASE + chunks[0].arena_offset)]
    assert rt.last_error == 0 and rt.registered == {}
    msg = str(ei.value)
    for part in (f"region {third.region!r}", f"region offset {third.region_offset}", f"{third.nbytes} bytes",
                 "flags 0 (cudaHostRegisterDefault)", "cudaErrorHostMemoryAlreadyRegistered (712)",
                 "already mapped", "chunk 3 of", "2 chunk(s) registered before it were unregistered"):
        assert part in msg, part
    assert ei.value.exit_code == 5
    assert (ei.value.chunk, ei.value.flags, ei.value.cuda_error) == (third, 0, 712)


def test_a_shutdown_between_chunks_unregisters_what_was_registered():
    rt = FakeCudart()
    chunks = plan_pin_chunks(big_layout(4 * GiB), GiB)
    calls = {"n": 0}

    def check():
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupted("SIGTERM during pin")

    with pytest.raises(Interrupted):
        pin_chunks(rt, BASE, chunks, 0, check_shutdown=check)
    assert rt.registered == {}
    assert [c[0] for c in rt.calls] == ["register", "register", "unregister", "unregister"]


@pytest.mark.parametrize("attr,flags", [(1, 8), (0, 0)])
def test_read_only_flag_only_when_the_device_supports_it(attr, flags):
    rt = FakeCudart(read_only=attr)
    got, why = register_flags(rt)
    assert got == flags
    assert ("attribute", 113, 0) in rt.calls
    assert ("supports" in why) == bool(attr)


def test_a_failed_attribute_query_means_default_flags_and_a_cleared_error():
    rt = FakeCudart()
    rt.cudaDeviceGetAttribute = lambda attr, dev: (setattr(rt, "last_error", 101) or (101, 0))
    flags, why = register_flags(rt, device=0)
    assert flags == 0 and "unknown" in why and rt.last_error == 0


# -- the stage ----------------------------------------------------------------------------------


def fake_stage(rt: FakeCudart | None, cuda_reason: str | None):
    class _Pin(PinStage):
        runtime_factory = staticmethod(lambda: rt)

    _Pin.cuda_reason = staticmethod(lambda: cuda_reason)
    return _Pin


def stage_ctx(mode: str, layout: Layout | None = None, arena_bytes: int | None = None, **pin):
    cfg = load_config(data={"pin": {"mode": mode, **pin}, "pipeline": {"stages": ["pin"]}})
    ctx = PipelineContext(cfg)
    ctx.layout = layout or two_node_layout()
    ctx.arena = np.zeros(arena_bytes or ctx.layout.arena_bytes, dtype=np.uint8)
    return ctx


def test_auto_without_cuda_on_this_machine_is_skipped_with_the_reason_and_status(notify_socket):
    ctx = stage_ctx("auto")
    stage = PinStage()  # the real probe: this machine's torch is a CPU build
    reason = stage.skip_reason(ctx)
    assert reason and reason.startswith("pin.mode = auto and ") and "CUDA" in reason
    calls = []

    class _Pin(PinStage):
        runtime_factory = staticmethod(lambda: calls.append("runtime") or FakeCudart())

    ctx.config.pipeline.stages = ["fastload", "placement", "pin"]
    registry = {"fastload": _fake_stage("fastload"), "placement": _fake_stage("placement"), "pin": _Pin}
    runner = PipelineRunner(ctx, registry)
    runner.run()
    assert ctx.skipped == {"pin": reason} and ctx.pins is None and calls == []
    assert notify_socket.wait_for(f"STATUS=pin skipped: {reason}")


def test_off_is_skipped_without_probing():
    stage = fake_stage(FakeCudart(), cuda_reason=None)()
    assert stage.skip_reason(stage_ctx("off")) == "pin.mode = off"


def test_required_without_cuda_fails_the_stage_with_a_clear_message():
    stage = PinStage()  # real probe: no CUDA here
    ctx = stage_ctx("required")
    assert stage.skip_reason(ctx) is None
    with pytest.raises(PinError, match="pin.mode = required but torch .* use pin.mode = auto"):
        stage.run(ctx)


def test_stage_pins_every_region_and_close_releases_them():
    rt = FakeCudart(read_only=0)
    ctx = stage_ctx("required", chunk_bytes=2 * REGION_ALIGN_BYTES)
    stage = fake_stage(rt, None)()
    stage.run(ctx)
    base = int(ctx.arena.ctypes.data)
    chunks = plan_pin_chunks(ctx.layout, 2 * REGION_ALIGN_BYTES)
    assert [c for c in rt.calls if c[0] == "register"] == [("register", base + c.arena_offset, c.nbytes, 0) for c in chunks]
    assert ctx.pins.flags == 0 and len(ctx.pins.chunks) == len(chunks)
    assert ctx.status_text.startswith("pin: ") and "pinned" in ctx.status_text
    stage.close(ctx)
    assert rt.registered == {} and ctx.pins is None


def test_stage_refuses_a_layout_larger_than_the_arena():
    ctx = stage_ctx("required", arena_bytes=REGION_ALIGN_BYTES)
    with pytest.raises(PinError, match="past the arena's"):
        fake_stage(FakeCudart(), None)().run(ctx)


# -- the runner and the lifecycle ------------------------------------------------------------------


def _fake_stage(stage_name, requires=()):
    class _S(Stage):
        name = stage_name
        writes = ("arena",) if stage_name == "fastload" else ()  # the real one does (tests set ctx.arena)

        def run(self, ctx):
            pass

    _S.requires = requires
    return _S


def test_pin_before_placement_is_refused_with_the_reason():
    registry = {"fastload": _fake_stage("fastload"), "placement": _fake_stage("placement", ("fastload",)), "pin": PinStage}
    problems = validate_stages(["fastload", "pin", "placement"], registry)
    assert problems == ["pipeline.stages: pin must come after placement: pinned pages cannot be migrated, "
                        "so placement would be silently lost"]
    assert validate_stages(["fastload", "pin"], registry) == [
        "pipeline.stages: stage 'pin' requires 'placement', which is not declared"]
    assert validate_stages(["fastload", "placement", "pin"], registry) == []


def test_required_without_cuda_fails_the_start_with_exit_5_and_tells_systemd(notify_socket, clean_env):
    """The whole lifecycle (run_service, as `moe-service serve` calls it) with stand-in load stages
    and the real pin stage: a non-zero exit and ERRNO/STATUS naming the cause."""
    layout = two_node_layout()

    def prepare(ctx):
        ctx.layout = layout

    class Load(Stage):
        name = "fastload"
        writes = ("arena",)

        def run(self, ctx):
            ctx.arena = np.zeros(layout.arena_bytes, dtype=np.uint8)

    registry = {"fastload": Load, "placement": _fake_stage("placement", ("fastload",)), "pin": PinStage}
    settings = load_config(data={"pin": {"mode": "required"}, "pipeline": {"stages": ["fastload", "placement", "pin"]}})
    code = run_service(settings, handle_signals=False, registry=registry, prepare=prepare)
    assert code == 5
    assert notify_socket.wait_for("pin failed: pin.mode = required but")
    assert notify_socket.wait_for("ERRNO=")


# -- preflight ---------------------------------------------------------------------------------------


def cfg(mode: str, **pin):
    return load_config(data={"pin": {"mode": mode, **pin}})


UNLIMITED = lambda: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)  # noqa: E731


def test_preflight_reports_bytes_chunks_and_flags_with_cuda():
    layout = big_layout(600 * 10**9)
    checks = pin_preflight(cfg("auto"), layout, cuda_reason=lambda: None,
                           probe_flags=lambda: (8, "device 0 supports read-only registration"), memlock=UNLIMITED)
    pin, memlock = checks
    assert pin.name == "pin" and pin.status == "ok"
    assert pin.numbers == {"pin_bytes": 600 * 10**9, "chunks": 9, "chunk_bytes": 64 * GiB, "regions": 1, "flags": 8}
    assert "600000000000 bytes" in pin.message and "9 call(s)" in pin.message and "cudaHostRegisterReadOnly" in pin.message
    assert memlock.name == "memlock" and memlock.status == "ok" and "unlimited" in memlock.message


def test_preflight_required_without_cuda_fails():
    checks = pin_preflight(cfg("required"), two_node_layout(), cuda_reason=lambda: "torch sees no CUDA device",
                           memlock=UNLIMITED)
    assert checks[0].status == "fail"
    assert checks[0].message.startswith("pin.mode = required but torch sees no CUDA device")


def test_preflight_auto_without_cuda_skips_and_off_pins_nothing():
    (c,) = pin_preflight(cfg("auto"), two_node_layout(), cuda_reason=lambda: "no GPU here")
    assert c.status == "ok" and "skipped (no GPU here)" in c.message
    (c,) = pin_preflight(cfg("off"), two_node_layout(), cuda_reason=lambda: pytest.fail("probed with off"))
    assert c.status == "ok" and "nothing is pinned" in c.message


@pytest.mark.parametrize("mode,status", [("required", "fail"), ("auto", "warn")])
def test_preflight_memlock_too_small(mode, status):
    layout = big_layout(600 * 10**9)
    checks = pin_preflight(cfg(mode), layout, cuda_reason=lambda: None, probe_flags=lambda: (0, "no ro"),
                           memlock=lambda: (64 * 1024, 64 * 1024))
    memlock = checks[-1]
    assert memlock.status == status
    assert "RLIMIT_MEMLOCK is 65536 bytes" in memlock.message and "LimitMEMLOCK=infinity" in memlock.message
    assert memlock.numbers["needed_bytes"] == 600 * 10**9


def test_preflight_on_this_machine_uses_the_real_probes():
    """No CUDA here: auto reports the skip; required fails with torch's reason."""
    (c,) = pin_preflight(cfg("auto"), two_node_layout())
    assert c.status == "ok" and "skipped" in c.message
    checks = pin_preflight(cfg("required"), two_node_layout())
    assert checks[0].status == "fail" and checks[1].name == "memlock"


def test_torch_cudart_refuses_cleanly_without_cuda():
    with pytest.raises(PinError, match="cannot pin: torch"):
        pin_mod.TorchCudart()


def test_the_runtime_library_is_found_in_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f04-7f05 r--p 00001000 08:01 2 /venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
        "7f08-7f09 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert pin_mod._loaded_cudart_paths(str(maps)) == [
        "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
        "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so",
    ]
    assert pin_mod._loaded_cudart_paths(str(tmp_path / "absent")) == []
