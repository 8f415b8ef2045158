"""GGUF block dequantization in torch: runs on whichever device holds the bytes (CUDA or CPU).

Used where weights go to a GPU: the dense matrices uploaded once at start (raw block bytes go
over PCIe, the GPU expands them, so the host does no per-element work) and the expert slabs
streamed by the prefill offload (moe_service.engine.offload).

Every format is one function from a uint8 tensor of whole blocks ``[N, type_size]`` to float32
values ``[N, block_size]``, vectorized over blocks, with the same float32 operations in the
same order as gguf-py's ``gguf.quants.dequantize`` (the reference: results are bit-identical
for finite inputs, tests/moe_service/engine/test_torch_quant.py). Output in float16/bfloat16 is the float32
result rounded once at the end.

Block layouts (bytes, as ggml-common.h; d, m, dmin are float16)::

    Q8_0   34  = 2 d + 32 int8 q                                   x = d*q
    Q4_0   18  = 2 d + 16 nibbles                                  x = d*(q-8)
    Q4_1   20  = 2 d + 2 m + 16 nibbles                            x = d*q + m
    Q5_0   22  = 2 d + 4 qh + 16 nibbles                           x = d*(q-16)
    Q5_1   24  = 2 d + 2 m + 4 qh + 16 nibbles                     x = d*q + m
    Q4_K   144 = 2 d + 2 dmin + 12 scales + 128 nibbles            x = (d*sc)*q - dmin*mn
    Q5_K   176 = 2 d + 2 dmin + 12 scales + 32 qh + 128 nibbles    x = (d*sc)*q - dmin*mn
    Q6_K   210 = 128 ql + 64 qh + 16 int8 scales + 2 d             x = (d*sc)*(q-32)
    MXFP4  17  = 1 e (E8M0) + 16 nibbles                           x = 2^(e-128) * kvalue[q]
    F16 2, BF16 2, F32 4 per element

Nibble order in 32-element blocks: element j is the low nibble of byte j, element j+16 the
high nibble. 5th bits (Q5_0/Q5_1): bit j of the little-endian u32 qh is element j's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from moe_service.engine.quant.formats import FORMATS, MXFP4_KVALUES, QK_K
from moe_service.engine.quant.formats import GGML_BF16 as BF16
from moe_service.engine.quant.formats import GGML_F16 as F16
from moe_service.engine.quant.formats import GGML_F32 as F32
from moe_service.engine.quant.formats import GGML_MXFP4 as MXFP4
from moe_service.engine.quant.formats import GGML_Q4_0 as Q4_0
from moe_service.engine.quant.formats import GGML_Q4_1 as Q4_1
from moe_service.engine.quant.formats import GGML_Q4_K as Q4_K
from moe_service.engine.quant.formats import GGML_Q5_0 as Q5_0
from moe_service.engine.quant.formats import GGML_Q5_1 as Q5_1
from moe_service.engine.quant.formats import GGML_Q5_K as Q5_K
from moe_service.engine.quant.formats import GGML_Q6_K as Q6_K
from moe_service.engine.quant.formats import GGML_Q8_0 as Q8_0


def supports(ggml_type: int) -> bool:
    """Whether :func:`dequantize` handles this ggml type id."""
    return int(ggml_type) in BLOCK_SIZES


# ---------------------------------------------------------------------------------------------
# helpers on uint8 block tensors [N, type_size]


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """float16 at byte ``at`` of every block, as float32 [N, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, G, 16] packed pairs -> uint8 [N, G, 32]: low nibbles first, then high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits_le(qh: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [N, n/8] little-endian bit field -> uint8 [N, n] of 0/1 (bit j of byte j//8 at j)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], n)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K block -> (scale, min) uint8 [N, 8], 6 bits each.

    Sub-block j < 4: scale = s[j] & 63, min = s[j+4] & 63; j >= 4: scale = (s[j+4] & 15) |
    ((s[j-4] >> 6) << 4), min = (s[j+4] >> 4) | ((s[j] >> 6) << 4) (ggml's get_scale_min_k4).
    """
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc, mn


# ---------------------------------------------------------------------------------------------
# one function per format: uint8 [N, type_size] -> float32 [N, block_size]


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = b[:, 2:34].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).float()
    return d * q + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    qh = _bits_le(b[:, 2:6], 32)
    q = (_nibbles(b[:, 6:22]) | (qh << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    qh = _bits_le(b[:, 4:8], 32)
    q = (_nibbles(b[:, 8:24]) | (qh << 4)).float()
    return d * q + m


def _q4_k_groups(qs: torch.Tensor) -> torch.Tensor:
    """128 quant bytes [N, 128] -> uint8 [N, 8, 32]: group g of 32 bytes gives sub-block 2g
    (low nibbles) and sub-block 2g+1 (high nibbles)."""
    n = qs.shape[0]
    g = qs.reshape(n, 4, 1, 32)
    return torch.cat([g & 0x0F, g >> 4], dim=2).reshape(n, 8, 32)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (d * scale, dmin * min) of each 32-element sub-block, float32 [N, 8, 1]."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.float()).reshape(n, 8, 1), (dmin * mn.float()).reshape(n, 8, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _k_scales(b)
    q = _q4_k_groups(b[:, 16:144]).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _k_scales(b)
    ql = _q4_k_groups(b[:, 48:176])  # [N, 8, 32]
    # qh [N, 32]: bit i of byte j is the 5th bit of element j of sub-block i
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # [N, 8, 32]
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16]
    d = _f16(b, 208)
    dl = (d * sc).reshape(n, 16, 1)
    # two halves of 128 elements; half h: ql bytes [64h, 64h+64) low nibbles then high nibbles,
    # qh bytes [32h, 32h+32) bit pairs 0-1, 2-3, 4-5, 6-7 for its four runs of 32 elements
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte -> float32 2^(e-128), exactly (ggml_e8m0_to_fp32_half): a denormal
    bit pattern for e < 2, else the exponent field e-1."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 < 2, torch.bitwise_left_shift(torch.full_like(e32, 0x00200000), e32), (e32 - 1) << 23)
    return bits.view(torch.float32)


_KVALUES_CACHE: dict[torch.device, torch.Tensor] = {}


def _mxfp4_table(device: torch.device) -> torch.Tensor:
    t = _KVALUES_CACHE.get(device)
    if t is None:
        t = _KVALUES_CACHE[device] = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=device)
    return t


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = _e8m0_half(b[:, 0:1])  # [N, 1]
    codes = _nibbles(b[:, 1:17]).long()  # [N, 32]
    return d * _mxfp4_table(b.device)[codes]


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32).clone()  # never a view of the caller's bytes


def _f16_values(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()  # exact: the 16 bits become the top half


DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: _f32,
    F16: _f16_values,
    BF16: _bf16,
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q5_0: _q5_0,
    Q5_1: _q5_1,
    Q8_0: _q8_0,
    Q4_K: _q4_k,
    Q5_K: _q5_k,
    Q6_K: _q6_k,
    MXFP4: _mxfp4,
}
"""ggml type id -> its torch dequantizer (the block sizes and names come from the format
declarations, moe_service/engine/quant/formats.py)."""

BLOCK_SIZES: dict[int, tuple[int, int]] = {t: (FORMATS[t].block_elems, FORMATS[t].block_bytes) for t in DEQUANTIZERS}
"""type: (elements per block, bytes per block)"""

TYPE_NAMES: dict[int, str] = {t: FORMATS[t].name for t in DEQUANTIZERS}

CHUNK_ELEMENTS = 1 << 24
"""Elements expanded per step: bounds the float32 temporaries (a few x 64 MiB) whatever the
tensor size, so a 1 GiB output head does not need several GiB of scratch."""


def nbytes_of(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a ``ggml_type`` tensor of numpy shape ``shape`` (last axis = ne[0]).

    Raises ValueError when the type is unsupported or the last axis is not whole blocks."""
    ggml_type = int(ggml_type)
    if ggml_type not in BLOCK_SIZES:
        raise ValueError(f"ggml type {ggml_type} has no torch dequantizer (supported: {', '.join(TYPE_NAMES.values())})")
    block, size = BLOCK_SIZES[ggml_type]
    if not shape or shape[-1] % block:
        raise ValueError(f"{TYPE_NAMES[ggml_type]}: last axis of shape {tuple(shape)} is not a multiple of {block}")
    return math.prod(shape) // block * size


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Expand GGUF block bytes into values, on ``raw``'s device.

    ``raw``: uint8 tensor holding exactly the tensor's blocks (any shape; read in memory order,
    e.g. one expert slab or ``[E, slab_bytes]`` for several); ``shape``: numpy-order shape of
    the values (rows..., n_cols), n_cols a multiple of the block size; ``dtype``: float32
    (bit-identical to ``gguf.quants.dequantize``), float16 or bfloat16 (the float32 value
    rounded once). Returns a new contiguous tensor ``[*shape]`` of ``dtype`` on ``raw.device``.

    Raises ValueError (unsupported type, wrong byte count, not uint8).
    """
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw blocks must be uint8 (got {raw.dtype})")
    ggml_type = int(ggml_type)
    want = nbytes_of(ggml_type, shape)
    if raw.numel() != want:
        raise ValueError(
            f"{TYPE_NAMES[ggml_type]} tensor of shape {tuple(shape)} needs {want} bytes, got {raw.numel()}"
        )
    block, size = BLOCK_SIZES[ggml_type]
    fn = DEQUANTIZERS[ggml_type]
    blocks = raw.reshape(-1, size)
    n = blocks.shape[0]
    step = max(1, CHUNK_ELEMENTS // block)
    if n <= step:
        return fn(blocks).to(dtype).reshape(shape)
    out = torch.empty((n, block), dtype=dtype, device=raw.device)
    for i in range(0, n, step):
        out[i : i + step] = fn(blocks[i : i + step])
    return out.reshape(shape)


def dequantize_numpy(
    raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Upload raw block bytes (a uint8 numpy view, e.g. a tensor in the arena) to ``device``
    and dequantize there: ``[*shape]`` of ``dtype`` on ``device``. The host copies bytes only
    (for Q4_K a quarter of the float32 size); the expansion runs on the device."""
    t = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
    return dequantize(t.to(device), ggml_type, shape, dtype)
