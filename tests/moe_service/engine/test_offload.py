"""The prefill offload on the CPU device (torch "cpu" standing in for cuda: staging, copies,
grouping and the expert arithmetic run; streams do not exist) against a reference MoE computed
from gguf-py's dequantized weights, and the hook in Model._ffn."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from moe_service.engine.arch import Routing
from moe_service.engine.model import ExpertSet, LayerWeights, Model, TorchPath
from moe_service.engine.offload import ExpertOffload
from moe_service.engine.ops import CpuOps
from moe_service.numa import Topology

Q = GGMLQuantizationType


def quant_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows * row_bytes] of a ``qtype`` matrix: real quantization where gguf-py has it,
    else random blocks with small finite float16 scales (K-quants)."""
    vals = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.MXFP4):
        return np.ascontiguousarray(gguf_quantize(vals, qtype)).view(np.uint8).reshape(-1)
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale_at = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for at in scale_at:
        b[:, at : at + 2] = np.full(len(b), 0.002, np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


class SynthLayer:
    """E experts of one MoE layer written into an arena at chosen offsets (64-byte aligned),
    with the ExpertSet the engine would build and the dequantized float64 weights."""

    def __init__(self, layer=0, E=8, H=64, n_ff=32, types=None, fused=False, order=None, gap=0, seed=0, arena=None, at=0):
        rng = np.random.default_rng(seed)
        types = types or {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0}
        if fused:
            types = {"gate_up": types.get("gate_up", Q.Q8_0), "down": types["down"]}
        self.E, self.H, self.I, self.layer = E, H, n_ff, layer
        shapes = {"gate": (n_ff, H), "up": (n_ff, H), "down": (H, n_ff), "gate_up": (2 * n_ff, H)}
        order = list(range(E)) if order is None else order
        self.w: dict[str, np.ndarray] = {}
        chunks, copies = [], {}
        pos = at
        for kind, qt in types.items():
            rows, cols = shapes[kind]
            slabs = [quant_bytes(qt, rows, cols, rng) for _ in range(E)]
            self.w[kind] = np.stack([gguf_dequantize(s.reshape(rows, -1), qt) for s in slabs]).astype(np.float64)
            offs = np.full((E, 2), -1, dtype=np.int64)
            for e in order:  # slab placement order in the arena (e.g. experts of node 1 first)
                chunks.append((pos, slabs[e]))
                offs[e, 0] = pos
                pos += (len(slabs[e]) + gap + 63) // 64 * 64
            copies[kind] = (offs, np.full((E, 2), -1, dtype=np.int32))
        self.end = pos
        self.arena = arena if arena is not None else np.zeros(pos + 4096, dtype=np.uint8)
        for off, slab in chunks:
            self.arena[off : off + len(slab)] = slab
        self.es = ExpertSet(layer=layer, n_expert=E, n_embd=H, n_ff_exp=n_ff,
                            types={k: int(v) for k, v in types.items()}, copies=copies)

    def reference(self, h: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """sum_k w_k * down_e(SiLU(gate_e x) * up_e x) in float64 (llama.cpp build_moe_ffn's combine)."""
        x = h.astype(np.float64)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = ids[t, k]
                if "gate_up" in self.w:
                    gu = self.w["gate_up"][e] @ x[t]
                    g, u = gu[: self.I], gu[self.I :]
                else:
                    g, u = self.w["gate"][e] @ x[t], self.w["up"][e] @ x[t]
                a = g / (1 + np.exp(-g)) * u
                out[t] += w[t, k] * (self.w["down"][e] @ a)
        return out


def routing(T: int, E: int, K: int, seed: int = 1, experts: list[int] | None = None):
    rng = np.random.default_rng(seed)
    pool = np.array(experts if experts is not None else range(E))
    ids = np.stack([rng.choice(pool, size=K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    w /= w.sum(1, keepdims=True)
    return ids, w


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(layer: SynthLayer, T=48, K=2, seed=1, experts=None, **kw):
    ids, w = routing(T, layer.E, K, seed, experts)
    h = np.random.default_rng(seed + 7).standard_normal((T, layer.H)).astype(np.float32)
    off = ExpertOffload(layer.arena, [layer.es], "cpu", min_batch_tokens=1, **kw)
    got = off.moe(layer.es, torch.from_numpy(h), ids, w)
    return got, layer.reference(h, ids, w), off


@pytest.mark.parametrize("types", [
    {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0},
    {"gate": Q.Q4_0, "up": Q.Q5_1, "down": Q.MXFP4},
])
def test_matches_the_reference_in_float32(types):
    got, ref, off = run(SynthLayer(types=types))
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert rel_l2(got, ref) < 1e-5
    assert off.stats.layers == 1 and off.stats.copy_calls == 3  # plain layout: one copy per kind


def test_k_quants_and_fused_gate_up():
    layer = SynthLayer(E=4, H=256, n_ff=256, types={"gate_up": Q.Q4_K, "down": Q.Q6_K}, fused=True)
    got, ref, _ = run(layer, T=24)
    assert rel_l2(got, ref) < 1e-5
    layer = SynthLayer(E=4, H=256, n_ff=256, types={"gate": Q.Q5_K, "up": Q.Q4_K, "down": Q.Q6_K}, seed=2)
    got, ref, _ = run(layer, T=24)
    assert rel_l2(got, ref) < 1e-5


def test_scattered_slabs_and_only_selected_copies():
    """Slabs out of expert order with gaps (as a NUMA layout spreads them over node regions):
    each slab is found at its own offset; only_selected copies just the routed experts."""
    layer = SynthLayer(E=8, order=[5, 6, 7, 0, 1, 2, 3, 4], gap=64)
    got, ref, off = run(layer, experts=[1, 2, 6], only_selected=True)
    assert rel_l2(got, ref) < 1e-5
    slab = {k: len(quant_bytes(Q.Q8_0, *s, np.random.default_rng(0)))
            for k, s in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32)))}
    assert off.stats.copied_bytes == 3 * sum(slab.values())  # 3 experts, nothing else
    assert off.stats.copy_calls == 9  # gaps: no two slabs merge


def test_small_dequantization_groups_give_the_same_result():
    layer = SynthLayer(E=8)
    big, _, _ = run(layer)
    small, _, _ = run(layer, group_bytes=1)  # one expert per group
    assert torch.allclose(big, small, rtol=1e-6, atol=1e-7)


def test_bfloat16_compute_within_its_documented_tolerance():
    got, ref, off = run(SynthLayer(E=8, H=128, n_ff=64), T=64, compute_dtype=torch.bfloat16)
    assert off.compute_dtype == torch.bfloat16
    assert rel_l2(got, ref) < 1e-2


def test_two_layers_double_buffering_prefetch_and_reuse():
    l0 = SynthLayer(layer=3, E=4, seed=3)
    l1 = SynthLayer(layer=5, E=4, seed=4, arena=np.zeros(2 * l0.end + 8192, np.uint8), at=l0.end + 4096)
    l1.arena[: l0.end] = l0.arena[: l0.end]
    off = ExpertOffload(l1.arena, [l0.es, l1.es], "cpu", min_batch_tokens=1)
    T = 16
    ids, w = routing(T, 4, 2)
    h = np.random.default_rng(9).standard_normal((T, 64)).astype(np.float32)
    off.start_step()  # layer 3's slabs start moving before its attention
    assert off.tags[0] == (0, None) and off.stats.prefetched_layers == 1
    y0 = off.moe(l0.es, torch.from_numpy(h), ids, w)
    assert off.tags[1] == (1, None) and off.stats.prefetched_layers == 2  # layer 5 during layer 3
    copied = off.stats.copied_bytes
    y1 = off.moe(l1.es, torch.from_numpy(h), ids, w)
    assert off.stats.copied_bytes == copied, "layer 5 was already staged"
    assert off.stats.ready_layers == 2
    assert rel_l2(y0, l0.reference(h, ids, w)) < 1e-5
    assert rel_l2(y1, l1.reference(h, ids, w)) < 1e-5
    # the next step finds both layers still staged (two buffers, two layers): no copies at all
    off.start_step()
    off.moe(l0.es, torch.from_numpy(h), ids, w)
    off.moe(l1.es, torch.from_numpy(h), ids, w)
    assert off.stats.copied_bytes == copied
    off.forget()  # unless told to forget them
    off.moe(l0.es, torch.from_numpy(h), ids, w)
    assert off.stats.copied_bytes == 2 * copied  # layer 3 copied again, layer 5 prefetched again
    assert off.reserve() == 2 * off.buffer_bytes


def test_a_layer_without_primary_copies_is_refused():
    layer = SynthLayer(E=2)
    layer.es.copies["up"][0][1, 0] = -1
    with pytest.raises(ValueError, match="layer 0: an expert of kind up has no primary copy"):
        ExpertOffload(layer.arena, [layer.es], "cpu")


def test_pageable_source_is_reported_once(monkeypatch):
    from moe_service.engine import offload as mod

    events = []
    monkeypatch.setattr(mod.log, "warning", lambda event, **kw: events.append(event))
    layer = SynthLayer(E=2)
    pins = SimpleNamespace(covers=lambda off, n: False)
    off = ExpertOffload(layer.arena, [layer.es], "cpu", min_batch_tokens=1, pins=pins, prefetch=False)
    ids, w = routing(4, 2, 1)
    h = torch.zeros(4, 64)
    off.moe(layer.es, h, ids, w)
    off.tags = [None, None]
    off.moe(layer.es, h, ids, w)
    assert events == ["offload_pageable_source"]


# -- the hook in Model._ffn ------------------------------------------------------------------------


class _NoCpuOps:
    def moe(self, *a, **k):
        raise AssertionError("a big batch went to the CPU experts")


def _bare_model(layer: SynthLayer, offload) -> tuple[Model, LayerWeights]:
    """A Model with just what route and the torch path's moe need (no GGUF file): router,
    routing rule (llama's: softmax, top-2 renormalised)."""
    m = Model.__new__(Model)
    m.routing = Routing(k=2)
    m.device, m.offload = torch.device("cpu"), offload
    m.weights = SimpleNamespace(arena=layer.arena)
    m.path = TorchPath(m)  # the offload is the torch (device) path's
    lw = LayerWeights(layer.layer)
    lw.experts = layer.es
    lw.router = torch.from_numpy(np.random.default_rng(5).standard_normal((layer.E, layer.H)).astype(np.float32))
    return m, lw


def _ffn(m, lw, h):
    """What an architecture's block does with an MoE layer: route, then the backend's moe."""
    return m.path.moe(lw, h, *m.route(lw, h))


def test_model_ffn_sends_big_batches_to_the_offload_and_small_ones_to_the_cpu():
    layer = SynthLayer(E=8)
    off = ExpertOffload(layer.arena, [layer.es], "cpu", min_batch_tokens=32)
    m, lw = _bare_model(layer, off)
    m.ops = _NoCpuOps()
    h = torch.from_numpy(np.random.default_rng(6).standard_normal((32, 64)).astype(np.float32))
    y = _ffn(m, lw, h)
    ids, w = m.route(lw, h)
    assert off.stats.layers == 1
    assert rel_l2(y, layer.reference(h.numpy(), ids, w)) < 1e-5

    calls = []

    class _CpuOps:
        def moe(self, arena, xs, ids, w, experts):
            calls.append(xs.shape)
            return np.zeros_like(xs)

    m.ops = _CpuOps()
    _ffn(m, lw, h[:31])
    assert calls == [(31, 64)] and off.stats.layers == 1


def test_model_ffn_offload_matches_the_cpu_fused_moe():
    """Offload vs the CPU fused MoE kernels (moe_service.engine.ops.CpuOps). The CPU kernels
    quantize activations to 8 bits (as llama.cpp), the offload does not: agreement to ~1%
    relative."""
    layer = SynthLayer(E=8)
    off = ExpertOffload(layer.arena, [layer.es], "cpu", min_batch_tokens=16)
    m, lw = _bare_model(layer, off)
    m.ops = CpuOps(Topology.read(), threads=0, fused_moe=True)  # as the engine stage builds it
    h = torch.from_numpy(np.random.default_rng(8).standard_normal((16, 64)).astype(np.float32))
    ids, w = m.route(lw, h)
    cpu = m.ops.moe(layer.arena, np.ascontiguousarray(h.numpy()), ids, w, layer.es)
    y = _ffn(m, lw, h)
    assert off.stats.layers == 1
    assert rel_l2(y, cpu) < 2e-2


def test_gpt_oss_activation_and_expert_biases():
    """A layer that declares the clamped SwiGLU and carries gate/up/down biases (gpt-oss) computes
    the same on the offload as the float64 formula, and agrees with the CPU fused MoE step."""
    from moe_service.engine import moe as M
    from moe_service.engine.pool import WorkerPool

    E, H, n_ff = 8, 64, 32
    layer = SynthLayer(E=E, H=H, n_ff=n_ff, types={"gate": Q.MXFP4, "up": Q.MXFP4, "down": Q.MXFP4}, seed=4)
    rng = np.random.default_rng(9)
    start = (layer.end + 63) // 64 * 64
    bias = {k: (rng.standard_normal((E, n)) * 0.5).astype(np.float32) for k, n in (("gate", n_ff), ("up", n_ff), ("down", H))}
    arena = np.concatenate([layer.arena[:start], np.zeros(4 * sum(b.size for b in bias.values()), np.uint8)])
    offs, pos = {}, start
    for k, b in bias.items():
        arena[pos: pos + 4 * b.size] = b.view(np.uint8).reshape(-1)
        offs[k], pos = pos, pos + 4 * b.size
    es = M.ExpertWeights(E, H, n_ff, layer.es.types, layer.es.copies, offs, act=M.ACT_SWIGLU_OAI)
    es.layer = 0
    ids, w = routing(40, E, 4, seed=3)
    h = (np.random.default_rng(5).standard_normal((40, H)) * 6).astype(np.float32)  # past the clamp limit
    got = ExpertOffload(arena, [es], "cpu", min_batch_tokens=1).moe(es, torch.from_numpy(h), ids, w).numpy()
    ref = np.zeros((40, H))
    for t in range(40):
        for k in range(4):
            e = ids[t, k]
            g = np.minimum(layer.w["gate"][e] @ h[t] + bias["gate"][e], 7.0)
            u = np.clip(layer.w["up"][e] @ h[t] + bias["up"][e], -7.0, 7.0)
            ref[t] += w[t, k] * (layer.w["down"][e] @ (g / (1 + np.exp(-1.702 * g)) * (u + 1)) + bias["down"][e])
    assert rel_l2(got, ref) < 1e-5
    pool = WorkerPool(pin_caller=False, spin_s=0.002)
    try:
        cpu = M.MoE(pool).forward(arena, h, ids, w, es)  # 8-bit activations as ggml: ~1% apart
    finally:
        pool.close()
    assert rel_l2(cpu, ref) < 0.03
