"""The architecture seam: registry, the synthetic writer's tensors against the architectures'
declarations, the routing rule and attention primitives on both backends, experts per token."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_service.engine import arch
from moe_service.engine.arch import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    LayerKV,
    OneOf,
    RopeSpec,
    Routing,
)
from moe_service.engine.arch.rope import rope_tables
from moe_service.engine.model import CpuPath, LayerWeights, Model, TorchPath, torch_route
from moe_service.errors import ConfigError, ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.metrics import Metrics
from moe_service.synth import PRESETS, resolve_preset, tensor_plan, write_synthetic
from moe_service.weights import WeightStore


def test_registry_lists_and_refuses_by_name():
    names = arch.supported()
    assert names == sorted(names) and {"llama", "qwen2", "qwen3", "qwen3moe"} <= set(names)
    with pytest.raises(ModelFileError, match=r"m\.gguf: architecture 'falcon' is not supported \(supported: .*llama"):
        arch.get("falcon", "m.gguf")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3moe", "tiny-qwen2", "tiny-qwen3", "qwen3-30b-a3b"])
def test_synthetic_writer_and_architecture_declare_the_same_tensors(preset):
    """Every tensor the writer plans is one the architecture reads, with the same shape and
    an allowed type, and every required one is planned (one source of truth, checked)."""
    p = resolve_preset(PRESETS[preset], n_layer=2)
    from moe_service.synth import model_metadata

    md = {k: v for k, (v, _) in model_metadata(p, 0).items()}
    md["general.architecture"] = p.arch
    md["tokenizer.ggml.tokens"] = [""] * p.n_vocab  # only the length counts
    a = arch.get(p.arch)(md, "synth", arch=p.arch)
    declared, required = {}, set()
    for item in a.tensors():
        specs = [s for opt in item.options for s in opt] if isinstance(item, OneOf) else [item]
        for s in specs:
            declared[s.name] = s
            if s.required and not isinstance(item, OneOf):
                required.add(s.name)
    from gguf import GGMLQuantizationType

    planned = {t.name: t for t in tensor_plan(p)}
    for name, t in planned.items():
        s = declared.get(name)
        assert s is not None, f"{preset}: the writer plans {name}, the architecture does not read it"
        assert tuple(t.ne) == s.ne, (name, t.ne, s.ne)
        assert int(GGMLQuantizationType[t.qtype]) in s.types, (name, t.qtype)
    assert required <= set(planned), required - set(planned)


@pytest.mark.parametrize("gating,norm,scale,groups,bias", [
    (GATING_SOFTMAX, True, 1.0, (1, 1), False),
    (GATING_SIGMOID, True, 2.5, (4, 2), True),  # deepseek-V3 style
    (GATING_SIGMOID, False, 1.0, (1, 1), True),
    (GATING_SOFTMAX_WEIGHT, False, 1.0, (1, 1), False),  # gpt-oss
    (GATING_SOFTMAX, False, 1.0, (8, 3), False),
])
def test_routing_rule_cpu_kernel_and_torch_agree(gating, norm, scale, groups, bias):
    rng = np.random.default_rng(3)
    T, E, H, K = 9, 32, 16, 6
    h = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((E, H)).astype(np.float32)
    rule = Routing(k=K, gating=gating, norm=norm, scale=scale, n_group=groups[0], n_group_used=groups[1])
    b = (rng.standard_normal(E) * 0.3).astype(np.float32) if bias else None
    lw = LayerWeights(0)
    lw.router, lw.router_bias = router, b
    ids, w = CpuPath(SimpleNamespace()).route(lw, h, rule)
    tids, tw = torch_route(torch.from_numpy(h @ router.T), rule, None if b is None else torch.from_numpy(b))
    np.testing.assert_array_equal(ids, tids.numpy())
    np.testing.assert_allclose(w, tw.numpy(), rtol=2e-6, atol=1e-7)
    # the rule itself, in float64
    logits = (h.astype(np.float64) @ router.T.astype(np.float64))
    probs = {GATING_SOFTMAX: lambda x: np.exp(x - x.max(1, keepdims=True)) / np.exp(x - x.max(1, keepdims=True)).sum(
        1, keepdims=True), GATING_SIGMOID: lambda x: 1 / (1 + np.exp(-x)), GATING_SOFTMAX_WEIGHT: lambda x: x}[gating](
        logits)
    sel = probs + (b if b is not None else 0)
    if groups[0] > 1:
        g = sel.reshape(T, groups[0], -1)
        gs = np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-gs, 1, kind="stable")[:, : groups[1]]
        mask = np.ones((T, groups[0]), bool)
        np.put_along_axis(mask, keep, False, 1)
        sel = np.where(np.repeat(mask, E // groups[0], 1), -np.inf, sel)
    want = np.argsort(-sel, 1, kind="stable")[:, :K]
    np.testing.assert_array_equal(ids, want)
    ww = np.take_along_axis(probs, want, 1)
    if gating == GATING_SOFTMAX_WEIGHT:
        ww = np.exp(ww - ww.max(1, keepdims=True))
        ww /= ww.sum(1, keepdims=True)
    if norm:
        ww /= ww.sum(1, keepdims=True)
    np.testing.assert_allclose(w, ww * scale, rtol=1e-5)


def _paths(layers: list[LayerKV], n_ctx: int = 40):
    """A CpuPath and a TorchPath over caches for ``layers`` (no model file)."""
    out = []
    for cls in (CpuPath, TorchPath):
        m = SimpleNamespace(device=torch.device("cpu"), ops=None)
        path = cls(m)
        m.kv = path.kv_cache(layers, 2, n_ctx)
        out.append(path)
    return out


@pytest.mark.parametrize("kv,window,sinks", [
    (LayerKV(2, 32, 32), 0, False),
    (LayerKV(2, 32, 16), 5, True),  # gpt-oss: sliding window + sinks
    (LayerKV(1, 48, 32, latent=True), 0, False),  # MLA latent cache: V = the key row's first 32 dims
])
def test_attention_primitive_cpu_and_torch_agree(kv, window, sinks):
    cpu, tch = _paths([kv])
    rng = np.random.default_rng(7)
    nh = 4
    spans_a = [(0, 0, 11, 0), (1, 11, 14, 0)]  # two sequences, prefills
    spans_b = [(0, 0, 1, 11), (1, 1, 8, 3)]  # a decode token and a second chunk
    s = (rng.standard_normal(nh) * 2).astype(np.float32) if sinks else None
    for spans in (spans_a, spans_b):
        T = spans[-1][2]
        q = rng.standard_normal((T, nh, kv.key_dim)).astype(np.float32)
        k = rng.standard_normal((T, kv.n_head_kv, kv.key_dim)).astype(np.float32)
        v = None if kv.latent else rng.standard_normal((T, kv.n_head_kv, kv.value_dim)).astype(np.float32)
        a = cpu.attention(0, q, k, v, spans, 0.2, window=window, sinks=s, value_dim=kv.value_dim)
        b = tch.attention(0, torch.from_numpy(q), torch.from_numpy(k), None if v is None else torch.from_numpy(v),
                          spans, 0.2, window=window, sinks=None if s is None else torch.from_numpy(s),
                          value_dim=kv.value_dim)
        assert a.shape == (T, nh, kv.value_dim)
        np.testing.assert_allclose(a, b.numpy(), atol=2e-3, rtol=0)


def test_rope_tables_plain_and_yarn():
    plain = RopeSpec(dim=16, base=10000.0, neox=True)
    cos, sin = rope_tables(plain, 64)
    np.testing.assert_allclose(cos[5, 0], np.cos(5.0), rtol=1e-6)
    np.testing.assert_allclose(sin[3, 7], np.sin(3 * 10000.0 ** (-14 / 16)), rtol=1e-5)
    # linear interpolation by freq_scale: position p with scale 1/4 is position p/4
    c4, s4 = rope_tables(RopeSpec(dim=16, base=10000.0, neox=True, freq_scale=0.25), 64)
    np.testing.assert_allclose(c4[8], cos[2], atol=1e-6)
    # YaRN: low-frequency pairs interpolated, high-frequency ones extrapolated, mscale applied
    y = RopeSpec(dim=16, base=10000.0, neox=True, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=32)
    cy, sy = rope_tables(y, 64)
    m = np.float32(1 + 0.1 * np.log(4.0))
    np.testing.assert_allclose(cy[8, 0], np.cos(8.0) * m, rtol=1e-5)  # pair 0: full extrapolation
    np.testing.assert_allclose(cy[8, 7] / m, c4[8, 7], rtol=1e-5)  # last pair: interpolation


def test_experts_per_token_overrides_top_k_and_is_exported(ops, tmp_path):
    cat = GGUFModel.open(write_synthetic(tmp_path / "m.gguf", "tiny-qwen3moe", n_layer=1, seed=2))
    ws = WeightStore.load_simple(cat)
    prompt = [5, 17, 300, 41]
    own = Model(cat, ws, ops, n_seq=1, n_ctx=16)
    two = Model(cat, ws, ops, n_seq=1, n_ctx=16, experts_per_token=2)
    assert own.routing.k == 4 and two.routing.k == 2
    h = np.random.default_rng(0).standard_normal((3, cat.params.n_embd)).astype(np.float32)
    ids, w = two.route(two.layers[0], h)
    assert ids.shape == (3, 2) and np.allclose(w.sum(1), 1.0)
    a = own.step([(own.kv.alloc(), prompt)])[0].numpy()
    b = two.step([(two.kv.alloc(), prompt)])[0].numpy()
    assert np.isfinite(b).all() and not np.allclose(a, b)
    with pytest.raises(ConfigError, match="experts_per_token = 17: the model has 16 experts"):
        Model(cat, ws, ops, n_seq=1, n_ctx=16, experts_per_token=17)
    metrics = Metrics()
    metrics.attach_context(SimpleNamespace(engine=SimpleNamespace(model=two)))
    text = metrics.render()[0].decode()
    assert 'moe_service_experts_per_token{which="in_use"} 2.0' in text
    assert 'moe_service_experts_per_token{which="model"} 4.0' in text
