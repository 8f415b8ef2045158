"""The KV memory of deepseek4 (and deepseek2's latent cache) as planned vs as allocated.

deepseek4 keeps, per sequence, a ring of the last sliding_window raw K = V rows of every trunk
layer (D float16 values each: the window bounds them) and, per compressed layer, its compressed
rows, the indexer's keys (ratio 4) and the compressor rings (arch/deepseek4.py ``seq_state``). ``moe-service plan`` and
preflight count all of it (engine/kv.py ``plan_context(state=...)``), and the KV cache
allocates exactly those arrays: the planned bytes are the allocated bytes. A context whose
cache does not fit engine.kv_cache_gib is refused before loading, naming the numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from moe_service.engine import arch, kv
from moe_service.engine.model import Model
from moe_service.gguf_model import GGUFModel
from moe_service.synth_deepseek2 import write_deepseek2
from moe_service.synth_deepseek4 import write_deepseek4
from moe_service.weights import WeightStore
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2
GIB = 1024**3


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_deepseek4(tmp_path_factory.mktemp("ds4kv") / "tiny4.gguf", "tiny-deepseek4")


def _plan(cat, config) -> kv.KVPlan:
    """The KV plan of ``cat`` under ``config`` from its architecture's declarations."""
    return kv.plan_for_config(cat, config, *arch.kv_needs(cat))


def _config(context_tokens: int, kv_cache_gib: float, parallel: int):
    from moe_service.config import Settings

    return Settings(model={"context_tokens": context_tokens}, engine={"kv_cache_gib": kv_cache_gib},
                    serve={"parallel": parallel})


@pytest.mark.parametrize("dense", ["quant", "torch"])
def test_planned_bytes_are_the_allocated_bytes(tiny4, ops, dense):
    """tiny-deepseek4 (ratios 0, 4, 128, 4, 128; D 128, indexer Di 64), 2 sequences of 700
    tokens (not a multiple of either ratio): plan total == bytes of every array the model's
    KV cache holds, and the layer uses those very arrays."""
    cat = GGUFModel.open(tiny4)
    n_seq, n_ctx = 2, 700
    plan = _plan(cat, _config(n_ctx, 1.0, n_seq))
    assert plan.ok and plan.n_ctx == n_ctx
    D, Di = 128, 64
    assert plan.bytes_per_token == 0  # nothing per token of context in the row cache
    raw = 5 * 128 * D * 2  # every trunk layer: the last 128 (window) f16 K = V rows
    rings = 2 * 2 * (8 * 2 * D + 8 * 2 * Di) * 4 + 2 * 2 * (256 * D) * 4  # ratio-4 (kv, score, + indexer); ratio-128
    comp = 2 * ((n_ctx // 4) * (D + Di) * 2) + 2 * ((n_ctx // 128) * D * 2)
    assert plan.state_bytes_per_seq == raw + rings + comp
    assert plan.total_bytes == n_seq * (raw + rings + comp)

    m = Model(cat, WeightStore.load_simple(cat), ops, n_seq=n_seq, n_ctx=n_ctx, dense=dense)
    assert m.kv.bytes() == plan.total_bytes
    assert {il for il, name in m.kv.state if name == "comp"} == {1, 2, 3, 4}  # the compressed layers
    assert all(m.kv.state[(il, "raw")].shape == (n_seq, 128, D) for il in range(5))
    assert m.kv.state[(1, "comp")].shape == (n_seq, n_ctx // 4, D)
    assert m.kv.state[(1, "icomp")].shape == (n_seq, n_ctx // 4, Di)
    assert m.kv.state[(2, "comp")].shape == (n_seq, n_ctx // 128, D)
    assert all(k.numel() == 0 if dense == "torch" else k.size == 0 for k in m.kv.k)  # no per-token rows
    if dense == "quant":  # the arrays live in the KV cache's one mapping
        base = m.kv._arena.ctypes.data
        for a in m.kv.state.values():
            assert base <= a.ctypes.data < base + m.kv._arena.nbytes

    # a prompt long enough to fill compressed blocks: the layer writes the cache's arrays
    s = m.kv.alloc()
    m.step([(s, list(range(20, 20 + 300)))])
    assert np.any(m.kv.state[(1, "comp")][s, : 300 // 4] != 0)
    assert np.any(m.kv.state[(2, "comp")][s, :2] != 0)
    assert not np.any(m.kv.state[(2, "comp")][s, 3:])
    # the values per token deepseek4 declares: the compressed rows' share of the state
    vals = m.arch.compressed_kv_values_per_token()
    assert vals == pytest.approx(2 * (D + Di) / 4 + 2 * D / 128)
    big = m.arch.seq_state(128 * 1024)
    comp_bytes = sum(a.nbytes for a in big if a.name in ("comp", "icomp"))
    assert comp_bytes == 2 * vals * 128 * 1024


def test_v4_context_that_does_not_fit_is_refused_with_the_numbers(tmp_path):
    """V4-Flash shapes (sparse file: header + tensor table): an explicit context beyond
    engine.kv_cache_gib is refused by the plan and by preflight, naming the context, the
    rows' bytes per token and the compressed-KV state per sequence; a derived context is the
    largest 256-token multiple whose rows + state fit."""
    from moe_service.numa import Topology
    from pipeline.plan import kv_capacity, plan
    from pipeline.preflight import run_preflight

    path = write_deepseek4(tmp_path / "v4f.gguf", "deepseek-v4-flash", sparse=True)  # ratios 0, 0, 4, 128
    cat = GGUFModel.open(path)
    layers, state = arch.kv_needs(cat)
    assert state is not None and len(layers) == 4
    N = 1 << 20  # the trained context
    cfg = _config(N, 0.25, 2)
    p = _plan(cat, cfg)
    assert not p.ok
    # window rows: 4 layers x 128 x 512 f16; ratio 4: (512 + indexer 128) / 4 tokens; ratio 128
    assert p.bytes_per_token == 0
    state_n = 4 * 128 * 512 * 2 + N // 4 * (512 + 128) * 2 + N // 128 * 512 * 2 \
        + (2 * 8 * 1024 + 2 * 8 * 256) * 4 + 2 * 256 * 512 * 4
    assert p.state_bytes_per_seq == state_n
    assert p.total_bytes == 2 * state_n
    assert f"model.context_tokens = {N}" in p.problem
    assert f"{state_n} bytes of per-sequence KV state" in p.problem
    assert "engine.kv_cache_gib = 0.25 GiB" in p.problem

    topo = Topology.read(root="/")
    layout = plan(cat, topo, cfg, strict=False)
    cap = kv_capacity(cat, layout, topo, cfg)
    assert not cap["fits"] and cap["total_bytes"] == p.total_bytes
    report = run_preflight(cat, topo, layout, cfg, raise_on_fail=False)
    check = next(c for c in report.checks if c.name == "kv_cache")
    assert check.status == "fail" and "per-sequence KV state" in check.message
    assert check.numbers["state_bytes_per_seq"] == state_n

    derived = _plan(cat, _config(0, 0.0625, 2))
    assert derived.ok and derived.total_bytes <= 0.0625 * GIB
    more = kv.plan_context(layers, derived.n_ctx_train, 2, context_tokens=derived.n_ctx + 256,
                           budget_bytes=GIB // 16, state=state)
    assert not more.ok  # the next 256 tokens would not fit: the state grows with the context


def test_prefix_cache_refuses_a_cache_with_state():
    """Per-sequence state that declares no snapshot kind (kv.SeqState.kind) cannot be restored
    from reused rows: the prefix cache says so (make_prefix_cache then serves without it).
    deepseek4 declares its kinds (tests/moe_service/engine/test_prefix_state.py)."""
    from moe_service.engine.prefix import PrefixCache

    c = kv.KVCache.allocate([kv.LayerKV(1, 64, 64, latent=True)], 2, 64,
                            state=[kv.SeqState(0, "comp", (16, 64), "float16")])
    assert c.state[(0, "comp")].shape == (2, 16, 64) and not c.state[(0, "comp")].any()
    assert c.bytes() == 2 * 64 * 128 + 2 * 16 * 64 * 2
    with pytest.raises(ValueError, match="per-sequence state"):
        PrefixCache(c, GIB)
    from pipeline.serve import make_prefix_cache

    engine = SimpleNamespace(model=SimpleNamespace(kv=c))
    assert make_prefix_cache(engine, SimpleNamespace(prefix_cache_gib=1.0), None) is None


def test_deepseek2_latent_cache_planned_as_allocated(tmp_path, ops):
    """deepseek2's MLA cache: one row of kv_lora_rank + rope dims per token and layer, V
    inside it; no other per-sequence state; plan == allocation."""
    path = write_deepseek2(tmp_path / "ds2.gguf", "tiny-deepseek2")
    cat = GGUFModel.open(path)
    layers, state = arch.kv_needs(cat)
    assert state is None and all(lk.latent for lk in layers)
    p = _plan(cat, _config(300, 1.0, 2))
    m = Model(cat, WeightStore.load_simple(cat), ops, n_seq=2, n_ctx=300)
    assert m.kv.bytes() == p.total_bytes == 2 * 300 * sum(2 * lk.key_dim for lk in layers)
    assert all(v is k for k, v in zip(m.kv.k, m.kv.v, strict=True))
