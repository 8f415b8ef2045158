"""DeepSeek V4 one-token (decode) work outside the matmuls spread over the worker pool, where
:mod:`moe_service.engine.ds4_compiled` runs a one-token step on the calling thread.

The hyper-connection pre mix of one token (:func:`hc_pre_one`): its cost in a decode step is
reading the mixing table (C*H x M float32, 1.5 MB for V4-Flash's 4 x 4096 x 24) from memory,
since the layer's weight streaming has evicted it since the last step. One thread reads it
at ~10 GB/s; :class:`HcPreOne` gives each worker the table's columns of its own share, stored
apart (each worker streams only its bytes), and every mix is summed by the same code as
``ds4_compiled.hc_pre`` sums it (float64 products added in k order from 0: the same bits; the
sigmoids, Sinkhorn and h are ``ds4_compiled._hc_pre_tail``, on the calling thread).

Shapes: C streams, H hidden, M = (2 + C) C mixes, K = C*H.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from moe_service.engine import pool as _pool
from moe_service.engine.ds4_compiled import _hc_pre_tail
from moe_service.engine.ds4_ops import _rms_rows
from moe_service.engine.quant.ir import mix_rows_f64, view_f32

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def _mix_cols(xn, tab, acc):
    """acc[m] = sum over k in order of float64(xn[k]) * float64(tab[k, m]), from 0, each
    product rounded to float64 and added in float64 (no fma): the sums of
    quant.ir.mix_rows_f64 and of ds4_compiled._hc_pre_rows' loop, bit for bit. xn float32
    [K]; tab float32 [K, m_cols]; acc float64 [m_cols] (written)."""
    K, Mc = tab.shape
    if Mc == 12:  # V4's 24 mixes in 2 shares: the sums in registers
        mix_rows_f64(xn, 0, tab.reshape(-1), K, 12, acc)
        return
    if Mc == 8:
        mix_rows_f64(xn, 0, tab.reshape(-1), K, 8, acc)
        return
    for m in range(Mc):
        acc[m] = 0.0
    for k in range(K):
        v = np.float64(xn[k])
        for m in range(Mc):
            acc[m] += v * np.float64(tab[k, m])


(O_X, O_TAB, O_XN, O_ACC, O_K, O_MC, O_EPS, O_LEN) = range(8)


def _hc_mix_item(items_ptr, i, op_ptr):
    """Worker share it[2] of one token's mixes (a K_CALL item, pool.CALL_ITEM_SIG): x's rms
    into the share's own scratch (each share computes it: no barrier), then the share's
    columns of the split table (op: see :class:`HcPreOne`)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, O_LEN)
    j = it[i * _pool.ITEM_W + 2]
    K, Mc = op[O_K], op[O_MC]
    x = view_f32(op[O_X], K).reshape((1, K))
    xn = view_f32(op[O_XN] + j * K * 4, K).reshape((1, K))
    tab = view_f32(op[O_TAB] + j * K * Mc * 4, K * Mc).reshape((K, Mc))
    acc = view_f32(op[O_ACC] + j * Mc * 8, 2 * Mc).view(np.float64)
    eps = view_f32(op[O_EPS], 2).view(np.float64)
    _rms_rows(x, eps[0], xn)
    _mix_cols(xn[0], tab, acc)


class HcPreOne:
    """One token's ``ds4_compiled.hc_pre`` for one mixing table on a pool of ``n_shares``
    workers (>= 2): the table fnT float32 [K, M] (ds4_compiled.mix_table's float32 form) split
    by columns into n_shares contiguous [K, M / n_shares] blocks (M a multiple of n_shares),
    and the job's scratch kept for the layer's every step. Not for concurrent use (a layer's
    steps run one at a time: the pool's lock); n_nodes: the pool's NUMA nodes (items spread
    over them). ValueError when the table is not float32 or
    its columns do not split."""

    def __init__(self, fnT: np.ndarray, n_shares: int, eps_rms: float, n_nodes: int = 1):
        K, M = fnT.shape
        if fnT.dtype != np.float32 or n_shares < 2 or M % n_shares:
            raise ValueError(
                f"HcPreOne: a float32 mixing table with columns in {n_shares} shares (got {fnT.dtype} {fnT.shape})"
            )
        mc = M // n_shares
        self.K, self.M = K, M
        self.tab = np.ascontiguousarray(fnT.reshape(K, n_shares, mc).transpose(1, 0, 2))  # [share, K, mc]
        self.xn = np.empty((n_shares, K), np.float32)
        self.acc = np.empty(M, np.float64)  # share j's sums at j * mc.. (the table's column order)
        self.eps = np.array([eps_rms, 0.0], np.float64)
        op = np.zeros(O_LEN, np.int64)
        op[O_TAB], op[O_XN], op[O_ACC] = self.tab.ctypes.data, self.xn.ctypes.data, self.acc.ctypes.data
        op[O_K], op[O_MC], op[O_EPS] = K, mc, self.eps.ctypes.data
        fn = _pool.call_item_address(_hc_mix_item)
        items = [(_pool.K_CALL, fn, j) for j in range(n_shares)]
        self.job = _pool.Job.build([_pool._spread(items, n_nodes)], op)
        self.n_shares = n_shares

    def __call__(
        self, x: np.ndarray, scale: np.ndarray, base: np.ndarray, eps_hc: float, iters: int, pool: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x float32 [1, C, H] (C*H = K) -> (h [1, H], post [1, C], comb [1, C, C]) float32, the
        bits of ``ds4_compiled.hc_pre(x, fnT, scale, base, eps_rms, eps_hc, iters)``."""
        T, C, H = x.shape
        if T != 1 or C * H != self.K or base.shape[0] != self.M or (2 + C) * C != self.M:
            raise ValueError(
                f"HcPreOne: x {x.shape}, base {base.shape} do not fit the table [{self.K}, {self.M}]"
            )
        xc = np.ascontiguousarray(x, dtype=np.float32)
        job = self.job
        pool.run_arrays(job.items, job.bounds, job.op, x=xc, x_field=O_X)
        h = np.empty((1, H), np.float32)
        post = np.empty((1, C), np.float32)
        comb = np.empty((1, C, C), np.float32)
        _hc_pre_tail(
            self.acc,
            xc[0],
            np.ascontiguousarray(scale, dtype=np.float32),
            np.ascontiguousarray(base, dtype=np.float32),
            np.float64(eps_hc),
            int(iters),
            np.empty(self.M, np.float32),
            np.empty((1, C, C), np.float64),
            np.empty(C, np.float32),
            h[0],
            post[0],
            comb[0],
        )
        return h, post, comb
