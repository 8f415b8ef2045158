"""Tiny GGUF files for tests, written with gguf.GGUFWriter (the reference writer).

``write_moe_gguf`` writes a small llama-architecture MoE model with random bytes in every
tensor (the catalog and the loader care about bytes and offsets, not values);
``write_sparse_gguf`` writes a model whose big tensor is a hole in a sparse file (multi-GiB
tensors without writing GiBs); ``patch_tensor_info`` edits a written tensor-info entry in
place (type id, ne[0], offset, name) to make broken files.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

Q8_0 = GGMLQuantizationType.Q8_0


def _qbytes(rng: np.random.Generator, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    """Random bytes with the byte shape of a ``qtype`` tensor of numpy shape ``shape``."""
    block, size = GGML_QUANT_SIZES[qtype]
    assert shape[-1] % block == 0
    return rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


def write_moe_gguf(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_vocab: int = 40,
    qtype: GGMLQuantizationType = Q8_0,
    fused_gate_up: bool = False,
    split_max_tensors: int = 0,
    alignment: int | None = None,
    extra_tensors: int = 0,
    seed: int = 0,
) -> list[Path]:
    """Write a llama-architecture MoE GGUF; return the file(s) written (several when split).

    Expert tensors: ffn_gate_exps/ffn_up_exps numpy [E, I, H], ffn_down_exps [E, H, I] (or one
    fused ffn_gate_up_exps [E, 2I, H]); ``extra_tensors`` adds F32 tensors ``extra.N`` of
    varied sizes (to make more shards or odd sizes).
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    if alignment is not None:  # set directly: the writer's add_custom_alignment refuses non-powers of two
        w.data_alignment = alignment
        w.add_uint32("general.alignment", alignment)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff_exp)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(n_embd // 4)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_token_list([f"tok{i}" for i in range(n_vocab)])
    H, I, E = n_embd, n_ff_exp, n_expert  # noqa: E741, N806
    w.add_tensor("token_embd.weight", _qbytes(rng, (n_vocab, H), qtype), raw_dtype=qtype)
    for b in range(n_layer):
        p = f"blk.{b}."
        w.add_tensor(p + "attn_norm.weight", rng.standard_normal(H).astype(np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):  # 4 heads, 2 KV heads
            rows = H // 2 if name in ("attn_k", "attn_v") else H
            w.add_tensor(p + name + ".weight", _qbytes(rng, (rows, H), qtype), raw_dtype=qtype)
        w.add_tensor(p + "ffn_norm.weight", rng.standard_normal(H).astype(np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, H)).astype(np.float32))
        if fused_gate_up:
            w.add_tensor(p + "ffn_gate_up_exps.weight", _qbytes(rng, (E, 2 * I, H), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(p + "ffn_gate_exps.weight", _qbytes(rng, (E, I, H), qtype), raw_dtype=qtype)
            w.add_tensor(p + "ffn_up_exps.weight", _qbytes(rng, (E, I, H), qtype), raw_dtype=qtype)
        w.add_tensor(p + "ffn_down_exps.weight", _qbytes(rng, (E, H, I), qtype), raw_dtype=qtype)
    for i in range(extra_tensors):
        w.add_tensor(f"extra.{i}", rng.standard_normal(7 + 13 * i).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(H).astype(np.float32))
    w.add_tensor("output.weight", _qbytes(rng, (n_vocab, H), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(path))


def write_sparse_gguf(path: Path, big_nbytes: int, *, seed: int = 0) -> dict[str, tuple[int, int]]:
    """Write a GGUF with tensor ``big`` (Q8_0, about ``big_nbytes`` bytes) stored as a hole
    in a sparse file, then ``small`` (F32, 1000 elements) after it. Random 1 MiB patches are
    written at the start of ``big``, across the 2 GiB and 4 GiB marks of the file when they
    fall inside it, and at its end, so a loader that misplaces bytes is caught.

    Returns name -> (absolute file offset, nbytes) as this writer laid them out.
    """
    block, size = GGML_QUANT_SIZES[Q8_0]
    cols = 4096
    row_bytes = cols // block * size
    rows = -(-big_nbytes // row_bytes)
    big = rows * row_bytes
    w = GGUFWriter(path, "llama")
    w.add_block_count(0)
    w.add_embedding_length(cols)
    w.add_head_count(1)
    w.add_tensor_info("big", (rows, row_bytes), np.dtype(np.uint8), big, raw_dtype=Q8_0)
    w.add_tensor_info("small", (1000,), np.dtype(np.float32), 4000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    w.write_padding(f, f.tell())
    data = f.tell()
    w.close()
    small_off = data + GGUFWriter.ggml_pad(big, w.data_alignment)
    rng = np.random.default_rng(seed)
    with open(path, "r+b") as f:
        f.truncate(small_off + 4000)
        patch = 1 << 20
        for at in (data, (1 << 31) - patch // 2, (1 << 32) - patch // 2, data + big - patch):
            if data <= at and at + patch <= data + big:
                f.seek(at)
                f.write(rng.integers(0, 256, patch, dtype=np.uint8).tobytes())
        f.seek(small_off)
        f.write(rng.standard_normal(1000).astype(np.float32).tobytes())
    return {"big": (data, big), "small": (small_off, 4000)}


def tensor_info_offset(path: Path, name: str) -> tuple[int, int]:
    """(byte offset of the tensor-info entry's n_dims field, n_dims) for tensor ``name``:
    the entry is ``u64 len, name, u32 n_dims, i64 ne[n_dims], u32 type, u64 offset``."""
    raw = Path(path).read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.find(key)
    assert at >= 0, f"{name} not found in {path}"
    nd = at + len(key)
    return nd, struct.unpack_from("<I", raw, nd)[0]


def patch_tensor_info(
    path: Path,
    name: str,
    *,
    type_id: int | None = None,
    ne0: int | None = None,
    offset_delta: int = 0,
    new_name: str | None = None,
) -> None:
    """Rewrite fields of tensor ``name``'s info entry in place (``new_name`` must have the same length)."""
    nd, n_dims = tensor_info_offset(path, name)
    with open(path, "r+b") as f:
        if ne0 is not None:
            f.seek(nd + 4)
            f.write(struct.pack("<q", ne0))
        type_at = nd + 4 + 8 * n_dims
        if type_id is not None:
            f.seek(type_at)
            f.write(struct.pack("<I", type_id))
        if offset_delta:
            f.seek(type_at + 4)
            (off,) = struct.unpack("<Q", f.read(8))
            f.seek(type_at + 4)
            f.write(struct.pack("<Q", off + offset_delta))
        if new_name is not None:
            assert len(new_name) == len(name)
            f.seek(nd - len(name))
            f.write(new_name.encode())
