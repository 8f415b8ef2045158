"""torch_quant against gguf-py's reference dequantizer: bit-identical float32 on the CPU device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from moe_service.engine import torch_quant as tq
from moe_service.formats import set_iq1m_d

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16", "BF16", "F32",
         "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]

# byte offsets of the float16 scale fields of each block (random bytes there could be NaN/inf)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
              "IQ4_XS": (0,), "IQ4_NL": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
              "IQ3_S": (0,), "IQ1_S": (0,)}


def random_tensor(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks with finite scales (every other byte random)."""
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if name in ("F16", "BF16", "F32"):
        vals = rng.standard_normal((rows, cols)).astype(np.float32) * 3
        if name == "F16":
            return vals.astype(np.float16).view(np.uint8)
        if name == "BF16":
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return vals.view(np.uint8)
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS.get(name, ()):
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.05).astype(np.float16)
        blocks[:, :, at : at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if name == "MXFP4":
        blocks[:, :, 0] = rng.integers(100, 140, size=blocks.shape[:2], dtype=np.uint8)
    if name == "IQ1_M":  # its f16 d is the top nibbles of its four scale words
        set_iq1m_d(blocks.reshape(-1, size), (rng.standard_normal(blocks.shape[0] * blocks.shape[1]) * 0.05).astype(np.float16))
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", TYPES)
def test_bit_identical_to_gguf(name):
    qtype = GGMLQuantizationType[name]
    block = GGML_QUANT_SIZES[qtype][0]
    rows, cols = 7, 2 * max(block, 32)
    raw = random_tensor(name, rows, cols)
    ref = gguf_dequantize(raw, qtype).astype(np.float32, copy=False)
    assert ref.shape == (rows, cols)
    got = tq.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype), (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    # compare the bit patterns: equal values, equal signs of zero
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(ref)).view(torch.int32))


@pytest.mark.parametrize("name", ["Q4_0", "MXFP4"])
def test_every_code_and_exponent(name):
    """All 256 byte values in every quant and exponent position (E8M0 0, 1 and 255 included)."""
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.tile(np.arange(256, dtype=np.uint8), (256, 1))[:, : size * 8].reshape(-1, size)[:256]
    blocks = (blocks + np.arange(256, dtype=np.uint8)[:, None]).astype(np.uint8)
    if name == "Q4_0":
        blocks[:, 0:2] = np.full((256,), 0.125, np.float16).view(np.uint8).reshape(256, 2)
    else:
        blocks[:, 0] = np.arange(256, dtype=np.uint8)
    raw = blocks.reshape(1, -1)
    with np.errstate(over="ignore"):  # E8M0 255 times 12 is inf in both implementations
        ref = gguf_dequantize(raw, qtype).astype(np.float32)
    got = tq.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype), ref.shape)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(ref)).view(torch.int32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_chunked_path_matches(monkeypatch, name):
    """Tensors bigger than one chunk are expanded chunk by chunk into one output."""
    qtype = GGMLQuantizationType[name]
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_tensor(name, 9, 4 * block, seed=3)
    whole = tq.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype), (9, 4 * block))
    monkeypatch.setattr(tq, "CHUNK_ELEMENTS", 3 * block)  # 3 blocks per step, ragged last step
    chunked = tq.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype), (9, 4 * block))
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_outputs_are_the_rounded_float32(dtype):
    raw = random_tensor("Q4_K", 4, 512, seed=5)
    t = torch.from_numpy(raw.reshape(-1).copy())
    f32 = tq.dequantize(t, tq.Q4_K, (4, 512))
    half = tq.dequantize(t, tq.Q4_K, (4, 512), dtype=dtype)
    assert half.dtype == dtype
    assert torch.equal(half, f32.to(dtype))


def test_expert_batch_shape():
    """[E, slab_bytes] of several expert slabs -> [E, rows, cols]."""
    raw = random_tensor("Q8_0", 3 * 16, 64, seed=7)  # 3 experts of 16 rows
    ref = gguf_dequantize(raw, GGMLQuantizationType.Q8_0).reshape(3, 16, 64)
    got = tq.dequantize(torch.from_numpy(raw.reshape(3, -1).copy()), tq.Q8_0, (3, 16, 64))
    assert torch.equal(got, torch.from_numpy(ref))


def test_dequantize_numpy_uploads_a_view():
    raw = random_tensor("Q5_1", 2, 64, seed=9)
    arena = np.zeros(4096, dtype=np.uint8)
    arena[128 : 128 + raw.size] = raw.reshape(-1)
    got = tq.dequantize_numpy(arena[128 : 128 + raw.size], tq.Q5_1, (2, 64), "cpu")
    assert torch.equal(got, torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q5_1)))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="Q8_0 tensor of shape \\(2, 32\\) needs 68 bytes, got 10"):
        tq.dequantize(torch.zeros(10, dtype=torch.uint8), tq.Q8_0, (2, 32))
    with pytest.raises(ValueError, match="no torch dequantizer"):
        tq.nbytes_of(34, (1, 256))  # TQ1_0
    with pytest.raises(ValueError, match="not a multiple of 256"):
        tq.nbytes_of(tq.Q4_K, (1, 100))
    with pytest.raises(ValueError, match="must be uint8"):
        tq.dequantize(torch.zeros(34, dtype=torch.int8), tq.Q8_0, (1, 32))
    assert tq.supports(tq.MXFP4) and tq.supports(10) and not tq.supports(34)  # Q2_K yes, TQ1_0 no


def test_block_table_matches_gguf():
    for type_id, (block, size) in tq.BLOCK_SIZES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(type_id)] == (block, size)
        assert GGMLQuantizationType(type_id).name == tq.TYPE_NAMES[type_id]


def test_output_never_aliases_the_input_bytes():
    """F32 on the CPU device could be a mere view of the arena; it must be a copy."""
    raw = random_tensor("F32", 2, 8)
    arena = torch.from_numpy(raw.reshape(-1).copy())
    got = tq.dequantize(arena, tq.F32, (2, 8))
    arena.zero_()
    assert torch.equal(got, torch.from_numpy(raw.view(np.float32)))
