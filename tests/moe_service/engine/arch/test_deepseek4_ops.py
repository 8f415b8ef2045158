"""ds4_ops: the compiled Sinkhorn normalisation is numpy's formula bit for bit."""

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
