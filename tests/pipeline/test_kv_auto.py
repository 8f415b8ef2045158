"""engine.kv_cache_gib = "auto": the KV cache gets what the plan leaves free on its node after
the weights' share, numa.node_reserve_gib and serve.prefix_cache_gib; plan shows the context,
preflight still refuses an explicit context that does not fit (issue 26)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_service.config import Settings, load_config
from moe_service.engine.kv import CONTEXT_ALIGN, layers_from_params, plan_for_config
from moe_service.errors import CapacityError
from moe_service.numa import Topology
from pipeline.plan import kv_budget, kv_capacity, node_capacity, plan
from pipeline.preflight import run_preflight
from tests.support.numa_fixtures import GIB, fake_catalog, write_sysfs

BPT = 48 * 4 * 128 * 2 * 2  # bytes per token: 48 layers x 4 KV heads x (K + V) x 128 dims x f16
TRAINED = 131072


def _setup(tmp_path, free_gib: float, **overrides):
    root = write_sysfs(tmp_path / "host", [[0, 1]], [free_gib + 8], node_free_gib=[free_gib])
    topo = Topology.read(root=str(root))
    cat = fake_catalog(n_layers=2, n_expert=8, slab_bytes=64 << 20)  # 2 x 8 x 3 x 64 MiB = 3 GiB of experts
    cat.params = SimpleNamespace(n_layer=48, n_head_kv=4, head_dim=128, head_dim_v=128, n_ctx_train=TRAINED)
    data = {
        "numa": {"node_reserve_gib": 1.0, "sysfs_root": str(root)},
        "serve": {"parallel": 4, "prefix_cache_gib": 2.0},
    }
    for table, kv in overrides.items():
        data.setdefault(table, {}).update(kv)
    config = load_config(data=data)
    layout = plan(cat, topo, config, strict=False)
    return cat, topo, layout, config


def test_auto_is_the_default():
    assert Settings().engine.kv_cache_gib == "auto"


def test_auto_budget_is_the_nodes_memory_less_weights_reserve_and_prefix_cache(tmp_path):
    cat, topo, layout, config = _setup(tmp_path, free_gib=12.0)
    cap = next(c for c in node_capacity(layout, topo, config) if c.node == 0)
    weights = cap.needed_bytes
    assert weights > 3 * GIB
    budget, words = kv_budget(layout, topo, config)
    assert budget == 12 * GIB - 1 * GIB - weights - 2 * GIB
    assert "numa.node_reserve_gib" in words and "serve.prefix_cache_gib" in words
    kv = kv_capacity(cat, layout, topo, config)
    fit = budget // (4 * BPT)
    assert kv["fits"] and kv["budget_bytes"] == budget
    assert kv["n_ctx"] == fit // CONTEXT_ALIGN * CONTEXT_ALIGN < TRAINED  # the context plan shows
    assert "engine.kv_cache_gib = auto" in kv["sentence"] and f"{kv['n_ctx']} tokens" in kv["sentence"]
    # an agent's first request (10-12k tokens) fits where the fixed 4 GiB gave 10,752 tokens
    assert kv["n_ctx"] >= 16000
    fixed = kv_capacity(
        cat,
        layout,
        topo,
        config.model_copy(update={"engine": config.engine.model_copy(update={"kv_cache_gib": 4.0})}),
    )
    assert fixed["n_ctx"] == 4 * GIB // (4 * BPT) // CONTEXT_ALIGN * CONTEXT_ALIGN == 10752
    report = run_preflight(cat, topo, layout, config, raise_on_fail=False)
    assert next(c for c in report.checks if c.name == "kv_cache").status == "ok"


def test_auto_on_a_big_host_is_the_trained_context(tmp_path):
    cat, topo, layout, config = _setup(tmp_path, free_gib=200.0)
    kv = kv_capacity(cat, layout, topo, config)
    assert (
        kv["fits"] and kv["n_ctx"] == TRAINED and kv["total_bytes"] == 4 * TRAINED * BPT
    )  # 48 GiB, not all 200


def test_preflight_still_refuses_an_explicit_context_that_auto_cannot_hold(tmp_path):
    cat, topo, layout, config = _setup(tmp_path, free_gib=12.0, model={"context_tokens": TRAINED})
    kv = kv_capacity(cat, layout, topo, config)
    assert not kv["fits"] and "model.context_tokens = 131072" in kv["reasons"][0]
    assert "engine.kv_cache_gib = auto" in kv["reasons"][0]
    report = run_preflight(cat, topo, layout, config, raise_on_fail=False)
    check = next(c for c in report.checks if c.name == "kv_cache")
    assert check.status == "fail"
    with pytest.raises(CapacityError, match="kv_cache_gib = auto"):
        report.raise_for_failures()


def test_a_node_with_nothing_left_is_refused_naming_the_numbers(tmp_path):
    cat, topo, layout, config = _setup(tmp_path, free_gib=4.0)  # 4 - 1 reserve - 3+ weights: nothing
    kv = kv_capacity(cat, layout, topo, config)
    assert not kv["fits"] and kv["budget_bytes"] == 0
    assert "holds only 0 tokens" in kv["reasons"][0] and "serve.prefix_cache_gib" in kv["reasons"][0]


def test_on_a_small_node_the_prefix_cache_counts_for_half_of_what_is_left(tmp_path):
    """6 GiB free: 1 reserve and 3+ of weights leave ~2 GiB, less than the 2 GiB prefix cache;
    it counts for half (it grows on demand, the KV cache is allocated at start), so the KV
    cache gets the other half and the start is not refused."""
    cat, topo, layout, config = _setup(tmp_path, free_gib=6.0)
    cap = next(c for c in node_capacity(layout, topo, config) if c.node == 0)
    left = 6 * GIB - 1 * GIB - cap.needed_bytes
    budget, words = kv_budget(layout, topo, config)
    assert budget == left - left // 2 and "counted up to half" in words
    kv = kv_capacity(cat, layout, topo, config)
    assert kv["fits"] and kv["n_ctx"] == budget // (4 * BPT) // CONTEXT_ALIGN * CONTEXT_ALIGN > 0


def test_auto_without_the_plan_is_a_problem_not_a_guess():
    cat = SimpleNamespace(
        params=SimpleNamespace(n_layer=2, n_head_kv=1, head_dim=64, head_dim_v=64, n_ctx_train=512),
        tensors={},
        expert_layers={},
        shards=[],
        metadata={},
    )
    layers = layers_from_params(cat.params)
    kvp = plan_for_config(cat, Settings(), layers)
    assert not kvp.ok and "auto" in kvp.problem
    assert plan_for_config(cat, Settings(), layers, auto_budget=(GIB, "test")).n_ctx == 512
