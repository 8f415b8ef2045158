"""Device check: everything the GPU side claims, measured in one run on a CUDA host (< 5 min).

    1. h2d        host-to-device GB/s from a placed region: pageable, then pinned with the pin
                  stage's own code (cudaHostRegister in chunks, read-only flag when supported),
                  at 256 MiB and 1 GiB (--h2d-mib)
    2. logits     GPU path (dense part on the GPU, weights dequantized there by torch_quant)
                  against the CPU path (quantized kernels in place) on the demo model and on a
                  small synthetic MoE (moe_service.synth tiny-qwen3moe, Q4_K experts):
                  relative L2 of the logits, top-1 agreement, greedy chain
    3. prefill    tok/s of one 4096-token prompt (--prompt-tokens) on the synthetic
                  qwen3-30b-a3b preset (Qwen3-30B-A3B layer shapes, 4 layers, Q4_K experts):
                  experts on the CPU vs offloaded to the GPU (engine.offload), plus the logits
                  difference between the two

Prints one table (``--json``: one JSON object). Exit status: 0 all checks passed, 1 a check
failed, 2 no CUDA device (the script never skips silently: without CUDA it fails, unless
``--device cpu`` asks for the dry run).

On a GPU host, from a fresh clone::

    make venv TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url https://download.pytorch.org/whl/cu128'
    .venv/bin/python bench/gpu_check.py            # add --json for machine-readable output

(any CUDA build of torch works; TORCH_SPEC and PIP_EXTRA are the Makefile's variables).

Dry run on a machine without a GPU: ``python bench/gpu_check.py --device cpu``. Every code path
runs with torch CPU tensors standing in for the device and a recording fake in place of the
CUDA runtime; small sizes. Its numbers are NOT measurements (every row is labelled so): it only
shows that the script, the pin calls, the torch dense path and the offload work end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from moe_service.sizes import GiB, MiB  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class Row:
    section: str
    name: str
    value: str
    status: str  # PASS | FAIL | INFO
    detail: str = ""
    numbers: dict = field(default_factory=dict)


class Report:
    def __init__(self, dry_run: bool):
        self.rows: list[Row] = []
        self.dry_run = dry_run

    def add(self, section, name, value, status="INFO", detail="", **numbers) -> Row:
        if self.dry_run and status == "INFO" and numbers:
            detail = ("DRY RUN, not a measurement. " + detail).strip()
        row = Row(section, name, value, status, detail, numbers)
        self.rows.append(row)
        print(f"  {section:<8} {name:<34} {value:>14}  {status:<4} {detail}", file=sys.stderr, flush=True)
        return row

    def fail(self, section, name, err: BaseException | str) -> None:
        text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        if not isinstance(err, str):
            traceback.print_exception(err, file=sys.stderr)
        self.add(section, name, "-", "FAIL", text)

    @property
    def ok(self) -> bool:
        return all(r.status != "FAIL" for r in self.rows)

    def table(self) -> str:
        head = f"{'section':<8} {'check':<34} {'value':>14}  {'':<4} detail"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.section:<8} {r.name:<34} {r.value:>14}  {r.status:<4} {r.detail}")
        verdict = "all checks passed" if self.ok else f"{sum(r.status == 'FAIL' for r in self.rows)} check(s) FAILED"
        if self.dry_run:
            verdict += " (DRY RUN on the CPU: no number above is a measurement)"
        lines.append(verdict)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The CUDA runtime: real, or a recording fake for the dry run


class RecordingCudart:
    """Dry run stand-in for pipeline.pin.TorchCudart: accepts every call and records it."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("cudaHostRegister", ptr, size, flags))
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("cudaHostUnregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 1

    def cudaGetLastError(self):
        return 0

    def cudaGetErrorName(self, error):
        return "cudaSuccess" if error == 0 else f"cudaError{error}"

    def cudaGetErrorString(self, error):
        return "no error" if error == 0 else "error"

    def cudaDeviceGetAttribute(self, attr, device):
        return 0, 1

    def cudaGetDevice(self):
        return 0, 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# 1. H2D bandwidth from a placed region, pageable vs pinned


def placed_region(nbytes: int) -> np.ndarray:
    """An arena as fastload reserves one (moe_service.memory.reserve_arena: anonymous, 2 MiB
    aligned, THP advised), every page written, as a uint8 numpy array; give it back with
    memory.free_arena."""
    from moe_service import memory

    arr = memory.reserve_arena(nbytes)
    try:
        memory.madvise(memory.address_of(arr), nbytes, memory.MADV_HUGEPAGE)
    except OSError:
        pass
    pattern = (np.arange(MiB, dtype=np.uint32) % 251).astype(np.uint8)  # not page-periodic
    for at in range(0, nbytes, MiB):
        arr[at : at + MiB] = pattern[: min(MiB, nbytes - at)]
    return arr


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, device: torch.device, reps: int) -> float:
    """Median GB/s of ``dst.copy_(src, non_blocking=True)`` + synchronize (wall clock)."""
    dst.copy_(src, non_blocking=True)
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return src.numel() / statistics.median(times) / 1e9


def check_h2d(report: Report, device: torch.device, sizes_mib: list[int], reps: int) -> None:
    from moe_service import memory
    from moe_service.layout import Layout, Region
    from pipeline.pin import TorchCudart, flags_name, pin_chunks, plan_pin_chunks, register_flags

    for mib in sizes_mib:
        n = mib * MiB
        arr = placed_region(n)
        try:
            src = torch.from_numpy(arr)
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            pageable = copy_gbps(src, dst, device, reps)
            report.add("h2d", f"pageable {mib} MiB", f"{pageable:.1f} GB/s", numbers={"gbps": pageable, "bytes": n})
            rt = RecordingCudart() if device.type != "cuda" else TorchCudart()
            flags, why = register_flags(rt)
            layout = Layout([Region("bench", "primary", "local", (), 0, n, used_bytes=n)], n, {}, {})
            chunks = plan_pin_chunks(layout, 64 * GiB)
            t0 = time.perf_counter()
            pins = pin_chunks(rt, int(arr.ctypes.data), chunks, flags)
            pin_s = time.perf_counter() - t0
            try:
                pinned_flag = src.is_pinned() if device.type == "cuda" else None
                pinned = copy_gbps(src, dst, device, reps)
                # the bytes arrived intact
                ok = bool(torch.equal(dst[:4096].cpu(), src[:4096])) and bool(torch.equal(dst[-4096:].cpu(), src[-4096:]))
            finally:
                pins.unpin()
            report.add("h2d", f"pinned {mib} MiB", f"{pinned:.1f} GB/s",
                       detail=f"flags {flags} ({flags_name(flags)}: {why}); cudaHostRegister {pin_s * 1e3:.0f} ms"
                       + (f"; torch sees it pinned: {pinned_flag}" if pinned_flag is not None else ""),
                       numbers={"gbps": pinned, "bytes": n, "register_s": pin_s, "flags": flags})
            report.add("h2d", f"pinned/pageable {mib} MiB", f"{pinned / pageable:.2f}x",
                       numbers={"ratio": pinned / pageable})
            report.add("h2d", f"copy intact {mib} MiB", "yes" if ok else "NO", "PASS" if ok else "FAIL")
            if device.type != "cuda":
                expected = [("cudaHostRegister", int(arr.ctypes.data) + c.arena_offset, c.nbytes, flags) for c in chunks]
                got = [c for c in rt.calls if c[0] == "cudaHostRegister"]
                report.add("h2d", f"fake cudart calls {mib} MiB", f"{len(rt.calls)} calls",
                           "PASS" if got == expected and not rt.registered else "FAIL",
                           "register per chunk, unregister after (recorded, not executed)")
            del dst
        finally:
            del src
            memory.free_arena(arr)  # unmapped now, or with the last view still alive


# ---------------------------------------------------------------------------------------------
# The engine pieces (branches load, kernels/ops and oracle provide them)


def make_cpu_ops():
    """The CPU kernel backend as the engine stage builds it (every usable core, fused MoE)."""
    from moe_service.engine.ops import CpuOps
    from moe_service.numa import Topology

    return CpuOps(Topology.read(), threads=0, fused_moe=True)


def _engine():
    """(GGUFModel, WeightStore, make_cpu_ops, Model, ExpertOffload) or ImportError naming what
    is missing."""
    from moe_service.engine.model import Model
    from moe_service.engine.offload import ExpertOffload
    from moe_service.weights import WeightStore

    try:
        from moe_service.gguf_model import GGUFModel
    except ImportError as e:
        raise ImportError(f"moe_service.gguf_model (the catalog, branch load) is missing: {e}") from e
    try:
        import moe_service.engine.ops  # noqa: F401
        import moe_service.numa  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the CPU kernels (moe_service.engine.ops, moe_service.numa) are missing: {e}") from e
    return GGUFModel, WeightStore, make_cpu_ops, Model, ExpertOffload


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def greedy(model, ids: list[int], n: int) -> list[int]:
    s = model.kv.alloc()
    try:
        out = []
        logits = model.step([(s, ids)])
        for _ in range(n):
            t = int(logits[0].argmax())
            out.append(t)
            logits = model.step([(s, [t])])
        return out
    finally:
        model.kv.free(s)


def compare_paths(report: Report, label: str, path: Path, device: torch.device, prompt: list[int],
                  tol_rel_l2: float, n_greedy: int = 8) -> None:
    GGUFModel, WeightStore, CpuOps, Model, _ = _engine()  # noqa: N806
    catalog = GGUFModel.open(path)
    weights = WeightStore.load_simple(catalog)
    ops = CpuOps()
    n_ctx = len(prompt) + n_greedy + 8
    cpu = Model(catalog, weights, ops, device="cpu", dense="quant", n_seq=1, n_ctx=n_ctx)
    dev = Model(catalog, weights, ops, device=str(device), dense="torch", n_seq=1, n_ctx=n_ctx)
    s_cpu, s_dev = cpu.kv.alloc(), dev.kv.alloc()
    a = cpu.step([(s_cpu, prompt)])
    b = dev.step([(s_dev, prompt)])
    cpu.kv.free(s_cpu)
    dev.kv.free(s_dev)
    err = rel_l2(b, a)
    same_top1 = int(a[0].argmax()) == int(b[0].argmax())
    report.add("logits", f"{label}: rel L2 gpu vs cpu", f"{err:.2e}", "PASS" if err < tol_rel_l2 else "FAIL",
               f"tolerance {tol_rel_l2:g} (CPU path quantizes activations to 8 bits, as llama.cpp)",
               rel_l2=err)
    report.add("logits", f"{label}: top-1 agrees", "yes" if same_top1 else "no", "PASS" if same_top1 else "FAIL")
    ga, gb = greedy(cpu, prompt, n_greedy), greedy(dev, prompt, n_greedy)
    same = next((i for i, (x, y) in enumerate(zip(ga, gb, strict=True)) if x != y), n_greedy)
    report.add("logits", f"{label}: greedy tokens equal", f"{same}/{n_greedy}", "INFO",
               "a late divergence between near-tied logits is not an error", matched=same)


def check_logits(report: Report, device: torch.device, workdir: Path, dry_run: bool) -> None:
    # the embedded demo model (SmolLM2-135M as an 8-expert MoE, branch oracle)
    try:
        from moe_service.paths import demo_model_path

        demo = demo_model_path()
        if not demo.exists():
            from moe_service.demo_model import build_demo_model

            demo = build_demo_model()
        prompt = [1, 504, 3458, 282, 4649, 314, 2, 9, 100, 2000, 17, 5] * (1 if dry_run else 4)
        compare_paths(report, "demo", demo, device, prompt, tol_rel_l2=3e-2, n_greedy=4 if dry_run else 8)
    except Exception as e:
        report.fail("logits", "demo model", e)
    # a small synthetic qwen3moe with K-quant experts (moe_service.synth)
    try:
        from moe_service.synth import write_synthetic

        path = write_synthetic(workdir / "synth-small.gguf", "tiny-qwen3moe", expert_type="Q4_K")
        prompt = list(range(300, 300 + (16 if dry_run else 64)))
        compare_paths(report, "synthetic", path, device, prompt, tol_rel_l2=3e-2, n_greedy=4)
    except Exception as e:
        report.fail("logits", "synthetic MoE", e)


# ---------------------------------------------------------------------------------------------
# 3. prefill with and without the expert offload


def check_prefill(report: Report, device: torch.device, workdir: Path, prompt_tokens: int, n_layer: int,
                  dry_run: bool) -> None:
    GGUFModel, WeightStore, CpuOps, Model, ExpertOffload = _engine()  # noqa: N806
    from moe_service.synth import resolve_preset, write_synthetic

    # Qwen3-30B-A3B's layer shapes (128 experts of 768, top-8, hidden 2048), few layers
    preset = resolve_preset("tiny-qwen3moe" if dry_run else "qwen3-30b-a3b", n_layer=n_layer, expert_type="Q4_K")
    t0 = time.perf_counter()
    path = write_synthetic(workdir / "synth-prefill.gguf", preset)
    catalog = GGUFModel.open(path)
    weights = WeightStore.load_simple(catalog)
    report.add("prefill", "synthetic model", _size(catalog.total_bytes),
               detail=f"{preset.name}: {preset.arch}, {n_layer} layers, {preset.n_expert} experts of "
               f"{preset.n_ff_exp}, top-{preset.n_expert_used}, hidden {preset.n_embd}, {preset.expert_type} "
               f"experts; written and loaded in {time.perf_counter() - t0:.1f} s")
    ops = CpuOps()
    model = Model(catalog, weights, ops, device=str(device), dense="torch", n_seq=1, n_ctx=prompt_tokens + 64)
    offload = ExpertOffload.for_model(model, min_batch_tokens=min(2048, prompt_tokens))
    staging = offload.reserve()
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, preset.n_vocab, prompt_tokens)]

    def run(with_offload: bool, tokens: list[int] = prompt) -> tuple[float, torch.Tensor]:
        model.offload = offload if with_offload else None
        offload.forget()  # a real model has far more layers than two buffers: nothing stays staged
        s = model.kv.alloc()
        try:
            sync(device)
            t = time.perf_counter()
            logits = model.step([(s, tokens)])
            sync(device)
            return time.perf_counter() - t, logits
        finally:
            model.kv.free(s)

    results = {}
    for mode in (False, True):
        if mode:
            run(True)  # warm: cuBLAS handles, staging buffers touched, allocator pools grown
            before = (offload.stats.copied_bytes, offload.stats.copy_calls)
            secs, logits = min((run(True) for _ in range(2)), key=lambda r: r[0])
            per_run = ((offload.stats.copied_bytes - before[0]) // 2, (offload.stats.copy_calls - before[1]) // 2)
        else:  # the CPU path is the slow one: warm its kernels on a short prompt, time once
            run(False, prompt[:256])
            secs, logits = run(False)
        results[mode] = (secs, logits)
        report.add("prefill", f"{prompt_tokens} tokens, experts on {'GPU (offload)' if mode else 'CPU'}",
                   f"{prompt_tokens / secs:,.0f} tok/s", numbers={"tok_s": prompt_tokens / secs, "seconds": secs})
    speedup = results[False][0] / results[True][0]
    report.add("prefill", "offload speedup", f"{speedup:.2f}x", numbers={"speedup": speedup},
               detail=f"per prompt {_size(per_run[0])} copied H2D in {per_run[1]} calls, "
               f"staging {_size(staging)}, compute {offload.compute_dtype}")
    err = rel_l2(results[True][1], results[False][1])
    report.add("prefill", "rel L2 offload vs CPU experts", f"{err:.2e}", "PASS" if err < 5e-2 else "FAIL",
               "tolerance 5e-2 (bfloat16 GEMMs vs 8-bit activations on the CPU)", rel_l2=err)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default; fails without a CUDA device) or cpu (dry run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--h2d-mib", default=None, help="comma-separated region sizes in MiB (default 256,1024; dry run 8,32)")
    ap.add_argument("--reps", type=int, default=5, help="copies per H2D measurement (median reported)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prefill prompt length (default 4096; dry run 256)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the prefill model (default 4; dry run 2)")
    ap.add_argument("--only", default="h2d,logits,prefill", help="comma-separated sections to run")
    args = ap.parse_args(argv)

    dry_run = args.device == "cpu"
    if not dry_run:
        from moe_service.engine.device import cuda_absent_reason

        reason = cuda_absent_reason()
        if reason is not None:
            print(f"gpu_check: FAILED: no CUDA device ({reason}). This check measures a GPU host; "
                  f"use --device cpu for a dry run that is not a measurement.", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        name = "CPU (dry run: torch CPU tensors stand in for the GPU, a recording fake for cudart)"
    sizes = [int(s) for s in (args.h2d_mib or ("8,32" if dry_run else "256,1024")).split(",")]
    prompt_tokens = args.prompt_tokens or (256 if dry_run else 4096)
    layers = 2 if dry_run and args.layers == 4 else args.layers
    sections = set(args.only.split(","))

    report = Report(dry_run)
    print(f"gpu_check on {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"{os.cpu_count()} CPUs", file=sys.stderr)
    report.add("host", "device", name.split(" (")[0], detail=f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        if "h2d" in sections:
            try:
                check_h2d(report, device, sizes, args.reps)
            except Exception as e:
                report.fail("h2d", "bandwidth", e)
        if "logits" in sections:
            check_logits(report, device, workdir, dry_run)
        if "prefill" in sections:
            try:
                check_prefill(report, device, workdir, prompt_tokens, layers, dry_run)
            except Exception as e:
                report.fail("prefill", "offload on/off", e)
    report.add("host", "total time", f"{time.perf_counter() - t_all:.0f} s")
    if args.json:
        print(json.dumps({"device": name, "dry_run": dry_run, "ok": report.ok,
                          "rows": [asdict(r) for r in report.rows]}, indent=2))
    else:
        print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
