"""bench/ds4_parts: the per-part timer's accounting on a tiny deepseek4 file (no timing
asserted: the parts' exclusive times add up to the layer's, and instrumenting is undone)."""

from __future__ import annotations

import pytest

from bench.ds4_parts import PARTS, PartTimer, instrument, profile
from moe_service.engine import ds4_ops
from moe_service.engine.arch import deepseek4
from moe_service.synth_deepseek4 import write_deepseek4
from tests.support.smollm2 import needs_smollm2


def test_instrument_restores_every_function():
    before = (
        ds4_ops.hc_pre,
        ds4_ops.attend_sinks,
        deepseek4._top_k,
        deepseek4.Deepseek4._block,
        deepseek4.Deepseek4._compress,
    )
    restore = instrument(PartTimer([0]))
    assert deepseek4.Deepseek4._block is not before[3]
    restore()
    assert (
        ds4_ops.hc_pre,
        ds4_ops.attend_sinks,
        deepseek4._top_k,
        deepseek4.Deepseek4._block,
        deepseek4.Deepseek4._compress,
    ) == before


@needs_smollm2
def test_parts_add_up_to_the_layer(tmp_path):
    path = write_deepseek4(tmp_path / "t.gguf", "tiny-deepseek4", seed=0)
    r = profile(path, threads=1, depth=24, n_decode=2, ubatch=16)
    assert r["ratios"] == [0, 4, 128, 4, 128]
    table = r["parts_ms_per_layer"]
    assert set(table) == set(PARTS)
    for col in ("ratio_0", "ratio_4", "ratio_128", "mean"):
        assert sum(row[col] for row in table.values()) == pytest.approx(r["layer_ms"][col], rel=1e-6)
        assert r["layer_ms"][col] > 0
    assert table["moe"]["mean"] > 0 and table["attention"]["mean"] > 0
    assert table["indexer top-k"]["ratio_0"] == 0.0  # only ratio-4 layers have the indexer
