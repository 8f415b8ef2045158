"""The shared expert in the routed experts' dispatch (moe.MoE.forward(shared=...)): the bits
of the routed step plus CpuPath.glu_ffn's two pool matmuls and activation (deepseek4's decode
step runs it so, arch/deepseek4.moe_with_shared)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import moe as M
from moe_service.engine import pool as P
from moe_service.engine import quant as q
from moe_service.engine.mats import QMat


@pytest.fixture(scope="module")
def pool():
    p = P.WorkerPool(n_threads=2, pin_caller=False, spin_s=0.002)
    yield p
    p.close()


def _layer(rng, t_exp, t_sh, n_expert=8, h=256, i_w=256, i_sh=512):
    """Routed experts (gate/up/down slabs of type t_exp) and a shared expert's three
    matrices (type t_sh) in one arena."""
    parts, off = [], 0

    def add(b):
        nonlocal off
        parts.append(b)
        o = off
        off += b.size
        return o

    def slabs(rows, cols):
        return np.array(
            [add(q.random_blocks(rng, t_exp, rows, cols, scale=0.02)) for _ in range(n_expert)], np.int64
        ).reshape(-1, 1), np.zeros((n_expert, 1), np.int32)

    copies = {"gate": slabs(i_w, h), "up": slabs(i_w, h), "down": slabs(h, i_w)}
    ex = M.ExpertWeights(
        n_expert,
        h,
        i_w,
        {"gate": t_exp, "up": t_exp, "down": t_exp},
        copies,
        act=M.ACT_SWIGLU_CLAMP,
        limit=10.0,
    )
    mats = [
        QMat(n, add(q.random_blocks(rng, t_sh, r, c, scale=0.05)), t_sh, r, c)
        for n, r, c in (("gate", i_sh, h), ("up", i_sh, h), ("down", h, i_sh))
    ]
    return ex, mats, np.concatenate(parts)


def _glu(pool, arena, mats, x, limit):
    """CpuPath.glu_ffn's arithmetic: gate and up in one pool matmul, act_rows, down."""
    g, u = pool.matmul(arena, mats[:2], x)
    out = np.empty(g.shape, np.float32)
    M.act_rows(
        M.ACT_SWIGLU_CLAMP,
        np.ascontiguousarray(g).reshape(-1),
        np.ascontiguousarray(u).reshape(-1),
        np.float32(1.702),
        np.float32(limit),
        out.reshape(-1),
    )
    (y,) = pool.matmul(arena, mats[2:], out)
    return y


@pytest.mark.parametrize("n_tok", [1, 3])
@pytest.mark.parametrize("t_exp, t_sh", [(q.GGML_MXFP4, q.GGML_Q8_0), (q.GGML_Q4_0, q.GGML_Q8_0)])
def test_shared_expert_in_the_dispatch_is_routed_plus_glu_bit_for_bit(pool, n_tok, t_exp, t_sh):
    rng = np.random.default_rng(n_tok + t_exp)
    ex, mats, arena = _layer(rng, t_exp, t_sh)
    sh = M.SharedExpert.of_mats(*mats, act=M.ACT_SWIGLU_CLAMP, limit=4.0)
    moe = M.MoE(pool)
    assert moe.can_share(ex, sh)
    for step in range(3):  # the cached plan serves later steps (new inputs, the same buffers)
        x = (rng.standard_normal((n_tok, 256)) * (1 + 3 * step)).astype(np.float32)
        ids = np.stack([rng.choice(8, 6, replace=False) for _ in range(n_tok)]).astype(np.int32)
        w = rng.random((n_tok, 6)).astype(np.float32)
        want = moe.forward(arena, x, ids, w, ex) + _glu(pool, arena, mats, x, 4.0)
        got = moe.forward(arena, x, ids, w, ex, shared=sh)
        assert got.dtype == np.float32 and np.array_equal(got, want)
        assert np.array_equal(moe.forward(arena, x, ids, w, ex) + _glu(pool, arena, mats, x, 4.0), want)


def test_shared_expert_refused_where_it_cannot_share(pool):
    rng = np.random.default_rng(3)
    ex8, mats8, arena8 = _layer(rng, q.GGML_Q8_0, q.GGML_Q4_K)  # Q4_K reads Q8_K activations, not Q8_0
    sh = M.SharedExpert.of_mats(*mats8, act=M.ACT_SWIGLU_CLAMP, limit=4.0)
    moe = M.MoE(pool)
    assert not moe.can_share(ex8, sh)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ids, w = np.array([[0, 1, 2, 3, 4, 5]], np.int32), np.full((1, 6), 1 / 6, np.float32)
    with pytest.raises(ValueError, match="shared expert"):
        moe.forward(arena8, x, ids, w, ex8, shared=sh)
    with pytest.raises(ValueError, match="shared expert"):
        moe.forward(
            arena8,
            x,
            ids,
            w,
            ex8,
            fused=False,
            shared=M.SharedExpert.of_mats(*_layer(rng, q.GGML_Q8_0, q.GGML_Q8_0)[1], act=M.ACT_SWIGLU_CLAMP),
        )
    with pytest.raises(ValueError, match="do not make one FFN"):
        M.SharedExpert.of_mats(mats8[0], mats8[1], mats8[0], act=M.ACT_SWIGLU_CLAMP)
