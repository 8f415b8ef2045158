"""A DeepSeek V4 decode step's pooled one-token kernels (moe_service.engine.ds4_decode) against
the calling-thread sequence they replace (ds4_compiled), alternated in one process on a
2-worker pool, each call after an eviction pass (a pool job writing ``--evict-mib`` MiB on every
worker: the caches as the layer's weight streaming leaves them, the workers awake as inside
a layer). Both give the same bits (tests/moe_service/engine/arch/test_ds4_decode.py).

    hc_pre       ds4_compiled.hc_pre (one token, the calling thread) against
                 ds4_decode.HcPreOne (the mixing table's columns split over the workers)
    attention    heads_inplace(q) + ds4_compiled.attend_one + heads_inplace(out) against
                 ds4_decode.attend_one (gather by row ranges, q / attention / inverse rope
                 by heads, one job), at the ratio-4 layer's key counts for depths 512 and
                 4096 (window 128 + 128 compressed rows; + 512 selected) and the ratio-128
                 layer's at 512 (128 + 4)

V4-Flash shapes: 4 streams x 4096, 64 heads of 512, rope 64. Milliseconds per call: median,
25th percentile and minimum (the host's load moves the median; compare within one run)::

    PYTHONPATH=. python -m bench.ds4_decode_kernels [--reps 60] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from numba import carray, njit

from moe_service.engine import ds4_compiled as dc
from moe_service.engine import ds4_decode as dd
from moe_service.engine import pool as _pool
from moe_service.engine.quant.ir import view_f32


@njit(nogil=True, cache=True)
def _touch(a):
    for i in range(0, a.shape[0], 16):  # one write per 64-byte line
        a[i] += 1.0


def _evict_item(items_ptr, i, op_ptr):
    """Elements [it[2], it[3]) of the eviction buffer (op[0]) written (a K_CALL item)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, 1)
    b = i * _pool.ITEM_W
    _touch(view_f32(op[0] + it[b + 2] * 4, it[b + 3] - it[b + 2]))


def _main_sequence(case: tuple) -> None:
    """main's one-token attention: q prepared, ds4_compiled.attend_one, the inverse rope."""
    q, ring, lo, n0, new, comp, sel, sinks, cos, sin, pool = case
    p = np.array([n0])
    qq = dc.heads_inplace(q.copy()[None], p, cos, sin, 1e-6, True)
    o = dc.attend_one(qq, ring, lo, n0, new, comp, sel, sinks, 0.04, pool)
    dc.heads_inplace(np.ascontiguousarray(o), p, cos, sin, 1e-6, False)


def _fused(case: tuple) -> None:
    """The same in one pool job (ds4_decode.attend_one)."""
    q, ring, lo, n0, new, comp, sel, sinks, cos, sin, pool = case
    dd.attend_one(q.copy(), n0, cos, sin, 1e-6, ring, lo, n0, new, comp, sel, sinks, 0.04, pool)


def _stats(ts: list[float]) -> dict[str, float]:
    a = np.array(ts) * 1e3
    return {"median_ms": float(np.median(a)), "p25_ms": float(np.percentile(a, 25)), "min_ms": float(a.min())}


def run(reps: int = 60, threads: int = 2, evict_mib: int = 96, heads: int = 64, head_dim: int = 512) -> dict:
    """{case: {"main": stats, "ds4_decode": stats}} (see the module docstring)."""
    pool = _pool.WorkerPool(n_threads=threads, pin_caller=False)
    try:
        big = np.zeros(evict_mib << 18, np.float32)
        n = big.size
        fn = _pool.call_item_address(_evict_item)
        step = -(-n // threads)
        items = [(_pool.K_CALL, fn, a, min(n, a + step)) for a in range(0, n, step)]
        ev = _pool.Job.build([_pool._spread(items, pool.n_nodes)], np.array([big.ctypes.data], np.int64))

        def timed(f: Callable[[], object]) -> float:
            pool.run_arrays(ev.items, ev.bounds, ev.op)
            t0 = time.perf_counter()
            f()
            return time.perf_counter() - t0

        rng = np.random.default_rng(0)
        out: dict[str, dict] = {}
        C, H = 4, 4096
        M = (2 + C) * C
        x = (rng.standard_normal((1, C, H)) * 2).astype(np.float32)
        table = dc.mix_table((rng.standard_normal((M, C * H)) / np.sqrt(C * H) * 4).astype(np.float32))
        scale = np.array([0.5, 0.6, 0.7], np.float32)
        base = rng.standard_normal(M).astype(np.float32)
        one = dd.HcPreOne(table, threads, 1e-6, pool.n_nodes)
        a_t: list[float] = []
        b_t: list[float] = []
        for _ in range(reps):
            a_t.append(timed(lambda: dc.hc_pre(x, table, scale, base, 1e-6, 1e-6, 20)))
            b_t.append(timed(lambda: one(x, scale, base, 1e-6, 20, pool)))
        out["hc_pre"] = {"main": _stats(a_t), "ds4_decode": _stats(b_t)}
        NH, D, W = heads, head_dim, 128
        for label, n0, n_comp, n_sel in (
            ("attention 256 keys (ratio 4, depth 512)", 512, 128, 0),
            ("attention 640 keys (ratio 4, depth 4096)", 4096, 1024, 512),
            ("attention 132 keys (ratio 128, depth 512)", 512, 4, 0),
        ):
            q = (rng.standard_normal((NH, D)) * 2).astype(np.float32)
            ring = rng.standard_normal((W, D)).astype(np.float16)
            new = ring[0].copy()
            comp = rng.standard_normal((n_comp, D)).astype(np.float16)
            sel = np.sort(rng.choice(n_comp, n_sel, replace=False)) if n_sel else None
            ang = rng.random((n0 + 1, 32)).astype(np.float32) * 6
            cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
            sinks = rng.standard_normal(NH).astype(np.float32)
            lo = n0 - W + 1

            case = (q, ring, lo, n0, new, comp, sel, sinks, cos, sin, pool)
            a_t, b_t = [], []
            for _ in range(reps):
                a_t.append(timed(partial(_main_sequence, case)))
                b_t.append(timed(partial(_fused, case)))
            out[label] = {"main": _stats(a_t), "ds4_decode": _stats(b_t)}
        return {"threads": threads, "reps": reps, "load_average": list(os.getloadavg()), "cases": out}
    finally:
        pool.close()


def format_table(r: dict) -> str:
    lines = [
        f"V4 one-token kernels, {r['threads']} workers, {r['reps']} calls each, cold caches, "
        f"load average {r['load_average'][0]:.2f}; ms per call: median / p25 / min",
        f"{'case':44s}{'calling thread (main)':>26s}{'ds4_decode (pooled)':>26s}",
    ]
    for case, v in r["cases"].items():
        a, b = v["main"], v["ds4_decode"]
        lines.append(
            f"{case:44s}{a['median_ms']:10.3f}{a['p25_ms']:8.3f}{a['min_ms']:8.3f}"
            f"{b['median_ms']:10.3f}{b['p25_ms']:8.3f}{b['min_ms']:8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.ds4_decode_kernels", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--reps", type=int, default=60, help="calls of each form per case")
    ap.add_argument("--threads", type=int, default=2, help="pool workers, the caller included (>= 2)")
    ap.add_argument("--evict-mib", type=int, default=96, help="MiB written before each call (> the L3)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    a = ap.parse_args(argv)
    if a.threads < 2 or a.reps < 1 or a.evict_mib < 1:
        print("bench.ds4_decode_kernels: --threads >= 2, --reps >= 1, --evict-mib >= 1", file=sys.stderr)
        return 2
    r = run(a.reps, a.threads, a.evict_mib)
    print(format_table(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
