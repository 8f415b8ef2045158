"""The weight-streaming matvecs of one DeepSeek V4-Flash decode layer, alone: GB/s against the
host's read bandwidth and against the kernels' own compute ceiling (issue 25's floor target).

`bench.ds4_parts` times a real layer by part; this takes the parts that stream weights out of
the layer, so what remains of their gap to the read bandwidth is the kernels' and the pool's
(not the layer's numpy glue, hyper-connections or attention). The shapes are the V4-Flash
pair file's ratio-128 layer (deepseek-v4-flash-L4-c8bebc79ad.gguf, blk.1):

- the attention projections, Q8_0, dispatched as `arch.deepseek4._attention` groups them:
  attn_q_a + attn_kv + attn_compressor_kv + attn_compressor_gate (4096 columns, one dispatch),
  attn_q_b (32768 x 1024), attn_output_a (its 8 groups of 1024 x 4096, as one 8192 x 4096
  matrix: the same bytes), attn_output_b (4096 x 8192): 118.1 MB;
- the shared expert, Q8_0, as `CpuPath.glu_ffn`: gate + up (2 x 2048 x 4096) then down
  (4096 x 2048): 26.7 MB;
- 6 routed MXFP4 experts of 2048 x 4096 (gate, up) and 4096 x 2048 (down) as two dispatches
  (all gate/up rows, then all down rows; the fused MoE step adds its activation and combine
  phases in between): 80.2 MB.

Each group is timed by its own pool dispatch, a one-token activation, weights streamed from
memory (the 225 MB set is far above the L3, and each group is read after the others). Per
group: median ms over ``repeats`` passes, GB/s, and the share of the read bandwidth. The
compute ceiling of a format is ``threads`` x one thread's hot-L2 rate (bench.kernels
hot_ns_per_block_token at the group's column count): a group whose GB/s is near it is bound
by the kernel's arithmetic, not by memory.

Run (quiet host): ``PYTHONPATH=. python -m bench.v4_matvecs --threads 2 --repeats 20``.
Timings move with the host's load; compare trees alternated in one window."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from bench import kernels as bk
from moe_service.engine import quant as q
from moe_service.engine.pool import WorkerPool
from moe_service.formats import BY_NAME

Q8_0 = BY_NAME["Q8_0"].type_id
MXFP4 = BY_NAME["MXFP4"].type_id
N_EXPERT_USED = 6

GROUPS: tuple[tuple[str, int, tuple[tuple[int, int], ...]], ...] = (
    ("attn q_a+kv+compressor", Q8_0, ((1024, 4096), (512, 4096), (512, 4096), (512, 4096))),
    ("attn q_b", Q8_0, ((32768, 1024),)),
    ("attn output_a", Q8_0, ((8192, 4096),)),
    ("attn output_b", Q8_0, ((4096, 8192),)),
    ("shared gate+up", Q8_0, ((2048, 4096), (2048, 4096))),
    ("shared down", Q8_0, ((4096, 2048),)),
    ("experts gate+up", MXFP4, ((2048, 4096),) * (2 * N_EXPERT_USED)),
    ("experts down", MXFP4, ((4096, 2048),) * N_EXPERT_USED),
)
"""(name, GGML type, ((rows, columns) per tensor)) per pool dispatch, in the layer's order."""


def build(row_scale: float = 1.0, rng=None) -> tuple[np.ndarray, list[tuple[str, int, tuple, int]]]:
    """One arena holding every group's tensors (random valid blocks; rows x row_scale, at least
    16 per tensor); returns (arena, [(name, type, tensor refs (offset, type, rows, cols), bytes)])."""
    rng = np.random.default_rng(0) if rng is None else rng
    parts, plan, off = [], [], 0
    for name, tid, shapes in GROUPS:
        refs, nbytes = [], 0
        for rows, cols in shapes:
            r = max(16, int(rows * row_scale))
            block = bk.make_rows(tid, r, cols, rng)
            parts.append(block)
            refs.append((off, tid, r, cols))
            off += block.nbytes
            nbytes += block.nbytes
        plan.append((name, tid, tuple(refs), nbytes))
    arena = np.concatenate(parts)
    return arena, plan


def run(
    threads: int = 2, repeats: int = 20, row_scale: float = 1.0, hot_calls: int = 300, bandwidth: bool = True
) -> dict:
    """Time every group (see the module docstring); returns a dict of the figures (ms, GB/s,
    shares) and the compute ceilings. ValueError for threads < 1 or repeats < 1."""
    if threads < 1 or repeats < 1:
        raise ValueError(f"threads and repeats must be >= 1 (got {threads}, {repeats})")
    rng = np.random.default_rng(0)
    arena, plan = build(row_scale, rng)
    xs = [rng.standard_normal((1, refs[0][3])).astype(np.float32) for _, _, refs, _ in plan]
    pool = WorkerPool(n_threads=threads, pin_caller=threads > 1)
    try:
        for (_, _, refs, _), x in zip(plan, xs, strict=True):  # plans and kernels built
            pool.matmul(arena, refs, x)
        bw0 = bk.memory_bandwidth_gbps(threads) if bandwidth else float("nan")
        times = np.empty((repeats, len(plan)))
        for r in range(repeats):
            for g, ((_, _, refs, _), x) in enumerate(zip(plan, xs, strict=True)):
                t0 = time.perf_counter()
                pool.matmul(arena, refs, x)
                times[r, g] = time.perf_counter() - t0
        bw1 = bk.memory_bandwidth_gbps(threads) if bandwidth else float("nan")
    finally:
        pool.close()
    bw = max(bw0, bw1)
    ceiling = {}
    for tid in {tid for _, tid, _, _ in plan}:
        for cols in sorted({refs[0][3] for _, t, refs, _ in plan if t == tid}):
            rows = max(64, (256 * 2048) // cols)
            ns = bk.hot_ns_per_block_token(tid, rows, cols, 1, rng, hot_calls)
            fmt = q.FORMATS[tid]
            ceiling[f"{fmt.name} {cols}"] = {"hot_ns_per_32": ns, "gbps": threads * fmt.block_bytes / ns}
    groups = []
    for g, (name, tid, refs, nbytes) in enumerate(plan):
        med = float(np.median(times[:, g]))
        gbps = nbytes / med / 1e9
        groups.append(
            {
                "name": name,
                "format": q.FORMATS[tid].name,
                "mb": nbytes / 1e6,
                "median_ms": med * 1e3,
                "min_ms": float(times[:, g].min()) * 1e3,
                "gbps": gbps,
                "share_of_bandwidth": gbps / bw,
                "ceiling_gbps": ceiling[f"{q.FORMATS[tid].name} {refs[0][3]}"]["gbps"],
            }
        )
    total_mb = sum(g["mb"] for g in groups)
    total_ms = sum(g["median_ms"] for g in groups)
    return {
        "threads": threads,
        "repeats": repeats,
        "row_scale": row_scale,
        "bandwidth_gbps": [bw0, bw1],
        "groups": groups,
        "ceilings": ceiling,
        "total_mb": total_mb,
        "total_ms": total_ms,
        "floor_ms": total_mb / bw if bw == bw else float("nan"),
        "load_avg": os.getloadavg(),
    }


def format_table(r: dict) -> str:
    bw0, bw1 = r["bandwidth_gbps"]
    lines = [
        f"V4-Flash layer matvecs, {r['threads']} thread(s), one token, medians of {r['repeats']} passes; "
        f"read bandwidth {bw0:.1f} / {bw1:.1f} GB/s (before / after), load average "
        f"{r['load_avg'][0]:.2f}",
        f"{'group':24s} {'format':6s} {'MB':>7s} {'ms':>7s} {'GB/s':>6s} {'of bw':>6s} {'kernel ceiling':>15s}",
    ]
    for g in r["groups"]:
        lines.append(
            f"{g['name']:24s} {g['format']:6s} {g['mb']:7.1f} {g['median_ms']:7.3f} {g['gbps']:6.1f} "
            f"{g['share_of_bandwidth']:6.2f} {g['ceiling_gbps']:10.1f} GB/s"
        )
    lines.append(
        f"{'total':24s} {'':6s} {r['total_mb']:7.1f} {r['total_ms']:7.3f} "
        f"{r['total_mb'] / r['total_ms']:6.1f}   (floor at the bandwidth: {r['floor_ms']:.3f} ms)"
    )
    lines.append(
        "kernel ceiling = threads x one thread's hot-L2 rate: "
        + ", ".join(
            f"{k} {v['hot_ns_per_32']:.3f} ns per 32 weights" for k, v in sorted(r["ceilings"].items())
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--row-scale", type=float, default=1.0, help="rows x this (smaller shapes for a quick look)"
    )
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or not 0 < args.row_scale <= 1:
        print("v4_matvecs: --threads and --repeats must be >= 1, --row-scale in (0, 1]", file=sys.stderr)
        return 2
    r = run(args.threads, args.repeats, args.row_scale)
    print(format_table(r))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(r, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
