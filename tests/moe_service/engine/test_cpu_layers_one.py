"""The one-token fused steps of the llama block (cpu_layers.qk_norm_rope_one, add_rms_norm)
give the bits of the calls they replace (rms_norm_heads + rope, ``x + o`` + rms_norm)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import cpu_layers


def _tables(n_pos: int, rope_dim: int, rng) -> tuple[np.ndarray, np.ndarray]:
    ang = rng.uniform(-3.0, 3.0, (n_pos, rope_dim // 2))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("has_norm", [True, False])
@pytest.mark.parametrize("rope_dim", [128, 64])
def test_qk_norm_rope_one_equals_the_separate_calls(neox: bool, has_norm: bool, rope_dim: int) -> None:
    rng = np.random.default_rng(7 + rope_dim + 2 * neox + has_norm)
    nh, nkv, d, pos = 32, 4, 128, 37
    cos, sin = _tables(64, rope_dim, rng)
    q = (rng.standard_normal((1, nh, d)) * 3).astype(np.float32)
    k = (rng.standard_normal((1, nkv, d)) * 0.01).astype(np.float32)
    wq, wk = rng.uniform(0.5, 2.0, d).astype(np.float32), rng.uniform(0.5, 2.0, d).astype(np.float32)
    eps = np.float32(1e-6)
    q_ref, k_ref = q.copy(), k.copy()
    if has_norm:
        cpu_layers.rms_norm_heads(q_ref, wq, eps)
        cpu_layers.rms_norm_heads(k_ref, wk, eps)
    positions = np.array([pos], np.int64)
    cpu_layers.rope(q_ref, positions, cos, sin, rope_dim, neox)
    cpu_layers.rope(k_ref, positions, cos, sin, rope_dim, neox)
    cpu_layers.qk_norm_rope_one(q[0], k[0], wq, wk, has_norm, eps, pos, cos, sin, rope_dim, neox)
    assert q.tobytes() == q_ref.tobytes()
    assert k.tobytes() == k_ref.tobytes()


@pytest.mark.parametrize("n_tok", [1, 3])
def test_add_rms_norm_equals_add_then_norm(n_tok: int) -> None:
    rng = np.random.default_rng(n_tok)
    h = 2048
    x = (rng.standard_normal((n_tok, h)) * 5).astype(np.float32)
    o = (rng.standard_normal((n_tok, h)) * 0.3).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, h).astype(np.float32)
    eps = np.float32(1e-6)
    x_ref = x + o
    h_ref = np.empty_like(x_ref)
    cpu_layers.rms_norm(x_ref, w, eps, h_ref)
    x1, h1 = np.empty_like(x), np.empty_like(x)
    cpu_layers.add_rms_norm(x, o, w, eps, x1, h1)
    assert x1.tobytes() == x_ref.tobytes()
    assert h1.tobytes() == h_ref.tobytes()
