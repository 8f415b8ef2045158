"""bench/ds4_decode_kernels: both forms of each case timed (small shapes, no timing asserted),
and the CLI's refusals; bench/ds4_parts' --clock refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import ds4_decode_kernels, ds4_parts


def test_every_case_times_both_forms():
    r = ds4_decode_kernels.run(reps=2, threads=2, evict_mib=1, heads=8, head_dim=64)
    assert set(r["cases"]) == {
        "hc_pre",
        "attention 256 keys (ratio 4, depth 512)",
        "attention 640 keys (ratio 4, depth 4096)",
        "attention 132 keys (ratio 128, depth 512)",
    }
    for v in r["cases"].values():
        for form in ("main", "ds4_decode"):
            s = v[form]
            assert all(np.isfinite(s[k]) and s[k] > 0 for k in ("median_ms", "p25_ms", "min_ms"))
            assert s["min_ms"] <= s["p25_ms"] <= s["median_ms"]
    assert "hc_pre" in ds4_decode_kernels.format_table(r)


def test_cli_refuses_one_worker(capsys):
    assert ds4_decode_kernels.main(["--threads", "1"]) == 2
    assert "--threads >= 2" in capsys.readouterr().err


def test_ds4_parts_cpu_clock_needs_one_thread(tmp_path: Path):
    with pytest.raises(SystemExit, match="needs --threads 1"):
        ds4_parts.profile(tmp_path / "x.gguf", 2, 16, 2, clock="cpu")
    with pytest.raises(SystemExit, match="--clock sun"):
        ds4_parts.profile(tmp_path / "x.gguf", 1, 16, 2, clock="sun")
