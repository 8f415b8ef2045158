"""A/B of the grid i-quants' unpacked multi-item matmul (AVX2): row by row
(quant/tiles_iq.mmq_unpacked) against the row x item blocks of quant/tiles_iq_blocked.py with
1 x 8 and 2 x 4 tiles, alternated in one run; one thread, CPU time (time.thread_time), ns per
32 weights per item (best and median of --repeats); the outputs' digests must agree.

Command (shapes ROWS:COLS:ITEMS; DeepSeek-V3's gate/up at a 128-token step: 7168 columns, ~64
items per expert)::

    PYTHONPATH=. python bench/unpacked_ab.py --format IQ2_XXS 512:7168:64 512:7168:128 512:2048:64
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="ROWS:COLS:ITEMS (COLS a multiple of 256)")
    ap.add_argument("--format", default="IQ2_XXS", help="a grid i-quant (tiles_k.UNPACKED)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)

    from numba import njit

    from moe_service.engine import quant as q
    from moe_service.engine.quant.tiles_iq import mmq_unpacked
    from moe_service.engine.quant.tiles_iq_blocked import blocked, item_block
    from moe_service.engine.quant.tiles_k import UNPACKED

    tid = q.BY_NAME[a.format].type_id
    if tid not in UNPACKED:
        print(
            f"unpacked_ab: {a.format} has no unpacked path on this CPU (AVX2 grid i-quants only)",
            file=sys.stderr,
        )
        return 2

    # the format id as a compile-time constant (the tiles take it as a literal)
    fmt = tid

    @njit(nogil=True)
    def rows(arena, rb, nb, n_rows, xq, xd, xbs, ar, orow, out):
        mmq_unpacked(fmt, arena, 0, rb, nb, 0, n_rows, xq, xd, xbs, ar, orow, ar.shape[0], out, n_rows, 0)

    @njit(nogil=True)
    def blk(tile_rows, ib, arena, rb, nb, n_rows, xq, xd, xbs, ar, orow, out):
        blocked(
            fmt,
            tile_rows,
            arena,
            0,
            rb,
            nb,
            0,
            n_rows,
            xq,
            xd,
            xbs,
            ar,
            orow,
            ar.shape[0],
            out,
            n_rows,
            0,
            ib,
        )

    for spec in a.shapes:
        n_rows, n_cols, n_items = (int(v) for v in spec.split(":"))
        rng = np.random.default_rng(1)
        raw = q.random_blocks(rng, tid, n_rows, n_cols)
        n_tok = max(128, n_items)
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        pa = q.quantize_activations(x, q.FORMATS[tid].partner)
        ar = np.sort(rng.choice(n_tok, n_items, replace=False)).astype(np.int64)
        orow = np.arange(n_items, dtype=np.int64)
        nb, rb = n_cols // 256, q.row_bytes(tid, n_cols)
        ib = item_block(nb)
        common = (raw, rb, nb, n_rows, pa.xq, pa.xd, pa.xbs, ar, orow)
        variants = {"rows": (rows, ()), "blocked 1x8": (blk, (1, ib)), "blocked 2x4": (blk, (2, ib))}
        digests = set()
        for fn, pre in variants.values():
            y = np.zeros(n_items * n_rows, np.float32)
            fn(*pre, *common, y)
            digests.add(hashlib.sha256(y.tobytes()).hexdigest()[:12])
        times: dict[str, list[float]] = {k: [] for k in variants}
        y = np.zeros(n_items * n_rows, np.float32)
        for _ in range(a.repeats):
            for k, (fn, pre) in variants.items():
                t0 = time.thread_time()
                fn(*pre, *common, y)
                times[k].append(time.thread_time() - t0)
        w = n_rows * n_cols / 32 * n_items
        cells = "  ".join(
            f"{k} {min(v) * 1e9 / w:.3f} / {float(np.median(v)) * 1e9 / w:.3f}" for k, v in times.items()
        )
        same = "same bits" if len(digests) == 1 else f"DIGESTS DIFFER {sorted(digests)}"
        print(
            f"{a.format} {n_rows} x {n_cols}, {n_items} items (item block {ib}): ns per 32 weights per item, "
            f"best / median: {cells}  ({same})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
