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
    Q2_K, Q3_K, IQ4_XS, IQ4_NL and the i-quants (IQ1_S .. IQ3_S): see their declarations
    (moe_service/formats.py); the i-quant grids come from codebooks.py
    F16 2, BF16 2, F32 4 per element

Nibble order in 32-element blocks: element j is the low nibble of byte j, element j+16 the
high nibble. 5th bits (Q5_0/Q5_1): bit j of the little-endian u32 qh is element j's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from moe_service.engine.quant import codebooks
from moe_service.formats import BY_NAME, FORMATS, IQ4NL_KVALUES, MXFP4_KVALUES, QK_K
from moe_service.formats import GGML_BF16 as BF16
from moe_service.formats import GGML_F16 as F16
from moe_service.formats import GGML_F32 as F32
from moe_service.formats import GGML_MXFP4 as MXFP4
from moe_service.formats import GGML_Q4_0 as Q4_0
from moe_service.formats import GGML_Q4_1 as Q4_1
from moe_service.formats import GGML_Q4_K as Q4_K
from moe_service.formats import GGML_Q5_0 as Q5_0
from moe_service.formats import GGML_Q5_1 as Q5_1
from moe_service.formats import GGML_Q5_K as Q5_K
from moe_service.formats import GGML_Q6_K as Q6_K
from moe_service.formats import GGML_Q8_0 as Q8_0


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


_KVALUES_CACHE: dict[object, torch.Tensor] = {}


def _mxfp4_table(device: torch.device) -> torch.Tensor:
    t = _KVALUES_CACHE.get(device)
    if t is None:
        t = _KVALUES_CACHE[device] = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=device)
    return t


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = _e8m0_half(b[:, 0:1])  # [N, 1]
    codes = _nibbles(b[:, 1:17]).long()  # [N, 32]
    return d * _mxfp4_table(b.device)[codes]


# ---------------------------------------------------------------------------------------------
# Q2_K, Q3_K, IQ4_XS, IQ4_NL and the i-quants (gguf-py's dequantize_blocks, op for op)


_SHIFTS: dict[tuple, torch.Tensor] = {}


def _sh(vals: tuple[int, ...], shape: tuple[int, ...], device: torch.device, dtype=torch.uint8) -> torch.Tensor:
    """A small constant tensor of shift amounts, cached per device."""
    key = (vals, shape, dtype, device)
    t = _SHIFTS.get(key)
    if t is None:
        t = _SHIFTS[key] = torch.tensor(vals, dtype=dtype, device=device).reshape(shape)
    return t


def _u16(b: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """``count`` little-endian u16 from byte ``at`` of every block, as int32 [N, count]."""
    x = b[:, at : at + 2 * count].reshape(b.shape[0], count, 2).to(torch.int32)
    return x[..., 0] | (x[..., 1] << 8)


def _u32(b: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """``count`` little-endian u32 from byte ``at`` of every block, as int64 [N, count]."""
    x = b[:, at : at + 4 * count].reshape(b.shape[0], count, 4).to(torch.int64)
    return x[..., 0] | (x[..., 1] << 8) | (x[..., 2] << 16) | (x[..., 3] << 24)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales 16 | qs 64 | d | dmin: element 128 n + 32 j + l is bits 2j of qs[32 n + l]."""
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).reshape(n, 16, 1)
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> _sh((0, 2, 4, 6), (1, 1, 4, 1), b.device)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask 32 | qs 64 | scales 12 | d: q = low 2 bits - 4 where the hmask bit is clear."""
    n = b.shape[0]
    d = _f16(b, 108)
    sc = b[:, 96:108]
    lo = (sc[:, 0:8].reshape(n, 1, 8) >> _sh((0, 4), (1, 2, 1), b.device)).reshape(n, 16)
    hi = (sc[:, 8:12].reshape(n, 1, 4) >> _sh((0, 2, 4, 6), (1, 4, 1), b.device)).reshape(n, 16)
    scales = ((lo & 0x0F) | ((hi & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).reshape(n, 16, 1)
    ql = (b[:, 32:96].reshape(n, 2, 1, 32) >> _sh((0, 2, 4, 6), (1, 1, 4, 1), b.device)).reshape(n, 16, 16) & 3
    qh = (b[:, 0:32].reshape(n, 1, 1, 32) >> _sh(tuple(range(8)), (1, 1, 8, 1), b.device)).reshape(n, 16, 16) & 1
    q = (ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _kvalues_iq4nl(device: torch.device) -> torch.Tensor:
    t = _KVALUES_CACHE.get(("iq4nl", device))
    if t is None:
        t = _KVALUES_CACHE[("iq4nl", device)] = torch.tensor(IQ4NL_KVALUES, dtype=torch.float32, device=device)
    return t


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d | u16 scales_h | scales_l 4 | qs 128: sub-block s scale 6 bits - 32, values kvalues_iq4nl."""
    n = b.shape[0]
    d = _f16(b, 0)
    sh = _u16(b, 2, 1)  # [N, 1]
    sl = (b[:, 4:8].reshape(n, 4, 1) >> _sh((0, 4), (1, 1, 2), b.device)).reshape(n, 8) & 0x0F
    shv = (sh >> _sh(tuple(2 * i for i in range(8)), (1, 8), b.device, torch.int32)) & 3
    scales = (sl.to(torch.int32) | (shv << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).reshape(n, 8, 1)
    codes = (b[:, 8:136].reshape(n, 8, 1, 16) >> _sh((0, 4), (1, 1, 2, 1), b.device)).reshape(n, 8, 32) & 0x0F
    return (dl * _kvalues_iq4nl(b.device)[codes.long()]).reshape(n, QK_K)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return d * _kvalues_iq4nl(b.device)[_nibbles(b[:, 2:18]).long()]


_GRIDS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _grid(name: str, device: torch.device) -> torch.Tensor:
    """float32 [entries, 8 or 4]: the grid of i-quant ``name`` (codebooks.py, from gguf-py)."""
    t = _GRIDS.get((name, device))
    if t is None:
        t = _GRIDS[(name, device)] = torch.from_numpy(codebooks.grid(name).astype(np.float32)).to(device)
    return t


def _ksign_bits(idx: torch.Tensor) -> torch.Tensor:
    """ksigns_iq2xs[idx] unpacked: float32 [..., 8] of +1 / -1 (bit j set: element j negative)."""
    t = _GRIDS.get(("ksigns", idx.device))
    if t is None:
        k = torch.from_numpy(codebooks.ksigns().astype(np.int64))
        bits = (k.reshape(128, 1) >> torch.arange(8).reshape(1, 8)) & 1
        t = _GRIDS[("ksigns", idx.device)] = torch.where(bits == 0, 1.0, -1.0).float().to(idx.device)
    return t[idx.long()]


def _sign_bits(bytes_: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] sign bytes -> float32 [..., 8 k] of +1 / -1 (bit j of byte i: element 8 i + j)."""
    bits = (bytes_.unsqueeze(-1) >> _sh(tuple(range(8)), (8,), bytes_.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0).float().reshape(*bytes_.shape[:-1], -1)


def _quarter(d: torch.Tensor, s: torch.Tensor, f: float) -> torch.Tensor:
    """gguf-py's d * (0.5 + s) * f in float32."""
    return d * (0.5 + s.float()) * f


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)  # [N, 1]
    aux = _u32(b, 2, 16).reshape(n, 8, 2)
    db = _quarter(d, aux[..., 1] >> 28, 0.25).reshape(n, 8, 1, 1)
    sidx = (aux[..., 1].reshape(n, 8, 1) >> _sh((0, 7, 14, 21), (1, 1, 4), b.device, torch.int64)) & 0x7F
    signs = _ksign_bits(sidx)  # [N, 8, 4, 8]
    grid = _grid("IQ2_XXS", b.device)[b[:, 2:66].reshape(n, 8, 8)[:, :, 0:4].long()]  # [N, 8, 4, 8]
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = _u16(b, 2, 32)  # [N, 32]
    sc = (b[:, 66:74].reshape(n, 8, 1) >> _sh((0, 4), (1, 1, 2), b.device)).reshape(n, 16) & 0x0F
    db = _quarter(d, sc, 0.25).reshape(n, 16, 1, 1)
    signs = _ksign_bits(qs >> 9).reshape(n, 16, 2, 8)
    grid = _grid("IQ2_XS", b.device)[(qs & 511).long()].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    sc = (b[:, 74:82].reshape(n, 8, 1) >> _sh((0, 4), (1, 1, 2), b.device)).reshape(n, 16) & 0x0F
    db = _quarter(d, sc, 0.25).reshape(n, 16, 1, 1)
    signs = _sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)
    qh = (b[:, 66:74].reshape(n, 8, 1) >> _sh((0, 2, 4, 6), (1, 1, 4), b.device)).reshape(n, 32) & 3
    idx = b[:, 2:34].long() | (qh.long() << 8)
    grid = _grid("IQ2_S", b.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    aux = _u32(b, 66, 8)  # [N, 8]
    db = _quarter(d, aux >> 28, 0.5).reshape(n, 8, 1, 1)
    sidx = (aux.reshape(n, 8, 1) >> _sh((0, 7, 14, 21), (1, 1, 4), b.device, torch.int64)) & 0x7F
    signs = _ksign_bits(sidx)  # [N, 8, 4, 8]
    grid = _grid("IQ3_XXS", b.device)[b[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    sc = (b[:, 106:110].reshape(n, 4, 1) >> _sh((0, 4), (1, 1, 2), b.device)).reshape(n, 8) & 0x0F
    db = (d * (1 + 2 * sc.to(torch.int32))).reshape(n, 8, 1, 1)
    signs = _sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
    qh = _bits_le(b[:, 66:74], 64)
    idx = b[:, 2:66].long() | (qh.long() << 8)
    grid = _grid("IQ3_S", b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qh = _u16(b, 34, 8)  # [N, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, codebooks.IQ1_DELTA, -codebooks.IQ1_DELTA).float().reshape(n, 8, 1, 1)
    hi = (qh.reshape(n, 8, 1) >> _sh((0, 3, 6, 9), (1, 1, 4), b.device, torch.int32)) & 7
    idx = b[:, 2:34].long() | (hi.reshape(n, 32).long() << 8)
    grid = _grid("IQ1_S", b.device)[idx].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = _u16(b, 48, 4)  # [N, 4]
    dbits = ((sc & 0xF000) >> _sh((12, 8, 4, 0), (1, 4), b.device, torch.int32)).sum(dim=1, keepdim=True)
    d = dbits.to(torch.int16).view(torch.float16).float()  # the four nibbles are disjoint: sum == or
    s = (sc.reshape(n, 4, 1) >> _sh((0, 3, 6, 9), (1, 1, 4), b.device, torch.int32)).reshape(n, 16) & 7
    dl = (d * (2 * s + 1)).reshape(n, 8, 2, 1, 1)
    qh = (b[:, 32:48].reshape(n, 16, 1) >> _sh((0, 4), (1, 1, 2), b.device)).reshape(n, 32)
    idx = b[:, 0:32].long() | ((qh & 7).long() << 8)
    delta = torch.where((qh & 8) == 0, codebooks.IQ1_DELTA, -codebooks.IQ1_DELTA).float().reshape(n, 8, 2, 2, 1)
    grid = _grid("IQ1_M", b.device)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


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
    **{BY_NAME[name].type_id: fn for name, fn in (
        ("Q2_K", _q2_k), ("Q3_K", _q3_k), ("IQ4_XS", _iq4_xs), ("IQ4_NL", _iq4_nl), ("IQ2_XXS", _iq2_xxs),
        ("IQ2_XS", _iq2_xs), ("IQ2_S", _iq2_s), ("IQ3_XXS", _iq3_xxs), ("IQ3_S", _iq3_s), ("IQ1_S", _iq1_s),
        ("IQ1_M", _iq1_m))},
}
"""ggml type id -> its torch dequantizer (the block sizes and names come from the format
declarations, moe_service/formats.py)."""

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
