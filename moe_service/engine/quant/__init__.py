"""GGUF block kernels: dequantize, quantize activations, dot products, matmul over an arena.

Shape legend: T tokens (1 in decode, up to a few hundred in a prefill ubatch), N output rows
of a weight tensor, C input columns (ggml ``ne[0]``), B = C / block_elems blocks per row.

::

    x [T, C] f32 ──quantize_activations(partner)──> Activations: xq int8 [T, C], xd f32 [T, C/32|256], ...
                                                                    │  (once per token row, reused by every weight row)
    arena uint8 ── w = N rows x row_bytes at a byte offset ─────────┤
                                                                    v
                                     matmul_rows(row_lo, row_hi): out [T, N] f32

Weights are read in place from the arena in their GGUF block format; nothing is
dequantized at load. As in ggml's CPU backend, each weight format has a *partner*
activation format (``Partner``): the activation row is quantized to 8 bits once
(ggml's quantize_row_q8_0 / q8_1 / q8_K) and every block dot product is an integer sum
of products scaled by the two block scales, so results agree closely with llama.cpp.
F32 / F16 / BF16 weights are dotted against the activation rounded to the weight's own
precision (ggml's vec_dot_type for those types), accumulating in float32.

Performance (the point of this module; bench/kernels.py measures GB/s of weight bytes per
format against the machine's read bandwidth):

- The block dot products are written in LLVM vector IR (numba intrinsics). A matmul runs
  in *tiles*: 4 consecutive weight rows x up to 4 activation rows per pass over the rows'
  blocks (AVX-512 VNNI; 1 row on AVX2, where the K-quants take up to 8 activation rows).
  Each weight block is unpacked once per tile and each activation block loaded once per
  tile, so a weight row is read from memory once per
  call however many tokens there are, and the per-token cost at T >= 4 is the vpdpbusd /
  vpmaddubsw arithmetic, not the unpacking. Accumulators stay in registers; the horizontal
  sum happens once per (row, token). Tiles prefetch the next tile's rows.
- Results are bit-identical whatever the tile shape, the number of tokens, or the ISA: the
  integer sums are exact and each row's float32 steps follow one fixed per-lane order (see
  the tile sections).
- The format kernels are C-ABI functions (numba cfunc) called through an address table:
  each compiles once and only when a model uses the format (``ensure_kernels``), and no
  reference counting runs per row (they take raw pointers).
- Scalar helpers (quantizers, dequantization) rely on LLVM's SLP vectorizer, which this
  module switches on (numba ships with it off).

All kernels are compiled with ``nogil=True, cache=True``; numba's on-disk cache honours
NUMBA_CACHE_DIR, which the service sets before numba is imported. Requires an x86-64 CPU
with AVX2 (and SSSE3 pshufb for MXFP4).

Modules (one concern each): ``formats`` (a re-export of moe_service/formats.py, the
declarations: one per GGUF type, the only place with byte layouts), ``codebooks`` (the i-quant grids, derived from gguf-py), ``ir`` (numba intrinsics and LLVM vector building blocks),
``activations`` (the partner quantizers), ``dequant``, ``tiles32`` and ``tiles_k`` (the
two tile-kernel families), ``table`` (the per-format kernels generated from the
declarations, their address table and ``matmul``). Adding a format is its declaration in
moe_service/formats.py, its block function in dequant.py (``@_dequantizes``) and its weight side in its
tile family (tiles32.py's parameters, or a ``@_weight_side`` function in tiles_k.py).

The names below load their module on first use (PEP 562): ``formats`` needs neither numba
nor LLVM (the GGUF reader and the synthetic writers import moe_service.formats directly).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "formats": (
        "GGML_F32", "GGML_F16", "GGML_BF16", "GGML_Q4_0", "GGML_Q4_1", "GGML_Q5_0", "GGML_Q5_1", "GGML_Q8_0",
        "GGML_Q2_K", "GGML_Q3_K", "GGML_Q4_K", "GGML_Q5_K", "GGML_Q6_K", "GGML_MXFP4", "GGML_IQ4_XS",
        "GGML_IQ4_NL", "GGML_IQ2_XXS", "GGML_IQ2_XS", "GGML_IQ2_S", "GGML_IQ3_XXS", "GGML_IQ3_S", "GGML_IQ1_S",
        "GGML_IQ1_M", "set_iq1m_d",
        "QK", "QK_K", "Partner", "PARTNER_BLOCK", "BlockFormat", "FORMATS", "BY_NAME", "block_format",
        "row_bytes", "random_blocks",
    ),
    "ir": (
        "_AVX512", "_VNNI", "_addr_view", "atomic_add", "atomic_load", "atomic_store", "bits_f32", "cpu_relax",
        "cycle_counter", "data_ptr", "f16_round", "f32_bits", "ld", "ld_bf16", "ld_f16", "ld_f16x2", "ld_f32",
        "ld_i8", "ld_i16", "ld_u8", "ld_u32", "rintf", "roundf", "st", "view_f32", "view_i8", "view_i16",
        "view_i32", "view_i64", "view_u8",
    ),
    "activations": (
        "Activations", "PartnerArrays", "_alloc_partner", "quantize_activations", "quantize_partner_row",
        "quantize_partner_rows", "quantize_partner_rows_range", "quantize_row_q8_0", "quantize_row_q8_1",
        "quantize_row_q8_k",
    ),
    "dequant": ("DEQUANT_ROWS", "check_tensor", "dequantize", "dequantize_rows"),
    "table": (
        "_KERNEL_CFUNCS", "_KERNEL_PY", "_KERNEL_TABLE", "_R_TILE", "ensure_kernels", "kernel_table", "matmul",
        "matmul_rows",
    ),
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
