"""`moe-service bench decode --per-layer`: the file pairing and the per-layer arithmetic
(bench/layers.py). No engine runs and no timing is asserted: the rounds below are made up."""

from __future__ import annotations

import dataclasses

import pytest

from bench.decode import main
from bench.layers import LayerPair, parse_sets, per_layer_row, per_layer_s
from moe_service.errors import ConfigError
from moe_service.gguf_model import GGUFModel
from moe_service.synth_deepseek4 import Deepseek4Preset


def _diff(a, b) -> dict:
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return {k: (da[k], db[k]) for k in da if da[k] != db[k]}


# ---- pairing


def test_deepseek4_pair_repeats_the_pattern_and_keeps_the_hash_layers():
    pair = LayerPair("deepseek-v4-flash", 2, 6, pattern=(4, 128), overrides=(("n_expert", 32),))
    small, big = pair.resolved(2), pair.resolved(6)
    assert small.compress_ratios == (4, 128) and big.compress_ratios == (4, 128, 4, 128, 4, 128)
    # the preset has 3 hash layers: capped at the small file's 2, the same in both
    assert small.hash_layers == big.hash_layers == 2
    assert small.n_expert == big.n_expert == 32
    # nothing else differs
    assert set(_diff(small, big)) == {"compress_ratios"}
    assert pair.added_layers == 4


def test_deepseek4_pair_default_pattern_and_explicit_lead_layers():
    pair = LayerPair("tiny-deepseek4", 5, 10, lead_layers=1)
    small, big = pair.resolved(5), pair.resolved(10)
    assert big.compress_ratios == small.compress_ratios * 2 == (0, 4, 128, 4, 128) * 2
    assert small.hash_layers == big.hash_layers == 1
    assert set(_diff(small, big)) == {"compress_ratios"}


def test_deepseek2_pair_keeps_the_dense_lead():
    pair = LayerPair("deepseek-v3", 4, 6)
    small, big = pair.resolved(4), pair.resolved(6)
    assert small.n_dense_lead == big.n_dense_lead == 3  # the preset's, below the small count
    assert set(_diff(small, big)) == {"n_layer"}
    assert (
        LayerPair("deepseek-v3", 2, 4).resolved(4).n_dense_lead == 1
    )  # capped at small - 1: a MoE layer remains


def test_synth_pair_differs_only_in_layer_count():
    pair = LayerPair("qwen3-30b-a3b", 2, 4)
    assert set(_diff(pair.resolved(2), pair.resolved(4))) == {"n_layer"}


@pytest.mark.parametrize(
    "pair, match",
    [
        (LayerPair("deepseek-v4-flash", 2, 5, pattern=(4, 128)), "not whole repetitions"),
        (LayerPair("deepseek-v4-flash", 4, 4), "small < big"),
        (
            LayerPair("deepseek-v4-flash", 2, 4, lead_layers=3, pattern=(4, 128)),
            "hash-routed layers must be in 0..2",
        ),
        (LayerPair("deepseek-v3", 2, 4, lead_layers=2), "dense layers must be in 0..1"),
        (LayerPair("qwen3-30b-a3b", 2, 4, lead_layers=1), "--lead-layers is for"),
        (LayerPair("qwen3-30b-a3b", 2, 4, pattern=(4,)), "--pattern is for deepseek4"),
        (LayerPair("no-such-preset", 2, 4), "not a synthetic preset"),
    ],
)
def test_bad_pairs_are_config_errors(pair, match):
    with pytest.raises(ConfigError, match=match):
        pair.changes(pair.small)


def test_file_names_carry_the_fields():
    a = LayerPair("tiny-deepseek4", 5, 10)
    b = LayerPair("tiny-deepseek4", 5, 10, overrides=(("n_expert", 8),))
    assert a.file_name(5).startswith("tiny-deepseek4-L5-") and a.file_name(5) != a.file_name(10)
    assert a.file_name(5) != b.file_name(5)
    assert a.file_name(5) == LayerPair("tiny-deepseek4", 5, 15).file_name(5)  # same file, reused


def test_written_pair_shares_layer_tensors(tmp_path):
    pair = LayerPair("tiny-qwen3moe", 1, 2)
    small, big = pair.write(tmp_path)
    assert pair.write(tmp_path) == (small, big)  # reused, not rewritten
    a, b = GGUFModel.open(small), GGUFModel.open(big)
    assert a.params.n_layer == 1 and b.params.n_layer == 2
    assert set(a.tensors) < set(b.tensors)
    assert {n for n in b.tensors if n not in a.tensors} == {n for n in b.tensors if n.startswith("blk.1.")}
    # layer 0's bytes are the same in both files (the writers seed by tensor name)
    t_a, t_b = a.tensors["blk.0.ffn_up_exps.weight"], b.tensors["blk.0.ffn_up_exps.weight"]
    with open(small, "rb") as fa, open(big, "rb") as fb:
        fa.seek(t_a.file_offset)
        fb.seek(t_b.file_offset)
        assert fa.read(t_a.nbytes) == fb.read(t_b.nbytes)


def test_parse_sets_types_fields():
    got = parse_sets(
        ["n_expert=32", "compress_ratios=4,128", "weights_scale=2.5", "successor_head=true", "vocab=qwen2"],
        Deepseek4Preset,
    )
    assert got == {
        "n_expert": 32,
        "compress_ratios": (4, 128),
        "weights_scale": 2.5,
        "successor_head": True,
        "vocab": "qwen2",
    }
    with pytest.raises(ConfigError, match="FIELD one of"):
        parse_sets(["no_field=1"], Deepseek4Preset)
    with pytest.raises(ConfigError, match="not a valid int"):
        parse_sets(["n_expert=many"], Deepseek4Preset)


# ---- arithmetic


def test_per_layer_s():
    assert per_layer_s(0.020, 0.040, 2, 4) == pytest.approx(0.010)
    assert per_layer_s(0.030, 0.028, 2, 6) == pytest.approx(-0.0005)  # noise larger than the layers: negative
    with pytest.raises(ValueError):
        per_layer_s(0.02, 0.04, 4, 4)


def _round(dec, pre, ll_dec, ll_pre, fa_dec=None):
    return {
        "decode_tok_s": dec,
        "prefill_tok_s": pre,
        "llamacpp_decode_tok_s": ll_dec,
        "llamacpp_prefill_tok_s": ll_pre,
        "llamacpp_fa_decode_tok_s": fa_dec,
    }


def test_per_layer_row_from_matched_rounds():
    # round 1: ours 20 ms (2 layers) -> 40 ms (4 layers): 10 ms/layer; llama.cpp 25 -> 55 ms: 15 ms/layer
    # prefill of 1000 tokens: ours 4 s -> 8 s (2 s/layer), llama.cpp 5 s -> 11 s (3 s/layer)
    small = [_round(50.0, 250.0, 40.0, 200.0), _round(25.0, 250.0, 20.0, 200.0)]
    big = [_round(25.0, 125.0, 1 / 0.055, 1000 / 11), _round(12.5, 125.0, 1 / 0.110, 1000 / 11)]
    row = per_layer_row(1000, small, big, 2, 4, n_decode=16)
    assert row["ours_decode_ms_per_layer_runs"] == pytest.approx([10.0, 20.0])
    assert row["llamacpp_decode_ms_per_layer_runs"] == pytest.approx([15.0, 30.0])
    assert row["decode_ratio_runs"] == pytest.approx([1.5, 1.5])
    # best of rounds: ours 50 and 25 tok/s (20 ms -> 40 ms: 10 ms/layer); llama.cpp 40 tok/s
    # and 1/0.055 (25 ms -> 55 ms: 15 ms/layer)
    assert row["ours_decode_ms_per_layer_best"] == pytest.approx(10.0)
    assert row["llamacpp_decode_ms_per_layer_best"] == pytest.approx(15.0)
    assert row["decode_ratio_best"] == pytest.approx(1.5)
    assert row["decode_ratio"] == pytest.approx(1.5)
    assert row["ours_prefill_ms_per_layer"] == pytest.approx(2000.0)
    assert row["llamacpp_prefill_ms_per_layer"] == pytest.approx(3000.0)
    assert row["prefill_ratio"] == pytest.approx(1.5)
    # whole files: medians of tok/s and of the rounds' ours / llama.cpp ratios
    assert row["small_decode_ratio"] == pytest.approx(1.25)
    assert row["big_decode_tok_s"] == pytest.approx(18.75)


def test_per_layer_row_takes_the_faster_llama_configuration_and_skips_negative_layers():
    small = [_round(50.0, 100.0, 40.0, 100.0, fa_dec=50.0)]  # llama.cpp FA 20 ms
    big = [_round(25.0, 100.0, 20.0, 100.0, fa_dec=1 / 0.030)]  # llama.cpp FA 30 ms: 5 ms/layer
    row = per_layer_row(512, small, big, 2, 4, n_decode=8)
    assert row["llamacpp_decode_ms_per_layer"] == pytest.approx(5.0)
    assert row["decode_ratio"] == pytest.approx(0.5)
    # the prefill times are equal: 0 per layer, no ratio
    assert row["ours_prefill_ms_per_layer"] == pytest.approx(0.0) and "prefill_ratio" not in row


def test_per_layer_row_without_the_peer():
    small = [{"decode_tok_s": 50.0, "prefill_tok_s": 100.0, "llamacpp_decode_tok_s": None}]
    big = [{"decode_tok_s": 25.0, "prefill_tok_s": 50.0}]
    row = per_layer_row(512, small, big, 1, 2, n_decode=8)
    assert row["ours_decode_ms_per_layer"] == pytest.approx(20.0)
    assert "decode_ratio" not in row and "llamacpp_decode_ms_per_layer" not in row


# ---- command line


def test_cli_refuses_a_bad_pair(capsys):
    assert main(["--per-layer", "deepseek-v4-flash", "--pattern", "4,128", "--layers", "2,5"]) == 2
    assert "not whole repetitions" in capsys.readouterr().err
    assert main(["--per-layer", "deepseek-v4-flash", "--set", "n_expert=lots"]) == 2
    assert "not a valid int" in capsys.readouterr().err
    assert main(["--per-layer", "nope"]) == 2
    assert "not a synthetic preset" in capsys.readouterr().err
    assert main(["--per-layer", "qwen3-30b-a3b", "--tensor-types", "shexp=Q6_K"]) == 2
    assert "matches no tensor" in capsys.readouterr().err  # checked before any file is written
    assert main(["--per-layer", "qwen3-30b-a3b", "--tensor-types", "ud-iq1_x"]) == 2
    assert "nor a named recipe" in capsys.readouterr().err
    assert (
        main(
            ["--per-layer", "qwen3-30b-a3b", "--tensor-types", "ud-iq1_s", "--set", "tensor_types=down=Q4_K"]
        )
        == 2
    )
    assert "give the recipe once" in capsys.readouterr().err


# ---- per-tensor type recipes


def test_recipe_is_in_the_file_names_and_digests():
    plain = LayerPair("qwen3-30b-a3b", 2, 4)
    named = LayerPair("qwen3-30b-a3b", 2, 4, overrides=(("tensor_types", "ud-iq1_s"),))
    rules = LayerPair(
        "qwen3-30b-a3b", 2, 4, overrides=(("tensor_types", "gate=IQ1_S,up=IQ1_S,down=IQ2_XXS"),)
    )
    assert named.file_name(2).startswith("qwen3-30b-a3b-ud-iq1_s-L2-")
    assert rules.file_name(4).startswith("qwen3-30b-a3b-gate-iq1_s+up-iq1_s+down-iq2_xxs-L4-")
    assert len({plain.file_name(2), named.file_name(2), rules.file_name(2)}) == 3
    assert "tensor types ud-iq1_s" in named.describe()
    # the pair still differs only in its layer count
    assert set(_diff(named.resolved(2), named.resolved(4))) == {"n_layer"}


@pytest.mark.parametrize(
    "preset, recipe, small, big, want",
    [
        # qwen3moe: every layer alike; layer 0's experts kept at Q4_K in both files
        (
            "tiny-qwen3moe",
            "ud-iq1_s,experts@0=Q4_K",
            1,
            2,
            {
                "blk.0.ffn_gate_exps.weight": "Q4_K",
                "blk.1.ffn_gate_exps.weight": "IQ1_S",
                "blk.1.ffn_up_exps.weight": "IQ1_S",
                "blk.1.ffn_down_exps.weight": "IQ2_XXS",
                "blk.1.attn_q.weight": "Q8_0",
                "output.weight": "Q6_K",
            },
        ),
        # deepseek2: one dense lead layer (ffn at Q6_K), MoE layers after it; attn_v_b has rows
        # of 128 (kv_lora_rank), which Q6_K does not fit: it keeps the writer's Q8_0
        (
            "tiny-deepseek2",
            "ud-iq2_xxs",
            2,
            3,
            {
                "blk.0.ffn_down.weight": "Q6_K",
                "blk.2.ffn_gate_exps.weight": "IQ2_XXS",
                "blk.2.ffn_up_exps.weight": "IQ2_XXS",
                "blk.2.ffn_down_exps.weight": "Q2_K",
                "blk.2.ffn_gate_shexp.weight": "Q6_K",
                "blk.2.attn_output.weight": "Q6_K",
                "blk.2.attn_v_b.weight": "Q8_0",
                "token_embd.weight": "Q4_K",
            },
        ),
    ],
)
def test_written_pair_carries_the_recipe(tmp_path, preset, recipe, small, big, want):
    pair = LayerPair(preset, small, big, overrides=(("tensor_types", recipe),))
    pair.check_recipe()
    a_path, b_path = pair.write(tmp_path)
    a, b = GGUFModel.open(a_path), GGUFModel.open(b_path)
    types = {n: t.type_name for n, t in b.tensors.items()}
    assert {n: types[n] for n in want} == want
    # the small file's layers have the big file's types, tensor by tensor
    assert all(types[n] == t.type_name for n, t in a.tensors.items())
