"""Synthetic GGUF models: byte-exact regeneration, valid blocks, shapes llama.cpp loaded."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.errors import ConfigError
from moe_service.synth import (
    BLOCK_FORMATS,
    EXPERT_TYPES,
    PRESETS,
    _pack_k_scales,
    make_blocks,
    random_bytes,
    resolve_preset,
    sha256_file,
    tensor_bytes,
    tensor_plan,
    vocab_metadata,
    write_synthetic,
)
from tests.fixtures.golden import golden_model, golden_model_names, model_file
from tests.support.smollm2 import needs_smollm2

SYNTH_GOLDEN = [n for n in golden_model_names() if golden_model(n).source["kind"] == "synth"]
FAST_GOLDEN = [n for n in SYNTH_GOLDEN if not golden_model(n).slow]
SLOW_GOLDEN = [n for n in SYNTH_GOLDEN if golden_model(n).slow]


@needs_smollm2
@pytest.mark.parametrize("name", FAST_GOLDEN)
def test_golden_synthetic_models_regenerate_byte_identical(name, tmp_path):
    g = golden_model(name)
    path = model_file(g, tmp_path)  # asserts the sha256 llama.cpp's outputs were made from
    assert path.stat().st_size == g.file_bytes


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_GOLDEN)
def test_big_golden_synthetic_models_regenerate_byte_identical(name, tmp_path):
    g = golden_model(name)
    assert model_file(g, tmp_path).stat().st_size == g.file_bytes


def test_golden_covers_both_architectures_and_required_expert_types():
    seen = {(golden_model(n).source["preset"], golden_model(n).source["expert_type"]) for n in FAST_GOLDEN}
    for preset in ("tiny-llama", "tiny-qwen3moe"):
        for et in ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"):
            assert (preset, et) in seen


@needs_smollm2
def test_same_arguments_same_bytes_other_seed_other_bytes(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", "tiny-llama", n_layer=1, expert_type="Q4_K", seed=5)
    b = write_synthetic(tmp_path / "b.gguf", "tiny-llama", n_layer=1, expert_type="Q4_K", seed=5)
    c = write_synthetic(tmp_path / "c.gguf", "tiny-llama", n_layer=1, expert_type="Q4_K", seed=6)
    assert sha256_file(a) == sha256_file(b) != sha256_file(c)
    assert not list(tmp_path.glob(".*tmp*"))  # temporary files renamed away


@needs_smollm2
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3moe"])
def test_written_file_has_the_planned_tensors_and_keys(preset, tmp_path):
    import gguf

    from moe_service.engine.tokenizer import read_gguf_metadata

    p = resolve_preset(preset, expert_type="Q6_K")
    path = write_synthetic(tmp_path / "m.gguf", p)
    r = gguf.GGUFReader(str(path))
    got = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name, int(t.n_bytes)) for t in r.tensors}
    want = {t.name: (t.ne, t.qtype, t.nbytes) for t in tensor_plan(p)}
    assert got == want
    meta = read_gguf_metadata(path)
    a = p.arch
    assert meta["general.architecture"] == a
    assert meta[f"{a}.expert_count"] == p.n_expert and meta[f"{a}.expert_used_count"] == p.n_expert_used
    assert meta[f"{a}.block_count"] == p.n_layer
    if a == "qwen3moe":
        assert meta[f"{a}.expert_feed_forward_length"] == p.n_ff_exp
        assert meta[f"{a}.attention.key_length"] == p.head_dim
        assert "blk.0.attn_q_norm.weight" in got
    else:
        assert meta[f"{a}.feed_forward_length"] == p.n_ff_exp
    assert len(meta["tokenizer.ggml.tokens"]) == p.n_vocab
    experts = got["blk.1.ffn_down_exps.weight"]
    assert experts[0] == (p.n_ff_exp, p.n_embd, p.n_expert) and experts[1] == "Q6_K"


@pytest.mark.parametrize("qtype", EXPERT_TYPES)
def test_blocks_are_valid_and_have_the_target_scale(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    std = 1.0 / np.sqrt(2048)
    data = tensor_bytes(qtype, 0, "blk.0.ffn_up_exps.weight", n_rows=64, row_elems=512, std=std)
    qk, bs = BLOCK_FORMATS[qtype]
    assert data.nbytes == 64 * 512 // qk * bs
    x = dequantize(data.reshape(64, -1), GGMLQuantizationType[qtype]).astype(np.float64)
    assert x.shape == (64, 512)
    assert np.isfinite(x).all()
    assert 0.8 * std < x.std() < 1.25 * std
    assert abs(x.mean()) < 0.15 * std  # Q4_0's (q - 8) leaves a small negative mean by design
    assert len(np.unique(x)) > (10 if qtype == "MXFP4" else 100)  # not degenerate (MXFP4: 15 codes x 2 scales)


def test_k_scale_packing_inverts_ggml_unpacking():
    rng = np.random.default_rng(0)
    sc = rng.integers(0, 64, size=(50, 8))
    m = rng.integers(0, 64, size=(50, 8))
    s = _pack_k_scales(sc, m).astype(np.int64)
    for j in range(8):  # get_scale_min_k4, as ggml-quants.c
        if j < 4:
            d, mm = s[:, j] & 63, s[:, j + 4] & 63
        else:
            d = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            mm = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
        np.testing.assert_array_equal(d, sc[:, j])
        np.testing.assert_array_equal(mm, m[:, j])


def test_random_stream_is_chunk_and_name_specific():
    a = random_bytes(0, "x", 100)
    assert np.array_equal(a, random_bytes(0, "x", 100))
    assert np.array_equal(a[:37], random_bytes(0, "x", 37))
    assert not np.array_equal(a, random_bytes(0, "y", 100))
    assert not np.array_equal(a, random_bytes(0, "x", 100, chunk=1))
    assert not np.array_equal(a, random_bytes(1, "x", 100))


def test_make_blocks_rejects_unknown_type():
    with pytest.raises(ConfigError):
        make_blocks("TQ1_0", np.zeros((1, 54), np.uint8), 1.0)


def test_preset_validation_names_the_field():
    with pytest.raises(ConfigError, match="unknown synthetic preset"):
        resolve_preset("nope")
    with pytest.raises(ConfigError, match="n_embd = 96 is not a multiple of the Q4_K block size 256"):
        resolve_preset("tiny-llama", expert_type="Q4_K", n_embd=96, n_head=1, head_dim=96)
    with pytest.raises(ConfigError, match="expert_type"):
        resolve_preset("tiny-llama", expert_type="TQ1_0")
    with pytest.raises(ConfigError, match="n_expert_used"):
        resolve_preset("tiny-qwen3moe", n_expert_used=17)
    with pytest.raises(ConfigError, match="n_layer"):
        resolve_preset("tiny-qwen3moe", n_layer=0)


def test_qwen3_30b_preset_has_the_real_shapes():
    p = PRESETS["qwen3-30b-a3b"]
    assert (p.n_embd, p.n_expert, p.n_ff_exp, p.n_expert_used) == (2048, 128, 768, 8)
    assert (p.n_head, p.n_head_kv, p.head_dim, p.n_vocab) == (32, 4, 128, 151936)
    plan = {t.name: t for t in tensor_plan(resolve_preset(p, n_layer=4, expert_type="Q8_0"))}
    assert plan["blk.3.ffn_gate_exps.weight"].ne == (2048, 768, 128)
    assert plan["blk.3.attn_q.weight"].ne == (2048, 4096)
    assert plan["blk.3.attn_k.weight"].ne == (2048, 512)
    total = sum(t.nbytes for t in plan.values())
    assert 3.2e9 < total < 3.4e9  # 2.6 GB of experts at 4 layers, Q8_0, + 2 x 0.33 GB embd/output
    resolve_preset(p, expert_type="Q4_K")  # 2048 and 768 are multiples of 256


@needs_smollm2
def test_qwen2_vocab_uses_qwen_ids_and_consistent_merges():
    meta = vocab_metadata("qwen2", 151936)
    toks, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(toks) == len(types) == 151936
    assert toks[151643:151646] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[151643:151646] == [3, 3, 3] and types[151646] == 4
    assert meta["tokenizer.ggml.eos_token_id"] == 151645
    vocab = set(toks)
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ", 1)
        assert a in vocab and b in vocab and a + b in vocab
    small = vocab_metadata("qwen2", 8192)
    assert small["tokenizer.ggml.tokens"][8185:8188] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    with pytest.raises(ConfigError):
        vocab_metadata("klingon", 1000)


@needs_smollm2
def test_smollm2_vocab_truncation_keeps_merges_inside():
    meta = vocab_metadata("smollm2", 8192)
    vocab = set(meta["tokenizer.ggml.tokens"])
    assert len(meta["tokenizer.ggml.tokens"]) == 8192
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ", 1)
        assert a + b in vocab
