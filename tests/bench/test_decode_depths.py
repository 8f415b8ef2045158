"""`moe-service bench decode --depths ... --depth-repeats R`: how rounds combine (bench/decode.py).

The engines themselves are not run here (a prefill at depth takes minutes); depth_row is the
arithmetic that turns our rounds and llama.cpp's rounds into one row.
"""

from __future__ import annotations

import pytest

from bench.decode import depth_row, main


def _ours(pre, dec):
    return {"prefill_tok_s": sorted(pre)[len(pre) // 2], "decode_tok_s": sorted(dec)[len(dec) // 2],
            "prefill_runs": pre, "decode_runs": dec}


def test_ratio_is_the_median_of_the_rounds_ratios():
    # round 2 ran while the machine was slow for both engines: its ratio is still 1.2
    ours = _ours([300.0, 150.0, 330.0], [60.0, 30.0, 40.0])
    peer = [{"llamacpp_prefill_tok_s": 200.0, "llamacpp_decode_tok_s": 50.0},
            {"llamacpp_prefill_tok_s": 100.0, "llamacpp_decode_tok_s": 25.0},
            {"llamacpp_prefill_tok_s": 300.0, "llamacpp_decode_tok_s": 50.0}]
    row = depth_row(4096, ours, peer)
    assert row["depth"] == 4096
    assert row["prefill_ratio_runs"] == pytest.approx([1.5, 1.5, 1.1])
    assert row["decode_ratio_runs"] == pytest.approx([1.2, 1.2, 0.8])
    assert row["prefill_ratio"] == pytest.approx(1.5) and row["decode_ratio"] == pytest.approx(1.2)
    # each engine's figure is its own median
    assert row["llamacpp_prefill_tok_s"] == 200.0 and row["llamacpp_decode_tok_s"] == 50.0
    assert row["prefill_tok_s"] == 300.0 and row["decode_tok_s"] == 40.0


def test_each_round_takes_the_faster_llama_configuration():
    ours = _ours([100.0], [20.0])
    peer = [{"llamacpp_prefill_tok_s": 50.0, "llamacpp_decode_tok_s": 10.0,
             "llamacpp_fa_prefill_tok_s": 80.0, "llamacpp_fa_decode_tok_s": None}]
    row = depth_row(2048, ours, peer)
    assert row["prefill_ratio"] == pytest.approx(1.25) and row["decode_ratio"] == pytest.approx(2.0)
    assert "llamacpp_fa_decode_tok_s" not in row


def test_without_the_peer_there_is_no_ratio_and_the_reason_is_kept():
    ours = _ours([100.0, 90.0], [20.0, 19.0])
    assert "decode_ratio" not in depth_row(512, ours, [])
    row = depth_row(512, ours, [{"llamacpp_prefill_tok_s": None, "llamacpp_decode_tok_s": None,
                                 "llamacpp": "llama-cpp-python is not installed"}])
    assert row["llamacpp"] == "llama-cpp-python is not installed" and "prefill_ratio" not in row


def test_a_depth_beyond_the_context_keeps_its_reason():
    row = depth_row(99999, {"reason": "beyond the trained context of 8192 tokens"}, [])
    assert row == {"depth": 99999, "reason": "beyond the trained context of 8192 tokens"}


def test_depth_repeats_below_one_is_refused(capsys, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert main(["--model", str(f), "--depths", "512", "--depth-repeats", "0"]) == 2
    assert "--depth-repeats 0: at least 1" in capsys.readouterr().err
