"""ds4_compiled: each compiled deepseek4 op against the numpy reference it replaces
(moe_service.engine.ds4_ops / arch.deepseek4), on random inputs of the real and toy shapes;
a row's result does not depend on the rows beside it nor on the worker pool."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import ds4_compiled as dc
from moe_service.engine import ds4_ops
from moe_service.engine.pool import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(n_threads=2, pin_caller=False)
    yield p
    p.close()


def _attn_case(rng, T, NH, D, Nw, Nc, window_frac=0.7, comp_frac=0.4):
    q = (rng.standard_normal((T, NH, D)) * 0.3).astype(np.float16).astype(np.float32)
    win = (rng.standard_normal((Nw, D)) * 2.0).astype(np.float16)
    comp = (rng.standard_normal((Nc, D)) * 2.0).astype(np.float16)
    mw = rng.random((T, Nw)) < window_frac
    mw[:, -1] = True  # every query sees itself
    mc = rng.random((T, Nc)) < comp_frac
    sinks = rng.standard_normal(NH).astype(np.float32)
    return q, win, comp, mw, mc, sinks


@pytest.mark.parametrize(
    "T, NH, D, Nw, Nc",
    [
        (1, 64, 512, 128, 512),
        (1, 8, 128, 20, 0),
        (5, 8, 128, 40, 37),
        (3, 64, 512, 130, 300),
        (1, 4, 64, 1, 1),
    ],
)
def test_attend_rows_is_attend_sinks_on_the_concatenated_keys(T, NH, D, Nw, Nc, pool):
    rng = np.random.default_rng(T * 1000 + Nw + Nc)
    q, win, comp, mw, mc, sinks = _attn_case(rng, T, NH, D, Nw, Nc)
    scale = 1.0 / np.sqrt(D)
    want = ds4_ops.attend_sinks(
        q, np.concatenate([win, comp]).astype(np.float32), np.concatenate([mw, mc], axis=1), sinks, scale
    )
    got = dc.attend_rows(q, win, comp if Nc else None, mw, mc if Nc else None, sinks, scale)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # the pool's split gives the same bits, and a row alone gives the same bits as in the batch
    assert np.array_equal(
        dc.attend_rows(q, win, comp if Nc else None, mw, mc if Nc else None, sinks, scale, pool), got
    )
    for t in range(T):
        alone = dc.attend_rows(
            q[t : t + 1],
            win,
            comp if Nc else None,
            mw[t : t + 1],
            mc[t : t + 1] if Nc else None,
            sinks,
            scale,
        )
        assert np.array_equal(alone[0], got[t])


def test_attend_rows_refuses_shapes_that_do_not_agree():
    rng = np.random.default_rng(0)
    q, win, comp, mw, mc, sinks = _attn_case(rng, 2, 4, 64, 10, 5)
    with pytest.raises(ValueError, match="do not agree"):
        dc.attend_rows(q, win, comp, mw[:, :5], mc, sinks, 0.125)
