"""bench/v4_matvecs: the groups hold the V4-Flash layer's streamed bytes, every group is timed
(small shapes, no timing asserted), the matmuls give quant.matmul's results, and the CLI's
refusals."""

from __future__ import annotations

import numpy as np

from bench import v4_matvecs
from moe_service.engine import quant as q
from moe_service.engine.pool import WorkerPool


def test_full_shapes_hold_the_layers_streamed_bytes():
    # blk.1 of deepseek-v4-flash-L4-c8bebc79ad.gguf: Q8_0 attention 118.1 MB, shared expert
    # 26.7 MB, 6 of 16 MXFP4 experts (213.9 MB) 80.2 MB
    mb = {}
    for name, tid, shapes in v4_matvecs.GROUPS:
        mb[name] = sum(r * q.row_bytes(tid, c) for r, c in shapes) / 1e6
    attn = sum(v for k, v in mb.items() if k.startswith("attn"))
    shared = sum(v for k, v in mb.items() if k.startswith("shared"))
    experts = sum(v for k, v in mb.items() if k.startswith("experts"))
    assert round(attn, 1) == 118.1 and round(shared, 1) == 26.7 and round(experts, 1) == 80.2


def test_every_group_is_timed_and_the_pool_matmuls_match_quant():
    r = v4_matvecs.run(threads=2, repeats=2, row_scale=1 / 256, hot_calls=3, bandwidth=False)
    assert [g["name"] for g in r["groups"]] == [name for name, _, _ in v4_matvecs.GROUPS]
    for g in r["groups"]:
        assert g["median_ms"] > 0 and g["min_ms"] <= g["median_ms"] and g["ceiling_gbps"] > 0
    assert "experts down" in v4_matvecs.format_table(r)
    arena, plan = v4_matvecs.build(1 / 256)
    x = np.random.default_rng(1).standard_normal((1, 2048)).astype(np.float32)
    name, tid, refs, _ = plan[-1]
    with WorkerPool(n_threads=2) as pool:
        got = pool.matmul(arena, refs, x)
    for (off, t, rows, cols), y in zip(refs, got, strict=True):
        assert np.array_equal(y, q.matmul(arena, off, t, rows, cols, x))


def test_cli_refuses_bad_arguments(capsys):
    assert v4_matvecs.main(["--threads", "0"]) == 2
    assert v4_matvecs.main(["--row-scale", "2"]) == 2
    assert "--row-scale" in capsys.readouterr().err
