"""Block-kernel throughput against the machine's memory read bandwidth.

Reports, per weight format: GB/s of weight bytes streamed by the matmul kernels for T=1
(decode matvec) and T=4 (each block unpacked once for 4 activation rows), on 1 thread
(the kernel called directly) and on N threads (the WorkerPool splitting rows); the memory
read bandwidth of this machine on 1 and N threads (a numba reduction over 1 GiB); the
round-trip cost of an empty pool dispatch; and the cold compile time of the engine's numba
code (fresh NUMBA_CACHE_DIR, in a subprocess) next to the warm (cached) start.

    PYTHONPATH=. python bench/kernels.py                    # everything, default formats
    PYTHONPATH=. python bench/kernels.py --formats Q8_0,Q4_K --tokens 1 --threads 1,2
    PYTHONPATH=. python bench/kernels.py --json out.json    # also write the numbers

Tensors are ~256 MiB (well past the L3 cache) of random valid blocks, rows of 2048
columns. Speed numbers are only meaningful on an otherwise idle machine: the report
prints the load average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from numba import njit

from moe_service.engine import quant as q
from moe_service.engine.pool import Job, WorkerPool

DEFAULT_FORMATS = "Q8_0,Q4_K,Q4_1,Q6_K,Q4_0,Q5_K,Q5_0,Q5_1,MXFP4,F16,BF16,F32"
BY_NAME = {f.name: t for t, f in q.FORMATS.items()}


@njit(nogil=True, cache=True)
def _sum_u64(a, lo, hi):
    s = np.uint64(0)
    for i in range(lo, hi):
        s += a[i]
    return s


def memory_bandwidth_gbps(n_threads: int, gib: float = 1.0, repeats: int = 3) -> float:
    """Read bandwidth: n_threads numba reductions over disjoint parts of a `gib` GiB array."""
    a = np.ones(int(gib * (1 << 30)) // 8, np.uint64)
    _sum_u64(a, 0, 1024)
    bounds = np.linspace(0, a.size, n_threads + 1).astype(np.int64)
    best = float("inf")
    for _ in range(repeats):
        ts = [threading.Thread(target=_sum_u64, args=(a, int(bounds[i]), int(bounds[i + 1])))
              for i in range(n_threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def numpy_sum_gbps(gib: float = 1.0) -> float:
    a = np.ones(int(gib * (1 << 30)) // 8, np.float64)
    a.sum()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def make_tensor(tid: int, n_cols: int, mib: int, rng) -> tuple[np.ndarray, int]:
    """~mib MiB of random valid ``tid`` rows (64 distinct rows tiled: building is cheap)."""
    rb = q.row_bytes(tid, n_cols)
    n_rows = max(64, (mib << 20) // rb)
    tile = q.random_blocks(rng, tid, 64, n_cols)
    arena = np.empty(n_rows * rb, np.uint8)
    for r in range(0, n_rows, 64):
        m = min(64, n_rows - r)
        arena[r * rb: (r + m) * rb] = tile[: m * rb]
    return arena, n_rows


def kernel_gbps(tid: int, arena: np.ndarray, n_rows: int, n_cols: int, n_tok: int, rng, repeats: int) -> float:
    """Single thread: quant.matmul_rows over the whole tensor (no pool)."""
    rb = q.row_bytes(tid, n_cols)
    pa = q.quantize_activations(rng.standard_normal((n_tok, n_cols)).astype(np.float32), q.FORMATS[tid].partner)
    rows = np.arange(n_tok, dtype=np.int64)
    out = np.empty(n_tok * n_rows, np.float32)
    args = (arena, 0, tid, n_cols, rb, 0, n_rows, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, rows, rows, out, n_rows, 0,
            q.ensure_kernels([tid]))
    q.matmul_rows(*args)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        q.matmul_rows(*args)
        best = min(best, time.perf_counter() - t0)
    return arena.nbytes / best / 1e9


def pool_gbps(pool: WorkerPool, tid: int, arena: np.ndarray, n_rows: int, n_cols: int, n_tok: int, rng,
              repeats: int) -> float:
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    tens = [(0, tid, n_rows, n_cols)]
    pool.matmul(arena, tens, x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool.matmul(arena, tens, x)
        best = min(best, time.perf_counter() - t0)
    return arena.nbytes / best / 1e9


def dispatch_us(pool: WorkerPool, n: int = 20000) -> float:
    """Round trip of an empty job (one no-op item): publish, take part, wait."""
    job = Job.build([[[(0,)]]], np.zeros(1, np.int64))
    for _ in range(100):
        pool.run(job)
    t0 = time.perf_counter()
    for _ in range(n):
        pool.run(job)
    return (time.perf_counter() - t0) / n * 1e6


_COMPILE_SNIPPET = r"""
import time, numpy as np
t0 = time.perf_counter()
from moe_service.engine import quant as q, moe as M
from moe_service.engine.pool import WorkerPool
t_import = time.perf_counter() - t0
rng = np.random.default_rng(0)
with WorkerPool(pin_caller=False) as pool:
    for t in q.FORMATS:                                   # every format, both kernel shapes
        a = q.random_blocks(rng, t, 8, 256)
        for n_tok in (1, 5):
            pool.matmul(a, [(0, t, 8, 256)], rng.standard_normal((n_tok, 256)).astype(np.float32))
    parts = [q.random_blocks(rng, q.GGML_Q8_0, 256, 256) for _ in range(12)]
    arena = np.concatenate(parts)
    rb = q.row_bytes(q.GGML_Q8_0, 256) * 256
    cp = lambda k: (np.arange(4 * k, 4 * k + 4, dtype=np.int64).reshape(4, 1) * rb, np.zeros((4, 1), np.int32))
    ex = M.ExpertWeights(4, 256, 256, {"gate": 8, "up": 8, "down": 8}, {"gate": cp(0), "up": cp(1), "down": cp(2)})
    M.MoE(pool).forward(arena, rng.standard_normal((2, 256)).astype(np.float32), np.array([[0, 1], [2, 3]], np.int32),
                        np.full((2, 2), 0.5, np.float32), ex)
print(f"{t_import:.2f} {time.perf_counter() - t0:.2f}")
"""


def compile_seconds() -> dict[str, float]:
    """Cold (empty cache) and warm (cached) time to import and run every engine kernel once."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="numba-cold-") as d:
        env["NUMBA_CACHE_DIR"] = d
        res = {}
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET], env=env, capture_output=True, text=True,
                                 check=True)
            t_import, total = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
            res[f"{label}_s"] = total
            res[f"{label}_import_s"] = t_import
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}")
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the cold compile measurement")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    formats = [BY_NAME[n.strip().upper()] for n in args.formats.split(",") if n.strip()]
    tokens = [int(v) for v in args.tokens.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    rng = np.random.default_rng(0)
    res: dict = {"load_avg_start": os.getloadavg(), "cpus": sorted(os.sched_getaffinity(0))}

    print(f"load average at start: {res['load_avg_start']}")
    res["memory_gbps"] = {n: memory_bandwidth_gbps(n) for n in threads}
    res["numpy_sum_gbps"] = numpy_sum_gbps()
    for n, v in res["memory_gbps"].items():
        print(f"memory read bandwidth, {n} thread(s): {v:6.1f} GB/s")
    print(f"numpy sum over 1 GiB (1 thread):      {res['numpy_sum_gbps']:6.1f} GB/s")

    pools = {n: WorkerPool(n_threads=n, pin_caller=False) for n in threads if n > 1}
    try:
        res["dispatch_us"] = {1: dispatch_us(WorkerPool(n_threads=1, pin_caller=False))}
        for n, p in pools.items():
            res["dispatch_us"][n] = dispatch_us(p)
        for n, v in res["dispatch_us"].items():
            print(f"empty dispatch round trip, {n} worker(s): {v:6.2f} us")

        res["kernels_gbps"] = {}
        header = "format  " + "".join(f"  T={t} {n}thr" for t in tokens for n in threads)
        print(f"\nGB/s of weight bytes (rows of {args.cols} columns, {args.mib} MiB tensors)")
        print(header)
        for tid in formats:
            name = q.FORMATS[tid].name
            arena, n_rows = make_tensor(tid, args.cols, args.mib, rng)
            row = {}
            line = f"{name:7s} "
            for t in tokens:
                for n in threads:
                    if n == 1:
                        v = kernel_gbps(tid, arena, n_rows, args.cols, t, rng, args.repeats)
                    else:
                        v = pool_gbps(pools[n], tid, arena, n_rows, args.cols, t, rng, args.repeats)
                    row[f"T{t}_{n}thr"] = v
                    line += f"  {v:10.1f}"
            res["kernels_gbps"][name] = row
            print(line, flush=True)
            del arena
    finally:
        for p in pools.values():
            p.close()
    if not args.no_compile:
        res["compile"] = compile_seconds()
        c = res["compile"]
        print(f"\nengine numba code, import + first run of every kernel: cold {c['cold_s']:.1f} s "
              f"(import {c['cold_import_s']:.1f} s), warm from cache {c['warm_s']:.1f} s")
    res["load_avg_end"] = os.getloadavg()
    print(f"load average at end: {res['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
