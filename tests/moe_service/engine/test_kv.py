"""The KV cache as planned memory (moe_service.engine.kv): sizes, context from a budget,
refusals naming the numbers, allocation in both formats, rows moved for the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import kv

GIB = 1024**3
LAYERS = [kv.LayerKV(4, 128, 128)] * 4  # Qwen3-30B-A3B-shaped attention, 4 layers


def test_bytes_per_token_f16_q8_0_latent():
    assert kv.bytes_per_token(LAYERS, "f16") == 4 * (4 * 128 * 2 * 2)
    assert kv.bytes_per_token(LAYERS, "q8_0") == 4 * (4 * 4 * 34 * 2)
    mla = [kv.LayerKV(1, 576, 512, latent=True)]
    assert kv.bytes_per_token(mla, "f16") == 576 * 2  # one row, V inside it
    with pytest.raises(ValueError, match="multiples of 32"):
        kv.bytes_per_token([kv.LayerKV(2, 48, 48)], "q8_0")


def test_context_from_budget_and_trained():
    bpt = kv.bytes_per_token(LAYERS, "f16")  # 8 KiB
    p = kv.plan_context(LAYERS, 40960, 4, budget_bytes=GIB // 2)
    assert p.ok and p.n_ctx == (GIB // 2 // (bpt * 4)) // 256 * 256 == 16384
    assert p.total_bytes == p.n_ctx * bpt * 4 <= GIB
    p = kv.plan_context(LAYERS, 8192, 4, budget_bytes=8 * GIB)
    assert p.ok and p.n_ctx == 8192  # the trained context when the budget holds it
    q = kv.plan_context(LAYERS, 40960, 4, budget_bytes=GIB // 2, kv_type="q8_0")
    assert q.ok and q.n_ctx == (GIB // 2 // (4352 * 4)) // 256 * 256 == 30720  # 34/64 of the bytes


def test_refusals_name_the_numbers():
    p = kv.plan_context(LAYERS, 40960, 4, context_tokens=40000, budget_bytes=1 * GIB)
    assert not p.ok
    assert "model.context_tokens = 40000" in p.problem and "engine.kv_cache_gib = 1.00 GiB" in p.problem
    assert "1.22 GiB" in p.problem  # 40000 x 8 KiB x 4
    p = kv.plan_context(LAYERS, 40960, 64, budget_bytes=GIB // 64)
    assert not p.ok and "holds only" in p.problem and "serve.parallel = 64" in p.problem


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_allocate_and_rows(kv_type):
    layers = [kv.LayerKV(2, 64, 64), kv.LayerKV(1, 96, 64, latent=True)]
    c = kv.KVCache.allocate(layers, 3, 40, kv_type=kv_type)
    assert c.v[1] is c.k[1] and c.k[0].dtype == (np.uint16 if kv_type == "f16" else np.uint8)
    assert c.bytes() == 3 * 40 * kv.bytes_per_token(layers, kv_type)
    assert c.token_bytes() == kv.bytes_per_token(layers, kv_type)
    rng = np.random.default_rng(0)
    for t in c.k + c.v:
        t[...] = rng.integers(0, 255, t.shape)
    buf = np.zeros(10 * c.token_bytes(), np.uint8)
    c.export_rows(1, 5, 15, buf)
    c.import_rows(2, 5, 15, buf)
    for t in c.k + c.v:
        assert np.array_equal(t[1, 5:15], t[2, 5:15])
    c.copy_rows(0, 2, 0, 5)
    assert all(np.array_equal(t[0, :5], t[2, :5]) for t in c.k)
    with pytest.raises(ValueError, match="outside"):
        c.export_rows(0, 30, 41, buf)
    with pytest.raises(ValueError, match="too small"):
        c.import_rows(0, 0, 11, buf)


def test_alloc_prefers_a_slot():
    c = kv.KVCache(3, 8, [], [])
    assert c.alloc(prefer=lambda s: 5 if s == 2 else 0) == 2
    assert c.alloc() == 0
    c.free(2)
    assert c.alloc(prefer=lambda s: 0) == 1  # ties: lowest free slot


def test_q8_0_cache_through_the_model(tmp_path):
    """A 2-layer model with engine.kv_type = q8_0: prefill and decode run, and the last-prompt
    logits stay close to the float16 cache's (Q8_0 keeps ~8 bits per value)."""
    import torch

    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.gguf_model import GGUFModel
    from moe_service.synth import write_synthetic
    from moe_service.weights import WeightStore

    torch.set_num_threads(1)
    cat = GGUFModel.open(write_synthetic(tmp_path / "t.gguf", "tiny-qwen3moe", expert_type="Q8_0", seed=2))
    ws = WeightStore.load_simple(cat)
    ops = CpuOps(threads=0)
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(2, 8000, 90)]
        out = {}
        for kv_type in ("f16", "q8_0"):
            m = Model(cat, ws, ops, n_seq=1, n_ctx=128, kv_type=kv_type)
            assert m.kv.k[0].dtype == (np.uint16 if kv_type == "f16" else np.uint8)
            s = m.kv.alloc()
            out[kv_type] = m.step([(s, prompt)])[0].numpy()
            nxt = m.step([(s, [int(np.argmax(out[kv_type]))])])[0].numpy()
            assert np.isfinite(nxt).all()
        a, b = out["f16"], out["q8_0"]
        assert np.corrcoef(a, b)[0, 1] > 0.99 and np.abs(a - b).max() < 0.1 * np.abs(a).max()
    finally:
        ops.close()
