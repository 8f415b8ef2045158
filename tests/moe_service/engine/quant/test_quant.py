"""Block kernels against gguf-py (the exact reference for every format) and float64 math.

Tolerances (see also moe_service/engine/quant/):

- dequantize: bit-exact with gguf.quants.dequantize (same float32 operations, same order).
- activation quantization: bit-exact with what llama.cpp computes on x86 (Q8_0 / Q8_1: the
  AVX path, id = 127/amax and round half to even, re-derived here in numpy; Q8_K: the
  reference row, which x86 also runs). The portable _ref rows (and gguf-py's quantizer) use
  id = 1/d and roundf: the test below shows they differ, so the choice is deliberate.
- dot products against float64 of the *same* quantized activations: only float32 rounding
  differs (int32 block sums are exact; each block scale product and the lane-parallel
  float32 accumulation add ~2^-24 relative per step), so |err| <= 1e-6 * sum|w*a|.
- dot products against float64 of the *true* activations: additionally the 8-bit
  activation error, bounded per element by half a quantization step plus the f16 rounding
  of the block scale, so |err| <= sum_j |w_j| * e_j + 1e-6 * sum|w*x| (e_j per partner in
  ``_act_error_bound``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

from moe_service.engine import quant as q
from moe_service.errors import ModelFileError

ALL_TYPES = sorted(q.FORMATS)
NAMES = {t: q.FORMATS[t].name for t in ALL_TYPES}


def _ids(types):
    return [NAMES[t] for t in types]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_format_table_matches_gguf():
    for t, f in q.FORMATS.items():
        assert (f.block_elems, f.block_bytes) == GGML_QUANT_SIZES[G(t)], f.name
        assert f.name == G(t).name


def test_unknown_type_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="type 34 is not supported"):
        q.block_format(34)  # TQ1_0
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        q.row_bytes(q.GGML_Q4_K, 100)


@pytest.mark.parametrize("tid", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_dequantize_bit_exact_with_gguf(tid, rng):
    n_rows, n_cols = 5, 512
    raw = q.random_blocks(rng, tid, n_rows, n_cols)
    mine = q.dequantize(raw, tid, n_rows, n_cols)
    ref = np.asarray(gq.dequantize(raw.reshape(n_rows, -1), G(tid)), dtype=np.float32).reshape(n_rows, n_cols)
    assert np.array_equal(mine.view(np.uint32), ref.view(np.uint32))


def test_dequantize_rows_at_offset(rng):
    tid, n_rows, n_cols = q.GGML_Q4_K, 6, 256
    raw = q.random_blocks(rng, tid, n_rows, n_cols)
    arena = np.concatenate([np.zeros(100, np.uint8), raw])
    rows = np.array([4, 0, 4], dtype=np.int64)
    out = np.empty(3 * n_cols, np.float32)
    q.dequantize_rows(arena, 100, tid, n_cols, q.row_bytes(tid, n_cols), rows, out)
    full = q.dequantize(raw, tid, n_rows, n_cols)
    assert np.array_equal(out.reshape(3, n_cols), full[rows])


# ---------------------------------------------------------------------------------------
# Activation quantization (ggml-quants.c reference rows)


def _activations(rng, n_tok, n_cols):
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[0, 32:64] *= 1e-3  # a small block
    x[-1, -7] = 40.0  # an outlier
    return x


def _x86_q8(blocks):
    """ggml-cpu x86 quantize_row_q8_0/q8_1 in numpy: d = amax/127, id = 127/amax, rint."""
    amax = np.abs(blocks).max(axis=1).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    return d, np.rint(blocks * inv[:, None]).astype(np.int8)


def test_q8_0_bit_exact_with_ggml_x86(rng):
    x = _activations(rng, 3, 256)
    pa = q.quantize_activations(x, q.Partner.Q8_0)
    d, qs = _x86_q8(x.reshape(-1, 32))
    assert np.array_equal(pa.xd, d.astype(np.float16).astype(np.float32))
    assert np.array_equal(pa.xq, qs.reshape(-1))
    # where the two rules part: a tie (2.5 with amax 127 -> id 1) rounds to even on x86 (2),
    # away from zero in the portable reference row and gguf-py's quantizer (3)
    tie = np.zeros((1, 32), np.float32)
    tie[0, 0], tie[0, 1] = 127.0, 2.5
    assert q.quantize_activations(tie, q.Partner.Q8_0).xq[1] == 2
    assert gq.Q8_0.quantize_blocks(tie)[0, 2:].copy().view(np.int8)[1] == 3


def test_q8_1_matches_ggml_x86(rng):
    x = _activations(rng, 2, 128)
    pa = q.quantize_activations(x, q.Partner.Q8_1)
    blocks = x.reshape(-1, 32)
    d, qs = _x86_q8(blocks)
    assert np.array_equal(pa.xq, qs.reshape(-1))
    assert np.array_equal(pa.xd, d.astype(np.float16).astype(np.float32))
    s = (qs.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    assert np.array_equal(pa.xs, s)


def _q8_k_reference(x):
    """quantize_row_q8_K_ref in numpy: first max-magnitude element, iscale = -127/max,
    nearest_int (half to even), MIN(127, v), int16 16-sums, d = 1/iscale."""
    blocks = x.reshape(-1, 256)
    qs = np.zeros(blocks.shape, np.int8)
    d = np.zeros(len(blocks), np.float32)
    for i, b in enumerate(blocks):
        j = int(np.argmax(np.abs(b)))  # argmax returns the first maximum, as the strict > loop
        if b[j] == 0:
            continue
        iscale = np.float32(-127.0) / b[j]
        qs[i] = np.minimum(127, np.rint(iscale * b).astype(np.int32))
        d[i] = np.float32(1.0) / iscale
    bsums = qs.reshape(-1, 16).astype(np.int32).sum(axis=1).astype(np.int16)
    return qs.reshape(-1), d, bsums


def test_q8_k_matches_ggml_reference(rng):
    x = _activations(rng, 3, 512)
    x[1, :256] = 0.0  # all-zero super-block
    x[2, 3] = -x[2].__abs__().max() * 2  # the max-magnitude element negative
    pa = q.quantize_activations(x, q.Partner.Q8_K)
    qs, d, bsums = _q8_k_reference(x)
    assert np.array_equal(pa.xq, qs)
    assert np.array_equal(pa.xd, d)
    assert np.array_equal(pa.xbs, bsums)


def test_float_partners_round_like_ggml(rng):
    x = _activations(rng, 2, 64)
    assert np.array_equal(q.quantize_activations(x, q.Partner.F32).xf, x.reshape(-1))
    assert np.array_equal(q.quantize_activations(x, q.Partner.F16).xf,
                          x.astype(np.float16).astype(np.float32).reshape(-1))
    bf16 = gq.BF16.quantize_blocks(x.reshape(-1, 64)).view(np.uint16)  # ggml_compute_fp32_to_bf16
    assert np.array_equal(q.quantize_activations(x, q.Partner.BF16).xf,
                          (bf16.astype(np.uint32) << 16).view(np.float32).reshape(-1))


# ---------------------------------------------------------------------------------------
# Dot products / matmul


def _dequant_partner(pa, n_tok, n_cols):
    """The activation the kernels actually multiply with, in float64 [T, C]."""
    if pa.partner in (q.Partner.F32, q.Partner.F16, q.Partner.BF16):
        return pa.xf.reshape(n_tok, n_cols).astype(np.float64)
    blk = q.PARTNER_BLOCK[pa.partner]
    a = pa.xq.reshape(n_tok, n_cols // blk, blk).astype(np.float64) * pa.xd.reshape(n_tok, -1, 1)
    return a.reshape(n_tok, n_cols)


def _block_mins(raw, tid, n_rows, n_cols):
    """m of each 32-block of a Q4_1/Q5_1 tensor, float64 [n_rows, n_cols/32]."""
    f = q.FORMATS[tid]
    b = raw.reshape(n_rows, n_cols // 32, f.block_bytes)
    return b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def _reference_same_activation(raw, tid, n_rows, n_cols, pa, n_tok):
    """float64 W . a with the kernels' own quantized activation (and, for Q4_1/Q5_1, the
    same f16-rounded per-block sums s that ggml uses for the min term)."""
    w = np.asarray(gq.dequantize(raw.reshape(n_rows, -1), G(tid)), dtype=np.float64).reshape(n_rows, n_cols)
    a = _dequant_partner(pa, n_tok, n_cols)
    ref = a @ w.T
    if pa.partner == q.Partner.Q8_1:
        m = _block_mins(raw, tid, n_rows, n_cols)  # [N, B]
        asum = a.reshape(n_tok, -1, 32).sum(axis=2)  # [T, B]
        ref += (pa.xs.reshape(n_tok, -1).astype(np.float64) - asum) @ m.T
    scale = np.abs(a) @ np.abs(w).T
    return ref, scale, w


def _act_error_bound(x, partner):
    """Per-element bound e_j on |x_j - a_j| for the partner encoding of x float32 [T, C]."""
    x64 = np.abs(x.astype(np.float64))
    if partner == q.Partner.F32:
        return np.zeros_like(x64)
    if partner == q.Partner.F16:
        return x64 * 2.0**-11
    if partner == q.Partner.BF16:
        return x64 * 2.0**-8
    blk = q.PARTNER_BLOCK[partner]
    amax = x64.reshape(x.shape[0], -1, blk).max(axis=2, keepdims=True)
    d = amax / 127.0
    e = 0.5 * d * (1 + 1e-6)
    if partner in (q.Partner.Q8_0, q.Partner.Q8_1):
        e = e + 127.0 * d * 2.0**-11  # d is stored as float16
    return np.broadcast_to(e, (x.shape[0], x.shape[1] // blk, blk)).reshape(x.shape)


@pytest.mark.parametrize("n_tok", [1, 3, 4, 6])
@pytest.mark.parametrize("tid", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_matmul_against_float64(tid, n_tok, rng):
    n_rows, n_cols = 9, 1024
    raw = q.random_blocks(rng, tid, n_rows, n_cols)
    x = _activations(rng, n_tok, n_cols)
    y = q.matmul(raw, 0, tid, n_rows, n_cols, x)
    assert y.shape == (n_tok, n_rows) and y.dtype == np.float32

    pa = q.quantize_activations(x, q.FORMATS[tid].partner)
    ref, scale, w = _reference_same_activation(raw, tid, n_rows, n_cols, pa, n_tok)
    assert np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-30), "vs same quantized activations"

    e = _act_error_bound(x, pa.partner)
    bound = e @ np.abs(w).T + 1e-6 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    if pa.partner == q.Partner.Q8_1:  # the min term uses s = f16(d * sum q)
        m = np.abs(_block_mins(raw, tid, n_rows, n_cols))
        bound += (e.reshape(n_tok, -1, 32).sum(axis=2) + np.abs(pa.xs.reshape(n_tok, -1)) * 2.0**-10) @ m.T
    exact = x.astype(np.float64) @ w.T
    assert np.all(np.abs(y - exact) <= bound), "vs exact activations"


@pytest.mark.parametrize("tid", [q.GGML_Q8_0, q.GGML_Q4_K, q.GGML_Q6_K, q.GGML_Q4_1, q.GGML_F16],
                         ids=_ids([q.GGML_Q8_0, q.GGML_Q4_K, q.GGML_Q6_K, q.GGML_Q4_1, q.GGML_F16]))
def test_matmul_rows_items_and_row_range(tid, rng):
    """Row range, activation-row / output-row indirection (the MoE's token groups), an offset."""
    n_rows, n_cols, n_tok = 12, 512, 7
    raw = q.random_blocks(rng, tid, n_rows, n_cols)
    arena = np.concatenate([np.zeros(64, np.uint8), raw])
    x = _activations(rng, n_tok, n_cols)
    full = q.matmul(raw, 0, tid, n_rows, n_cols, x)
    pa = q.quantize_activations(x, q.FORMATS[tid].partner)
    a_rows = np.array([6, 2, 2, 0, 5, 1], dtype=np.int64)  # 4 + 2: both kernel shapes
    o_rows = np.array([0, 3, 1, 2, 5, 4], dtype=np.int64)
    out = np.full((6, 20), np.nan, np.float32)
    q.matmul_rows(arena, 64, tid, n_cols, q.row_bytes(tid, n_cols), 3, 10, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs,
                  a_rows, o_rows, out.reshape(-1), 20, 5, q.ensure_kernels([tid]))
    for a, o in zip(a_rows, o_rows, strict=True):
        assert np.array_equal(out[o, 5 + 3:5 + 10], full[a, 3:10])
    assert np.isnan(out[:, :8]).all() and np.isnan(out[:, 15:]).all()


def test_matmul_validates(rng):
    raw = q.random_blocks(rng, q.GGML_Q8_0, 4, 64)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="needs 272 bytes but the arena ends at 272"):
        q.matmul(raw, 34, q.GGML_Q8_0, 4, 64, x)  # starts 34 bytes in: runs past the end
    with pytest.raises(ValueError, match="activations have 32 columns"):
        q.matmul(raw, 0, q.GGML_Q8_0, 4, 64, np.zeros((1, 32), np.float32))
    with pytest.raises(ModelFileError):
        q.matmul(raw, 0, 34, 1, 256, np.zeros((1, 256), np.float32))  # TQ1_0
    with pytest.raises(ValueError, match="1-D C-contiguous uint8"):
        q.matmul(raw.view(np.int8), 0, q.GGML_Q8_0, 4, 64, x)


def test_activations_reused_across_tensors(rng):
    """One Activations serves several tensors of the same partner: quantized once."""
    x = _activations(rng, 2, 256)
    act = q.Activations(x)
    a = q.random_blocks(rng, q.GGML_Q4_K, 3, 256)
    b = q.random_blocks(rng, q.GGML_Q6_K, 5, 256)
    ya = q.matmul(a, 0, q.GGML_Q4_K, 3, 256, act)
    enc = act.encoded(q.Partner.Q8_K)
    yb = q.matmul(b, 0, q.GGML_Q6_K, 5, 256, act)
    assert act.encoded(q.Partner.Q8_K) is enc
    assert np.array_equal(ya, q.matmul(a, 0, q.GGML_Q4_K, 3, 256, x))
    assert np.array_equal(yb, q.matmul(b, 0, q.GGML_Q6_K, 5, 256, x))


_ISA_SNIPPET = """
import numpy as np, sys
from moe_service.engine import quant as q
assert q._AVX512 is False
rng = np.random.default_rng(77)
out = []
for t in (q.GGML_Q4_K, q.GGML_Q5_K, q.GGML_Q6_K, q.GGML_Q2_K, q.GGML_Q3_K, q.GGML_IQ4_XS):
    raw = q.random_blocks(rng, t, 6, 512)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    out.append(q.matmul(raw, 0, t, 6, 512, x))
np.save(sys.argv[1], np.stack(out))
"""


@pytest.mark.skipif(not q._AVX512, reason="this host runs the AVX2 K-quant code already")
def test_avx2_k_quant_path_matches_avx512(tmp_path):
    """The K-quant kernels have a 512-bit and a 256-bit form; their int32 sums are exact, so
    results must be bit-identical. Runs the AVX2 form in a subprocess with its own cache."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MOE_SERVICE_KERNEL_ISA="avx2", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(q.__file__).parents[3]), env.get("PYTHONPATH", "")])
    dst = tmp_path / "avx2.npy"
    subprocess.run([sys.executable, "-c", _ISA_SNIPPET, str(dst)], env=env, check=True, timeout=600)
    rng = np.random.default_rng(77)
    mine = []
    for t in (q.GGML_Q4_K, q.GGML_Q5_K, q.GGML_Q6_K, q.GGML_Q2_K, q.GGML_Q3_K, q.GGML_IQ4_XS):
        raw = q.random_blocks(rng, t, 6, 512)
        x = rng.standard_normal((5, 512)).astype(np.float32)
        mine.append(q.matmul(raw, 0, t, 6, 512, x))
    assert np.array_equal(np.load(dst), np.stack(mine))
