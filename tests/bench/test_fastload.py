"""The load benchmark's machinery (not its speed): page-cache eviction checked with mincore,
and one short run producing every field the report promises (buffered and direct, warm and
cold, their ceilings, the page cache each leaves behind)."""

from __future__ import annotations

import pytest

from bench.fastload import cached_fraction, evict, format_table, run_bench, warm
from tests.support.gguf_factory import write_moe_gguf


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
    for res in (r, cold):  # both modes, their ceilings and the page cache they leave behind
        for key in ("fastload_buffered_gbps", "fastload_direct_gbps", "ceiling_buffered_gbps", "ceiling_direct_gbps",
                    "ratio_direct_vs_ceiling", "ratio_buffered_vs_best_ceiling"):
            assert res[key] is not None, key
        assert res["auto_io"] in ("buffered", "direct")
        assert res["page_cache_buffered_bytes"] is not None and res["page_cache_direct_fraction"] is not None
        assert 0 <= res["file_cached_direct_fraction"] <= 1
    assert r["fastload_direct_detail"]["io"] == "direct" and r["fastload_direct_detail"]["pipelined"]
    assert r["fastload_buffered_detail"]["pipelined"] is False  # warm: interleaved, as before
    assert cold["fastload_buffered_detail"]["pipelined"] is True
    text = format_table(r)
    assert "fastload buffered (" in text and "parallel O_DIRECT ceiling" in text and "page cache growth" in text
