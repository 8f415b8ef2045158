"""ds4_ops: the compiled Sinkhorn normalisation, rms and rope are numpy's formulas bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import ds4_ops


def _numpy_sinkhorn(comb, iters, eps):
    """build_hc_sinkhorn as numpy calls (ds4_ops.sinkhorn's former body)."""
    c = comb.astype(np.float64)
    c = np.exp(c - c.max(axis=-1, keepdims=True))
    c = c / c.sum(axis=-1, keepdims=True) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(1, iters):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c.astype(np.float32)


@pytest.mark.parametrize("n_streams", [2, 3, 4, 7, 8, 9])
def test_sinkhorn_equals_numpy(n_streams):
    rng = np.random.default_rng(n_streams)
    for trial in range(200):
        T = int(rng.integers(1, 5))
        comb = (rng.standard_normal((T, n_streams, n_streams)) * rng.choice([0.1, 1.0, 5.0, 30.0])).astype(np.float32)
        iters, eps = int(rng.integers(1, 25)), float(rng.choice([1e-9, 1e-6, 1e-3]))
        got, want = ds4_ops.sinkhorn(comb, iters, eps), _numpy_sinkhorn(comb, iters, eps)
        assert np.array_equal(got, want), (n_streams, trial)


def _numpy_rms(x, eps):
    x = x.astype(np.float32)
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 64, 512), (3, 64, 512), (1, 16384), (2, 16384), (1, 512), (7, 128), (4, 37),
                                   (1, 3), (2, 1000), (1, 129), (1, 136)])
def test_rms_equals_numpy(shape):
    """The compiled rms sums the squares as numpy's pairwise summation does (8 interleaved
    sums up to 128 terms, halves split at multiples of 8 above), bit for bit."""
    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    for _ in range(10):
        x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)
        for eps in (1e-6, np.float32(1e-5)):
            assert np.array_equal(ds4_ops.rms(x, eps), _numpy_rms(x, eps)), (shape, eps)


def _numpy_rope_last(x, pos, cos, sin, inverse=False):
    x = x.astype(np.float32).copy()
    R = 2 * cos.shape[1]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    if inverse:
        s = -s
    a, b = x[..., -R::2].copy(), x[..., -R + 1::2].copy()
    x[..., -R::2] = a * c - b * s
    x[..., -R + 1::2] = a * s + b * c
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,half", [((1, 64, 512), 32), ((3, 8, 128), 32), ((2, 4, 64), 32), ((1, 2, 14), 7)])
def test_rope_last_equals_numpy(dtype, shape, half):
    rng = np.random.default_rng(half + shape[0])
    ang = rng.standard_normal((300, half)) * 10
    cos, sin = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
    for _ in range(10):
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        pos = rng.integers(0, 300, shape[0])
        for inverse in (False, True):
            assert np.array_equal(ds4_ops.rope_last(x, pos, cos, sin, inverse),
                                  _numpy_rope_last(x, pos, cos, sin, inverse))


def test_top_k_rows_breaks_ties_as_ggml_top_k():
    """The indexer's top-k keeps ggml's choice among equal scores (exact zeros from the ReLU are
    common): libstdc++'s std::partial_sort of the indices by score, greater first, as
    ggml_compute_forward_top_k_f32 runs it. Expected sets printed by that std::partial_sort
    (g++ 12); the lower-index rule would give {0, 4, 5}, {0, 3, 5}, {0, 3, 4} and {1, 4}."""
    from moe_service.engine.ds4_ops import top_k_rows

    rows = [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 2, 1, 0], [0, 0, 0, 1, 0, 2, 0, 0, 0],
            [-1, 0, 0, 0, 0.5, 0, 0, 0]]
    want = {2: [{0, 1}, {0, 3}, {4, 5}, {3, 5}, {2, 4}], 3: [{0, 1, 2}, {0, 1, 3}, {1, 4, 5}, {1, 3, 5}, {1, 3, 4}]}
    for k, sets in want.items():
        for row, expect in zip(rows, sets, strict=True):
            n = len(row)
            score = np.full((1, 12), -np.inf)
            score[0, :n] = row
            sel = top_k_rows(score, np.array([n]), k)
            assert set(np.flatnonzero(sel[0]).tolist()) == expect, (row, k)
    # fewer valid entries than k: all of them; the masked tail never
    sel = top_k_rows(np.array([[3.0, 1.0, 9.0, 9.0]]), np.array([2]), 3)
    assert sel.tolist() == [[True, True, False, False]]
    with pytest.raises(ValueError, match="top_k_rows"):
        top_k_rows(np.zeros((2, 4)), np.array([1]), 2)
