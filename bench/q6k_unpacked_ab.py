"""A/B of Q6_K's multi-item matmul (AVX2): table._mmq (the tiles over the GGUF blocks, today's
path) against quant/tiles_q6_unpacked.mmq_q6_unpacked (unpacked rows, 2 x 4 tiles), alternated in
one run; one thread, CPU time (time.thread_time), ns per 32 weights per item (best/median of
REPEATS), the median ratio, and whether the outputs' digests agree.

    PYTHONPATH=. python bench/q6k_unpacked_ab.py 5 512:1536:128 512:16384:128 512:7168:128
"""

import hashlib
import sys
import time

import numpy as np
from numba import njit

from moe_service.engine import quant as q
from moe_service.engine.quant import table as tb
from moe_service.engine.quant.tiles_q6_unpacked import Q6_K, mmq_q6_unpacked

fmt = Q6_K


@njit(nogil=True)
def today(arena, rb, nb, n_rows, xq, xd, xbs, ar, orow, out):
    tb._mmq(fmt, False, arena, 0, rb, nb, 0, n_rows, xq, xd, xbs, ar, orow, ar.shape[0], out, n_rows, 0)


@njit(nogil=True)
def unp(arena, rb, nb, n_rows, xq, xd, xbs, ar, orow, out):
    mmq_q6_unpacked(arena, 0, rb, nb, 0, n_rows, xq, xd, xbs, ar, orow, ar.shape[0], out, n_rows, 0)


reps = int(sys.argv[1])
for spec in sys.argv[2:]:
    n_rows, n_cols, n_items = map(int, spec.split(":"))
    rng = np.random.default_rng(1)
    raw = q.random_blocks(rng, Q6_K, n_rows, n_cols)
    x = rng.standard_normal((max(128, n_items), n_cols)).astype(np.float32)
    pa = q.quantize_activations(x, q.FORMATS[Q6_K].partner)
    ar = np.arange(n_items, dtype=np.int64)
    nb = n_cols // 256
    rb = q.row_bytes(Q6_K, n_cols)
    vs = {"today": today, "unp": unp}
    dig = {}
    for k, f in vs.items():
        y = np.zeros(n_items * n_rows, np.float32)
        f(raw, rb, nb, n_rows, pa.xq, pa.xd, pa.xbs, ar, ar, y)
        dig[k] = hashlib.sha256(y.tobytes()).hexdigest()[:10]
    ts = {k: [] for k in vs}
    y = np.zeros(n_items * n_rows, np.float32)
    for _ in range(reps):
        for k, f in vs.items():
            t0 = time.thread_time()
            f(raw, rb, nb, n_rows, pa.xq, pa.xd, pa.xbs, ar, ar, y)
            ts[k].append(time.thread_time() - t0)
    w = n_rows * n_cols / 32 * n_items
    a, b = np.median(ts["today"]), np.median(ts["unp"])
    print(
        spec,
        " ".join(f"{k} {min(v) * 1e9 / w:.3f}/{np.median(v) * 1e9 / w:.3f}" for k, v in ts.items()),
        f"median ratio {b / a:.3f}",
        "same" if len(set(dig.values())) == 1 else f"DIFF {dig}",
        flush=True,
    )
