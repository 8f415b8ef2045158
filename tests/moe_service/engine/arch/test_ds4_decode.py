"""ds4_decode: a decode step's pooled forms give the bits of ds4_compiled's one-thread kernels
(which tests/moe_service/engine/arch/test_ds4_compiled.py compares with the numpy
references)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import ds4_compiled as dc
from moe_service.engine import ds4_decode as dd
from moe_service.engine import ds4_ops
from moe_service.engine.pool import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(n_threads=2, pin_caller=False)
    yield p
    p.close()


@pytest.mark.parametrize("C, H, shares", [(4, 4096, 2), (4, 256, 3), (2, 96, 2), (3, 40, 5)])
def test_hc_pre_one_is_hc_pre_bit_for_bit(C, H, shares, pool):
    """The split table's shares (12 columns a share at V4's 4 streams, 8 at 3 shares, and a
    share count that is not a register width) sum each mix as the one-thread kernel does."""
    rng = np.random.default_rng(C * H + shares)
    M = (2 + C) * C
    x = (rng.standard_normal((1, C, H)) * rng.choice([0.5, 3.0])).astype(np.float32)
    fn = (rng.standard_normal((M, C * H)) / np.sqrt(C * H) * 4).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = (rng.standard_normal(M) * 2.0).astype(np.float32)
    table = dc.mix_table(fn)
    want = dc.hc_pre(x, table, scale, base, 1e-6, 1e-6, 20)
    ref = ds4_ops.hc_pre(x, fn.astype(np.float64), scale, base, 1e-6, 1e-6, 20)
    assert np.allclose(want[0], ref[0], rtol=1e-5, atol=1e-6)  # the kernel is the formula
    one = dd.HcPreOne(table, shares, 1e-6)
    for _ in range(2):  # the job's scratch reused
        got = one(x, scale, base, 1e-6, 20, pool)
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))


def test_hc_pre_one_refuses_what_does_not_fit(pool):
    table = np.zeros((64, 24), np.float32)
    with pytest.raises(ValueError, match="float32 mixing table"):
        dd.HcPreOne(table.astype(np.float64), 2, 1e-6)
    with pytest.raises(ValueError, match="shares"):
        dd.HcPreOne(table, 5, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        dd.HcPreOne(table, 2, 1e-6)(np.zeros((2, 4, 16), np.float32), np.ones(3), np.zeros(24), 1e-6, 20, pool)
