"""The load benchmark's machinery (not its speed): page-cache eviction checked with mincore,
and one short run producing every field the report promises."""

from __future__ import annotations

import pytest

from bench.fastload import cached_fraction, evict, format_table, run_bench, warm
from tests.gguf_factory import write_moe_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    (path,) = write_moe_gguf(tmp_path_factory.mktemp("b") / "m.gguf", n_embd=256, n_ff_exp=256, n_expert=8)
    return path


def test_warm_then_evict_is_seen_by_mincore(model):
    warm([model])
    assert cached_fraction(model) > 0.98
    assert evict([model]) in ("fadvise", "drop_caches")
    assert cached_fraction(model) <= 0.02


def test_one_short_run_has_every_field(model):
    r = run_bench(model, threads=2, repeats=1, cold_repeats=1, llamacpp=False, log=lambda *a: None)
    for key in ("fastload_gbps", "single_thread_gbps", "ceiling_gbps", "ratio_vs_ceiling", "cache"):
        assert r[key] is not None, key
    assert r["cache"] == "warm" and r["llamacpp"] is None and r["llamacpp_gbps"] is None
    cold = r["cold"]
    assert cold["cache"] == "cold" and cold["method"] in ("fadvise", "drop_caches") and cold["fastload_gbps"]
    assert 1 <= r["fastload_detail"]["threads"] <= min(2, r["cpus"])  # also capped by the chunk count
    assert "fastload (" in format_table(r)
