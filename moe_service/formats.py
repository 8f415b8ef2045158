"""The block formats: one declaration per GGUF tensor type, the only place with byte layouts.

These are file facts (names, GGML ids, block sizes, field layouts), so they live below
everything that reads them: the GGUF catalog (gguf_model.py, ``SUPPORTED_GGML_TYPES``), the
planner (pipeline/), the synthetic writers (moe_service/synth/blocks.py's block maker,
synth/recipe.py) and the kernels (moe_service/engine/quant/). This module imports nothing of
the engine, nor numba or torch: the GGUF reader and the synthetic writers use it without
compiling anything. The kernel factories stay in engine/quant/ (table.py builds the kernel
table and its per-format entry points from ``FORMATS``; tiles32.py takes the tile parameters
of the 32-element family; the dequantizers and the K-quant tiles read the byte offsets,
``BlockFormat.off``; torch_quant.py the torch dequantizers). engine/quant/formats.py
re-exports this module under its former path.

A declaration follows gguf-py's ``GGML_QUANT_SIZES`` and ggml-common.h's block structs: the
fields in byte order with their sizes written as arithmetic of the block, so ``block_bytes``
and every offset are derived (``test_format_table_matches_gguf`` checks both sizes against
gguf-py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
from gguf import GGMLQuantizationType as _G

from moe_service.errors import ModelFileError

QK = 32    # elements per block of the 32-element formats and of Q8_0 / Q8_1 activations
QK_K = 256  # elements per K-quant super-block and per Q8_K activation block


class Partner(IntEnum):
    """Activation format a weight format is dotted against (ggml's ``vec_dot_type``)."""

    F32 = 0   # activation as is
    F16 = 1   # activation rounded to float16 (nearest even)
    BF16 = 2  # activation rounded to bfloat16 (nearest even, as ggml_compute_fp32_to_bf16)
    Q8_0 = 3  # 32-element blocks: int8 q, f16 d = amax/127
    Q8_1 = 4  # Q8_0 plus f16 s = d * sum(q)
    Q8_K = 5  # 256-element blocks: int8 q, f32 d, int16 sums of each 16 q


# Partner block geometry: elements per activation scale block (1 = no scales).
PARTNER_BLOCK = {Partner.F32: 1, Partner.F16: 1, Partner.BF16: 1, Partner.Q8_0: QK,
                 Partner.Q8_1: QK, Partner.Q8_K: QK_K}

# Field kinds: the byte count of one field is given with it; F16 marks a float16 scale
# (random_blocks and the synthetic writer fill those with finite values).
F16 = "f16"
BYTES = "bytes"

# MXFP4 code -> doubled E2M1 value (bit 3 is the sign), as ggml's kvalues_mxfp4
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# IQ4_NL / IQ4_XS code -> int8 value, as ggml's kvalues_iq4nl
IQ4NL_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF tensor type as the kernels see it.

    ``fields``: (name, kind, bytes) in byte order (kind F16 for a float16 scale, else
    BYTES); ``block_bytes`` and the offsets (``off``) are derived from it. ``family``
    picks the kernel code: "float" (F32/F16/BF16 rows, no blocks), "32" (the 32-element
    tile family, tiles32.py) or "k" (the K-quant tile family, tiles_k.py). The tile
    parameters of the 32-element family: ``kind`` ("q8", "nib" 4/5-bit nibbles,
    "mxfp4"), ``bias`` subtracted from the unsigned values, ``signed`` (sign trick /
    a + 128 path), ``has_min`` (x = d*q + m: the m term uses the Q8_1 sums).
    ``sequential_t1``: a single-item matmul runs one weight row at a time (see
    SEQUENTIAL_T1_NOTE). ``layout``: the formula, for people.
    """

    name: str
    block_elems: int
    fields: tuple[tuple[str, str, int], ...]
    partner: Partner
    family: str
    layout: str
    kind: str = ""
    bias: int = 0
    signed: bool = False
    has_min: bool = False
    sequential_t1: bool = False
    scalar_bytes: int = 0  # float family: bytes per element
    type_id: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "type_id", int(_G[self.name]))

    @property
    def block_bytes(self) -> int:
        return sum(size for _, _, size in self.fields)

    def off(self, name: str) -> int:
        """Byte offset of field ``name`` in a block; -1 when the format has no such field."""
        o = 0
        for n, _, size in self.fields:
            if n == name:
                return o
            o += size
        return -1

    @property
    def f16_offsets(self) -> tuple[int, ...]:
        """Byte offsets of the float16 scale fields."""
        return tuple(self.off(n) for n, kind, _ in self.fields if kind == F16)

    # the 32-element tile family reads these three
    @property
    def bb(self) -> int:
        return self.block_bytes

    @property
    def qs(self) -> int:
        return self.off("qs")

    @property
    def qh(self) -> int:
        return self.off("qh")

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of ``n_cols`` elements (``n_cols`` a multiple of block_elems)."""
        return n_cols // self.block_elems * self.block_bytes


SEQUENTIAL_T1_NOTE = """Why ``sequential_t1``: a single-item (T=1) matmul of such a format runs
one weight row at a time: a plain sequential stream reaches more DRAM bandwidth than a tile's
4 side-by-side rows, which decides T=1 for the formats with the least arithmetic per byte.
Measured (Zen 5, 256 MiB tensors, GB/s, 4-row tiles -> single rows): 1 thread Q8_0 31 -> 38,
Q6_K 33 -> 40, Q4_K 33 -> 33, Q4_1 36 -> 28; 2 threads Q8_0 38 -> 45, Q6_K 36 -> 46, Q4_K
41 -> 46, Q4_1 41 -> 46 (memory bandwidth ~45). The nibble formats keep their tiles: at T=1
they are compute-bound on one core, and so is a small model's decode (SmolLM2-MoE, Q4_1).
Q2_K, Q3_K and IQ4_XS are not measured yet: they keep the tiles (fewer bytes per weight
than Q4_K, more unpacking per byte)."""


def _f(name: str, size: int) -> tuple[str, str, int]:
    return (name, BYTES, size)


def _h(name: str) -> tuple[str, str, int]:
    return (name, F16, 2)


_DECLARED = (
    BlockFormat("F32", 1, (_f("x", 4),), Partner.F32, "float", "f32", scalar_bytes=4),
    BlockFormat("F16", 1, (_f("x", 2),), Partner.F16, "float", "f16", scalar_bytes=2),
    BlockFormat("BF16", 1, (_f("x", 2),), Partner.BF16, "float", "bf16 (f32 bits = u16 << 16)", scalar_bytes=2),
    BlockFormat("Q4_0", QK, (_h("d"), _f("qs", QK // 2)), Partner.Q8_0, "32",
                "f16 d | 16 B nibbles; x = d*(q-8)", kind="nib", bias=8, signed=True),
    BlockFormat("Q4_1", QK, (_h("d"), _h("m"), _f("qs", QK // 2)), Partner.Q8_1, "32",
                "f16 d | f16 m | 16 B nibbles; x = d*q + m", kind="nib", has_min=True),
    BlockFormat("Q5_0", QK, (_h("d"), _f("qh", 4), _f("qs", QK // 2)), Partner.Q8_0, "32",
                "f16 d | u32 qh | 16 B nibbles; x = d*(q-16)", kind="nib", bias=16, signed=True),
    BlockFormat("Q5_1", QK, (_h("d"), _h("m"), _f("qh", 4), _f("qs", QK // 2)), Partner.Q8_1, "32",
                "f16 d | f16 m | u32 qh | 16 B nibbles; x = d*q + m", kind="nib", has_min=True),
    BlockFormat("Q8_0", QK, (_h("d"), _f("qs", QK)), Partner.Q8_0, "32",
                "f16 d | 32 int8; x = d*q", kind="q8", signed=True, sequential_t1=True),
    BlockFormat("MXFP4", QK, (_f("e", 1), _f("qs", QK // 2)), Partner.Q8_0, "32",
                "u8 E8M0 e | 16 B E2M1 codes; x = kvalue[code] * 2^(e-128)", kind="mxfp4", signed=True),
    BlockFormat("Q2_K", QK_K, (_f("scales", QK_K // 16), _f("qs", QK_K // 4), _h("d"), _h("dmin")),
                Partner.Q8_K, "k", "16 B 4-bit scales/mins | 64 B 2-bit q | f16 d | f16 dmin; "
                "x = d*sc*q - dmin*m per 16", has_min=True),
    BlockFormat("Q3_K", QK_K, (_f("hmask", QK_K // 8), _f("qs", QK_K // 4), _f("scales", 12), _h("d")),
                Partner.Q8_K, "k", "32 B high bits | 64 B 2-bit low q | 12 B 6-bit scales | f16 d; "
                "x = d*(sc-32)*(q-4*!h) per 16"),
    BlockFormat("Q4_K", QK_K, (_h("d"), _h("dmin"), _f("scales", 12), _f("qs", QK_K // 2)), Partner.Q8_K, "k",
                "f16 d | f16 dmin | 12 B 6-bit scales/mins | 128 B nibbles", has_min=True, sequential_t1=True),
    BlockFormat("Q5_K", QK_K, (_h("d"), _h("dmin"), _f("scales", 12), _f("qh", QK_K // 8), _f("qs", QK_K // 2)),
                Partner.Q8_K, "k", "f16 d | f16 dmin | 12 B scales/mins | 32 B high bits | 128 B nibbles",
                has_min=True, sequential_t1=True),
    BlockFormat("Q6_K", QK_K, (_f("ql", QK_K // 2), _f("qh", QK_K // 4), _f("scales", QK_K // 16), _h("d")),
                Partner.Q8_K, "k", "128 B low nibbles | 64 B high 2 bits | 16 int8 scales | f16 d",
                sequential_t1=True),
    BlockFormat("IQ4_XS", QK_K, (_h("d"), _f("scales_h", 2), _f("scales_l", QK_K // 64), _f("qs", QK_K // 2)),
                Partner.Q8_K, "k", "f16 d | u16 high scale bits | 4 B low scale nibbles | 128 B codes; "
                "x = d*(sc-32)*kvalue_iq4nl[code] per 32", signed=True),
    BlockFormat("IQ4_NL", QK, (_h("d"), _f("qs", QK // 2)), Partner.Q8_0, "32",
                "f16 d | 16 B codes; x = d*kvalue_iq4nl[code]", kind="iq4nl", signed=True),
    # The i-quants (ggml-common.h block_iq*): values from a grid (codebooks.py) of 4 or 8
    # values per index, signs per element, odd sub-block scales (2 s + 1); the K-quant tile
    # family (tiles_k.py) with Q8_K activations, as ggml's vec_dot_type.
    BlockFormat("IQ2_XXS", QK_K, (_h("d"), _f("qs", QK_K // 4)), Partner.Q8_K, "k",
                "f16 d | 8 x (4 B grid indices, u32 4x7 sign indices | 4-bit s); "
                "x = d*(2s+1)/8 * grid256[idx] * ksigns per 32", signed=True),
    BlockFormat("IQ2_XS", QK_K, (_h("d"), _f("qs", QK_K // 4), _f("scales", QK_K // 32)), Partner.Q8_K, "k",
                "f16 d | 32 u16 (9-bit grid index, 7-bit sign index) | 8 B 4-bit scales; "
                "x = d*(2s+1)/8 * grid512[idx] * ksigns per 16", signed=True),
    BlockFormat("IQ2_S", QK_K, (_h("d"), _f("qs", QK_K // 8), _f("signs", QK_K // 8), _f("qh", QK_K // 32),
                                _f("scales", QK_K // 32)), Partner.Q8_K, "k",
                "f16 d | 32 B low index bits | 32 B sign bits | 8 B 2-bit high index bits | 8 B 4-bit scales; "
                "x = d*(2s+1)/8 * grid1024[idx] * sign per 16", signed=True),
    BlockFormat("IQ3_XXS", QK_K, (_h("d"), _f("qs", QK_K // 4), _f("scales_signs", QK_K // 8)), Partner.Q8_K,
                "k", "f16 d | 64 B grid indices | 8 x u32 (4x7 sign indices | 4-bit s); "
                "x = d*(2s+1)/4 * grid256x4[idx] * ksigns per 32", signed=True),
    BlockFormat("IQ3_S", QK_K, (_h("d"), _f("qs", QK_K // 4), _f("qh", QK_K // 32), _f("signs", QK_K // 8),
                                _f("scales", QK_K // 64)), Partner.Q8_K, "k",
                "f16 d | 64 B low index bits | 8 B high index bits | 32 B sign bits | 4 B 4-bit scales; "
                "x = d*(2s+1) * grid512x4[idx] * sign per 32", signed=True),
    BlockFormat("IQ1_S", QK_K, (_h("d"), _f("qs", QK_K // 8), _f("qh", QK_K // 16)), Partner.Q8_K, "k",
                "f16 d | 32 B low index bits | 8 x u16 (4x3 high index bits | 3-bit s | delta sign); "
                "x = d*(2s+1) * (grid2048[idx] +- 1/8) per 32", signed=True, has_min=True),
    BlockFormat("IQ1_M", QK_K, (_f("qs", QK_K // 8), _f("qh", QK_K // 16), _f("scales", QK_K // 32)),
                Partner.Q8_K, "k", "32 B low index bits | 16 B (3 high index bits, delta sign) per 8 | "
                "4 x u16 (4x3-bit s | a nibble of the f16 d); x = d*(2s+1) * (grid2048[idx] +- 1/8) per 16 "
                "(delta per 8)", signed=True),
)

FORMATS: dict[int, BlockFormat] = {f.type_id: f for f in sorted(_DECLARED, key=lambda f: f.type_id)}
"""GGML type id -> BlockFormat, every type the CPU kernels read."""

BY_NAME: dict[str, BlockFormat] = {f.name: f for f in _DECLARED}

# The GGML ids as module constants (gguf-py's values; kept for the kernels' literal
# arguments and for callers that spell a type in code).
GGML_F32 = BY_NAME["F32"].type_id
GGML_F16 = BY_NAME["F16"].type_id
GGML_BF16 = BY_NAME["BF16"].type_id
GGML_Q4_0 = BY_NAME["Q4_0"].type_id
GGML_Q4_1 = BY_NAME["Q4_1"].type_id
GGML_Q5_0 = BY_NAME["Q5_0"].type_id
GGML_Q5_1 = BY_NAME["Q5_1"].type_id
GGML_Q8_0 = BY_NAME["Q8_0"].type_id
GGML_MXFP4 = BY_NAME["MXFP4"].type_id
GGML_Q2_K = BY_NAME["Q2_K"].type_id
GGML_Q3_K = BY_NAME["Q3_K"].type_id
GGML_Q4_K = BY_NAME["Q4_K"].type_id
GGML_Q5_K = BY_NAME["Q5_K"].type_id
GGML_Q6_K = BY_NAME["Q6_K"].type_id
GGML_IQ4_XS = BY_NAME["IQ4_XS"].type_id
GGML_IQ4_NL = BY_NAME["IQ4_NL"].type_id
GGML_IQ2_XXS = BY_NAME["IQ2_XXS"].type_id
GGML_IQ2_XS = BY_NAME["IQ2_XS"].type_id
GGML_IQ2_S = BY_NAME["IQ2_S"].type_id
GGML_IQ3_XXS = BY_NAME["IQ3_XXS"].type_id
GGML_IQ3_S = BY_NAME["IQ3_S"].type_id
GGML_IQ1_S = BY_NAME["IQ1_S"].type_id
GGML_IQ1_M = BY_NAME["IQ1_M"].type_id

IQ1_M_SCALES = BY_NAME["IQ1_M"].off("scales")


def set_iq1m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """Store float16 ``d`` [n] as the super-block scales of IQ1_M ``blocks`` uint8 [n, 56] in
    place: IQ1_M has no d field, its f16 bits are the top nibbles of the four u16 scale words
    (nibble k of d in word k), as ggml's iq1m_scale_t (ggml-quants.c dequantize_row_iq1_m)."""
    bits = np.asarray(d, dtype=np.float16).view(np.uint16).reshape(-1)
    words = blocks[:, IQ1_M_SCALES:IQ1_M_SCALES + 8].copy().view(np.uint16).reshape(-1, 4)
    for k in range(4):
        words[:, k] = (words[:, k] & np.uint16(0x0FFF)) | (((bits >> np.uint16(4 * k)) & np.uint16(15)) << np.uint16(12))
    blocks[:, IQ1_M_SCALES:IQ1_M_SCALES + 8] = words.view(np.uint8).reshape(-1, 8)


def block_format(ggml_type: int) -> BlockFormat:
    """The BlockFormat of a GGML type id; ModelFileError names the type when unsupported."""
    try:
        return FORMATS[int(ggml_type)]
    except KeyError:
        supported = ", ".join(f"{f.name}({t})" for t, f in sorted(FORMATS.items()))
        raise ModelFileError(
            f"GGML tensor type {int(ggml_type)} is not supported by the CPU kernels (supported: {supported})"
        ) from None


def row_bytes(ggml_type: int, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` elements of ``ggml_type``; ValueError if not whole blocks."""
    f = block_format(ggml_type)
    if n_cols % f.block_elems:
        raise ValueError(f"row of {n_cols} columns is not a whole number of {f.name} blocks of {f.block_elems}")
    return f.row_bytes(n_cols)


def random_blocks(rng: np.random.Generator, ggml_type: int, n_rows: int, n_cols: int,
                  scale: float = 0.01) -> np.ndarray:
    """A tensor of n_rows x n_cols ``ggml_type`` as uint8 [n_rows * row_bytes]: random bytes
    with finite float16 scale fields (normal, std ``scale``), MXFP4 exponents in 2^-10..2^-1,
    IQ1_M's d (spread over its scale words) as the f16 fields, and normal F32/F16/BF16
    values; any bytes are valid grid and sign indices of the i-quants. For tests and benchmarks of the kernels."""
    f = block_format(ggml_type)
    nb = n_cols // f.block_elems
    if f.family == "float":
        x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        if ggml_type == GGML_F32:
            return x.view(np.uint8).reshape(-1)
        if ggml_type == GGML_F16:
            return x.astype(np.float16).view(np.uint8).reshape(-1)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    raw = rng.integers(0, 256, size=(n_rows, nb, f.block_bytes), dtype=np.uint8)
    for off in f.f16_offsets:
        v = (rng.standard_normal((n_rows, nb)) * scale).astype(np.float16)
        raw[:, :, off:off + 2] = v.view(np.uint8).reshape(n_rows, nb, 2)
    if ggml_type == GGML_MXFP4:
        raw[:, :, 0] = rng.integers(118, 128, size=(n_rows, nb))
    if ggml_type == GGML_IQ1_M:
        set_iq1m_d(raw.reshape(-1, f.block_bytes), (rng.standard_normal(n_rows * nb) * scale).astype(np.float16))
    return raw.reshape(-1)
