"""The tiled matmul kernels: bit-identical results whatever the tiling, the token count or the ISA.

quant.matmul_rows computes weight rows in tiles (4 rows x 4/2/1 items on AVX-512 VNNI, 1
row on AVX2). Every row's float32 steps follow one fixed per-lane order, so:

- ``RECORDED``: sha256 digests of the outputs of a fixed set of matmuls per format (weights
  and activations from a counter-based generator, no numpy RNG stream involved), recorded
  from the kernels before tiling (one-row kernels, main at 557e4a5). Any change to the
  numerics of any format shows up here, on this host's ISA and (in a subprocess) on the
  AVX2 code. (F16/BF16 dot products are summed in the order LLVM's vectorizer picks
  under the kernels' reassoc flag, which depends on the host CPU: ``FLOAT_RECORDED`` holds
  their digests from an AVX-512 VNNI host and from an AVX2-only host (AMD EPYC), and a
  numba/LLVM upgrade may move them.)
- a row's result does not depend on which tile it lands in: a T-token matmul equals T
  one-token matmuls bit for bit, for row ranges that start and end off the tile grid, with
  activation/output row indirection (the MoE's token groups) and repeated items.

Run as a script (``python tests/moe_service/engine/quant/test_quant_tiles.py``) it prints the digests of the
current kernels as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_service.engine import quant as q
from moe_service.engine.quant.tiles32 import SCALE_CHUNK

ALL_TYPES = sorted(q.FORMATS)
NAMES = {t: q.FORMATS[t].name for t in ALL_TYPES}

# sha256(outputs)[:16] per format, from the one-row kernels before tiling (see module doc).
RECORDED = {
    "F32": "98fd28f88ad847b1", "F16": "c813e0f575cfe004", "Q4_0": "d3c45de6a41db9a2",
    "Q4_1": "c8e03e00075c8757", "Q5_0": "992046dbf52145b0", "Q5_1": "ac15f893c759efe5",
    "Q8_0": "ece95a51908e5b18", "Q4_K": "f2828244dd77151c", "Q5_K": "6da3e98f3dc51ad4",
    "Q6_K": "1c8cff244759131f", "BF16": "1b61783ed388b217", "MXFP4": "aab4b25310807aaf",
    # recorded on an AVX2-only host (their kernels were written tiled; the AVX-512 VNNI form
    # must give the same bits, test_avx2_code_matches_the_recorded_one_row_kernels' converse)
    "IQ4_NL": "ee03d348835c0eb4", "IQ2_XXS": "3d7c19b3b55931d1", "IQ2_XS": "14c56da1b131f287",
    "IQ2_S": "d48ec4e6b2116f80", "IQ3_XXS": "1d6b8a593a28fc15", "IQ3_S": "fba611ac6acae77f",
    "IQ1_S": "7be750a6ff04da85", "IQ1_M": "12d621d02f4b8950",
}

# F16/BF16: LLVM vectorizes the float kernels for the host CPU it compiles on, so their
# sums run in that host's order (F32 sums in ggml's fixed 16-lane order, ir.dot_f32_ggml,
# the same on every host): one of these digests per format (the first from the AVX-512
# VNNI host of RECORDED, the second from an AVX2-only AMD EPYC host).
FLOAT_RECORDED = {
    "F16": ("c813e0f575cfe004", "2209ee0bdbceea10"),
    "BF16": ("1b61783ed388b217", "ad7fa1913311dab1"),
}


def matches_recorded(got: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The formats whose digest is not a recorded one: name -> (got, *recorded)."""
    bad = {}
    for name, want in RECORDED.items():
        allowed = FLOAT_RECORDED.get(name, (want,))
        if got.get(name) not in allowed:
            bad[name] = (got.get(name, "missing"), *allowed)
    return bad


def _u32(n: int, seed: int) -> np.ndarray:
    """n pseudo-random uint32 from a counter (splitmix64 finalizer): stable across numpy versions."""
    with np.errstate(over="ignore"):
        x = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(32)).astype(np.uint32)


def _unit(n: int, seed: int) -> np.ndarray:
    """n float64 in [-0.5, 0.5)."""
    return _u32(n, seed).astype(np.float64) / 2.0**32 - 0.5


def det_blocks(tid: int, n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    """A valid tensor of ``tid`` (like quant.random_blocks) from the counter generator."""
    f = q.FORMATS[tid]
    nb = n_cols // f.block_elems
    if f.block_elems == 1:
        x = (_unit(n_rows * n_cols, seed) * 4).astype(np.float32)
        if tid == q.GGML_F32:
            return x.view(np.uint8)
        if tid == q.GGML_F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = (_u32(n_rows * nb * f.block_bytes, seed) & 0xFF).astype(np.uint8).reshape(n_rows, nb, f.block_bytes)
    for i, off in enumerate(f.f16_offsets):
        v = (_unit(n_rows * nb, seed + 101 + i) * 0.02).astype(np.float16)
        raw[:, :, off:off + 2] = v.view(np.uint8).reshape(n_rows, nb, 2)
    if tid == q.GGML_MXFP4:
        raw[:, :, 0] = (118 + _u32(n_rows * nb, seed + 7) % 10).reshape(n_rows, nb)
    if tid == q.GGML_IQ1_M:  # its f16 d is spread over the scale words' top nibbles
        q.set_iq1m_d(raw.reshape(-1, f.block_bytes), (_unit(n_rows * nb, seed + 101) * 0.02).astype(np.float16))
    return raw.reshape(-1)


def det_activations(n_tok: int, n_cols: int, seed: int) -> np.ndarray:
    """float32 [n_tok, n_cols] with rows of different scales and (row 2) an all-zero row."""
    x = _unit(n_tok * n_cols, seed).reshape(n_tok, n_cols) * (1.0 + np.arange(n_tok)[:, None] % 5)
    if n_tok > 2:
        x[2] = 0.0
    return x.astype(np.float32)


def digest_outputs() -> dict[str, str]:
    """The digests of RECORDED for the kernels of this process."""
    out = {}
    for name in RECORDED:
        f = q.BY_NAME[name]
        tid = f.type_id
        h = hashlib.sha256()
        # an odd and an even number of blocks per row (32-element formats pair blocks)
        cols = (96, 128) if f.block_elems == 1 else ((2 * f.block_elems * 5 + f.block_elems), 4 * f.block_elems)
        for n_cols in cols:
            n_rows = 11
            raw = det_blocks(tid, n_rows, n_cols, seed=tid * 31 + n_cols)
            for n_tok in (1, 4, 7):
                x = det_activations(n_tok, n_cols, seed=1000 + tid + n_tok)
                h.update(q.matmul(raw, 0, tid, n_rows, n_cols, x).tobytes())
            x = det_activations(6, n_cols, seed=2000 + tid)
            pa = q.quantize_activations(x, f.partner)
            a_rows = np.array([5, 0, 3, 3, 1], np.int64)
            o_rows = np.array([2, 4, 0, 1, 3], np.int64)
            y = np.zeros((5, 16), np.float32)
            q.matmul_rows(raw, 0, tid, n_cols, q.row_bytes(tid, n_cols), 1, 10, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs,
                          a_rows, o_rows, y.reshape(-1), 16, 3, q.ensure_kernels([tid]))
            h.update(y.tobytes())
        out[f.name] = h.hexdigest()[:16]
    return out


def test_outputs_match_the_recorded_one_row_kernels():
    assert matches_recorded(digest_outputs()) == {}


@pytest.mark.skipif(not q._AVX512, reason="this host runs the AVX2 code already (covered above)")
def test_avx2_code_matches_the_recorded_one_row_kernels(tmp_path):
    """The AVX2 form of every kernel (a subprocess with MOE_SERVICE_KERNEL_ISA=avx2 and its
    own numba cache) gives the recorded digests too."""
    env = dict(os.environ, MOE_SERVICE_KERNEL_ISA="avx2", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(q.__file__).parents[3]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, __file__], env=env, check=True, timeout=600, capture_output=True, text=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got.pop("isa") == "avx2"
    assert matches_recorded(got) == {}


@pytest.mark.parametrize("n_blocks", [3, 2 * SCALE_CHUNK + 13], ids=["3-blocks", "chunks+13"])
@pytest.mark.parametrize("tid", ALL_TYPES, ids=[NAMES[t] for t in ALL_TYPES])
def test_row_result_does_not_depend_on_its_tile(tid, n_blocks):
    """T tokens at once == T single-token matmuls, over row ranges off the tile grid, with
    indirection and a repeated item; exact float32 equality. 2 x SCALE_CHUNK + 13 blocks:
    the AVX2 multi-item tiles' scale products over two whole chunks and an odd tail of
    eight-block groups plus single blocks (tiles32.SCALE_CHUNK)."""
    f = q.FORMATS[tid]
    n_rows, n_cols, n_tok = 14, n_blocks * max(f.block_elems, 32), 9
    raw = det_blocks(tid, n_rows, n_cols, seed=tid)
    x = det_activations(n_tok, n_cols, seed=50 + tid)
    single = np.stack([q.matmul(raw, 0, tid, n_rows, n_cols, x[t:t + 1])[0] for t in range(n_tok)])
    assert np.array_equal(q.matmul(raw, 0, tid, n_rows, n_cols, x).view(np.uint32), single.view(np.uint32))
    pa = q.quantize_activations(x, f.partner)
    rb = q.row_bytes(tid, n_cols)
    kernels = q.ensure_kernels([tid])
    for lo, hi, a_rows in ((3, 14, [8, 1, 1, 4, 0, 7, 2]), (1, 6, [5, 6, 3]), (0, 13, [2, 0, 8, 5, 6])):
        a = np.array(a_rows, np.int64)
        o = np.arange(len(a_rows), dtype=np.int64)[::-1].copy()
        y = np.full((len(a_rows), n_rows), np.nan, np.float32)
        q.matmul_rows(raw, 0, tid, n_cols, rb, lo, hi, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, a, o, y.reshape(-1),
                      n_rows, 0, kernels)
        for i, (ai, oi) in enumerate(zip(a, o, strict=True)):
            assert np.array_equal(y[oi, lo:hi].view(np.uint32), single[ai, lo:hi].view(np.uint32)), (lo, hi, i)
            assert np.isnan(y[oi, :lo]).all() and np.isnan(y[oi, hi:]).all()


@pytest.mark.parametrize("tid", [q.GGML_Q8_0, q.GGML_Q4_K], ids=["Q8_0", "Q4_K"])
def test_a_row_range_shorter_than_a_tile_writes_only_its_rows(tid):
    """3 rows x 2 items into a buffer with guard floats on both sides: the tile loop must not
    run a 4-row tile past row_hi (nothing written outside the 6 outputs)."""
    f = q.FORMATS[tid]
    n_cols = 2 * f.block_elems
    raw = det_blocks(tid, 3, n_cols, seed=5)
    pa = q.quantize_activations(det_activations(2, n_cols, seed=6), f.partner)
    buf = np.full(32, 12345.0, np.float32)
    rows = np.arange(2, dtype=np.int64)
    q.matmul_rows(raw, 0, tid, n_cols, q.row_bytes(tid, n_cols), 0, 3, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, rows,
                  rows, buf[8:14], 3, 0, q.ensure_kernels([tid]))
    assert (buf[:8] == 12345.0).all() and (buf[14:] == 12345.0).all()
    assert not (buf[8:14] == 12345.0).any()


if __name__ == "__main__":
    d = digest_outputs()
    d["isa"] = "avx512-vnni" if q._AVX512 else "avx2"
    print(json.dumps(d))


@pytest.mark.parametrize("tid", [q.GGML_Q6_K, q.GGML_Q4_K], ids=["Q6_K", "Q4_K"])
def test_item_and_row_blocks_give_the_one_token_results(tid):
    """More items than one item block of table._mmq_blocked (29 super-blocks a row: blocks of
    8 items; rows in blocks of ~32): T tokens at once, over a row range off the block grid,
    with indirection and repeated items, == one-token matmuls bit for bit."""
    f = q.FORMATS[tid]
    n_rows, n_cols, n_tok = 75, 29 * f.block_elems, 21
    raw = det_blocks(tid, n_rows, n_cols, seed=7 + tid)
    x = det_activations(n_tok, n_cols, seed=70 + tid)
    single = np.stack([q.matmul(raw, 0, tid, n_rows, n_cols, x[t:t + 1])[0] for t in range(n_tok)])
    assert np.array_equal(q.matmul(raw, 0, tid, n_rows, n_cols, x).view(np.uint32), single.view(np.uint32))
    pa = q.quantize_activations(x, f.partner)
    a = np.array([(7 * i + 3) % n_tok for i in range(37)], np.int64)
    o = np.arange(len(a), dtype=np.int64)[::-1].copy()
    y = np.full((len(a), n_rows), np.nan, np.float32)
    lo, hi = 3, 71
    q.matmul_rows(raw, 0, tid, n_cols, q.row_bytes(tid, n_cols), lo, hi, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, a, o,
                  y.reshape(-1), n_rows, 0, q.ensure_kernels([tid]))
    for i, (ai, oi) in enumerate(zip(a, o, strict=True)):
        assert np.array_equal(y[oi, lo:hi].view(np.uint32), single[ai, lo:hi].view(np.uint32)), i
        assert np.isnan(y[oi, :lo]).all() and np.isnan(y[oi, hi:]).all()
