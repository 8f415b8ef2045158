"""The fused MoE step (moe.MoE.forward on the worker pool) on real expert shapes, side by side.

Per shape (v3: DeepSeek-V3 experts, hidden 7168, width 2048, Q4_K, top-8, 64 experts as
ds2's bench file; oss: gpt-oss-120b, hidden 2880, 128 experts of 2880, MXFP4, top-4, clamped
SwiGLU; qwen3-q4k / qwen3-q8: Qwen3-30B-A3B, hidden 2048, 128 experts of 768, top-8;
smollm2-moe: the demo model's 8 experts of 192, Q4_1) and tokens per step T: the median
wall time of one MoE step over random routings (``--stat min``: the least-disturbed step),
the GB/s of expert bytes it streams (the distinct experts chosen, each read once), GMAC/s
(T*K*3*H*I multiply-adds: gate, up, down per (token, slot)), the fastest step, and the
median process CPU time of a step (all threads; with ``--threads 1`` the caller is the only
worker, so time the OS gives to other processes does not count). Several MoE configurations
(``--variants``) are timed interleaved step by step in one process, so a busy machine affects
them alike; the memory read bandwidth is measured in the same run.

The experts are random valid blocks (64 distinct rows tiled) in one huge-page arena, as the
engine's weights; ``--built`` of them (default min(E, 16 + 2K)), the other expert ids alias
them. At T=1 consecutive steps use disjoint experts, so a step's weights come from DRAM.

    PYTHONPATH=. python bench/moe_shapes.py --shape v3 --tokens 1,128 --threads 2
    PYTHONPATH=. python bench/moe_shapes.py --shape v3,oss --tokens 1,16 --steps 60 \
        --variants old=4:16:0,new=default       # max_item_bytes 0 vs the default, interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from moe_service.engine import quant as q
from moe_service.engine.moe import ExpertWeights, MoE
from moe_service.engine.pool import WorkerPool
from moe_service.memory import reserve_thp_arena

BY_NAME = {f.name: t for t, f in q.FORMATS.items()}

SHAPES = {
    "v3": dict(hidden=7168, width=2048, top_k=8, n_expert=64, type="Q4_K", act=0),
    "oss": dict(hidden=2880, width=2880, top_k=4, n_expert=128, type="MXFP4", act=1),
    "qwen3-q4k": dict(hidden=2048, width=768, top_k=8, n_expert=128, type="Q4_K", act=0),
    "qwen3-q8": dict(hidden=2048, width=768, top_k=8, n_expert=128, type="Q8_0", act=0),
    # the demo model: SmolLM2-135M cut into 8 experts of 192, all chosen (cache-resident)
    "smollm2-moe": dict(hidden=576, width=192, top_k=8, n_expert=8, type="Q4_1", act=0),
}


def build(shape: dict, n_built: int, rng) -> tuple[np.ndarray, ExpertWeights, int]:
    """An arena with n_built experts (gate, up, down each [E] slabs); the ExpertWeights
    lists shape['n_expert'] experts whose slabs repeat the built ones cyclically (routing
    spreads over the full expert count; bytes stay bounded). Returns (arena, experts,
    bytes per expert)."""
    t = BY_NAME[shape["type"]]
    h, w = shape["hidden"], shape["width"]
    rb_gu, rb_d = q.row_bytes(t, h), q.row_bytes(t, w)
    per = 2 * w * rb_gu + h * rb_d
    arena = reserve_thp_arena(n_built * per)
    tile_gu = q.random_blocks(rng, t, 64, h)
    tile_d = q.random_blocks(rng, t, 64, w)
    for e in range(n_built):
        base = e * per
        for r in range(0, 2 * w, 64):
            m = min(64, 2 * w - r)
            arena[base + r * rb_gu: base + (r + m) * rb_gu] = tile_gu[: m * rb_gu]
        base += 2 * w * rb_gu
        for r in range(0, h, 64):
            m = min(64, h - r)
            arena[base + r * rb_d: base + (r + m) * rb_d] = tile_d[: m * rb_d]
    n_e = shape["n_expert"]
    src = np.arange(n_e) % n_built
    g = (src * per).astype(np.int64).reshape(n_e, 1)
    u = g + w * rb_gu
    d = g + 2 * w * rb_gu
    z = np.zeros((n_e, 1), np.int32)
    ex = ExpertWeights(n_e, h, w, {"gate": t, "up": t, "down": t}, {"gate": (g, z), "up": (u, z), "down": (d, z)})
    ex.act = shape["act"]
    return arena, ex, per


def routings(shape: dict, n_tok: int, n: int, n_built: int, rng) -> list[np.ndarray]:
    """n random routings [T, K]; at T=1 consecutive steps use disjoint built experts (so a
    step's experts were not just read: the L3 holds < 2 V3 experts)."""
    k, n_e = shape["top_k"], shape["n_expert"]
    out = []
    for i in range(n):
        if n_tok == 1 and n_built >= 2 * k:
            base = (i * k) % (n_built - n_built % k)
            out.append(((base + np.arange(k)) % n_built).reshape(1, k).astype(np.int32))
        else:
            out.append(np.stack([rng.choice(n_e, k, replace=False) for _ in range(n_tok)]).astype(np.int32))
    return out


def step_bytes(ids: np.ndarray, per: int) -> int:
    return len(np.unique(ids)) * per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="v3")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--built", type=int, default=0, help="experts built (0: min(E, 16 + 2K))")
    ap.add_argument("--variants", default="default",
                    help="comma list of name=chunks_per_worker:min_chunk_rows[:max_item_KiB] (or 'default', or name=default)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="median (default) or min over the steps (min: the least-disturbed step on a busy machine)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    res = {"load_avg_start": os.getloadavg(), "rows": []}
    print(f"load average at start: {res['load_avg_start']}", flush=True)
    variants = {}
    for v in args.variants.split(","):
        if v == "default":
            variants["default"] = {}
        else:
            name, spec = v.split("=")
            if spec == "default":
                variants[name] = {}
                continue
            c, m, b = (spec.split(":") + ["0"])[:3]
            variants[name] = dict(chunks_per_worker=int(c), min_chunk_rows=int(m), max_item_bytes=int(b) << 10)
    from bench.kernels import memory_bandwidth_gbps
    bw = memory_bandwidth_gbps(args.threads, gib=0.5)
    res["memory_gbps"] = bw
    print(f"memory read bandwidth, {args.threads} thread(s): {bw:.1f} GB/s", flush=True)
    pool = WorkerPool(n_threads=args.threads, pin_caller=False)
    try:
        for sname in args.shape.split(","):
            shape = SHAPES[sname]
            n_built = args.built or min(shape["n_expert"], 16 + 2 * shape["top_k"])
            arena, ex, per = build(shape, n_built, rng)
            moes = {k: MoE(pool, **v) for k, v in variants.items()}
            for n_tok in (int(t) for t in args.tokens.split(",")):
                x = rng.standard_normal((n_tok, shape["hidden"])).astype(np.float32)
                w = np.full((n_tok, shape["top_k"]), 1.0 / shape["top_k"], np.float32)
                rts = routings(shape, n_tok, args.steps + 1, n_built, rng)
                times = {k: [] for k in moes}
                cpu = {k: [] for k in moes}
                for m in moes.values():  # warm (compile, scratch)
                    m.forward(arena, x, rts[0], w, ex)
                for i in range(1, len(rts)):
                    for k, m in moes.items():
                        t0, c0 = time.perf_counter(), time.process_time()
                        m.forward(arena, x, rts[i], w, ex)
                        times[k].append(time.perf_counter() - t0)
                        cpu[k].append(time.process_time() - c0)
                nbytes = statistics.median(step_bytes(r, per) for r in rts[1:])
                macs = n_tok * shape["top_k"] * 3 * shape["hidden"] * shape["width"]
                for k in moes:
                    med = statistics.median(times[k]) if args.stat == "median" else min(times[k])
                    cpu_med = statistics.median(cpu[k])
                    row = {"shape": sname, "variant": k, "T": n_tok, "ms": med * 1e3,
                           "gbps": nbytes / med / 1e9, "gmacs": macs / med / 1e9, "bw_frac": nbytes / med / 1e9 / bw,
                           "cpu_ms": cpu_med * 1e3, "wall_min_ms": min(times[k]) * 1e3}
                    res["rows"].append(row)
                    print(f"{sname:10s} {k:10s} T={n_tok:4d} {med * 1e3:9.2f} ms  {row['gbps']:6.2f} GB/s "
                          f"({row['bw_frac']:.2f} of read bw)  {row['gmacs']:6.2f} GMAC/s | wall min {min(times[k]) * 1e3:8.2f} ms, "
                          f"CPU {cpu_med * 1e3:8.2f} ms (median)", flush=True)
            del arena
    finally:
        pool.close()
    res["load_avg_end"] = os.getloadavg()
    print(f"load average at end: {res['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
