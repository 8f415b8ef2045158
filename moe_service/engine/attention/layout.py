"""What every attention module shares: the layout of one call's op array, of its task rows
and of the split decode's group table; the cache element formats; the compile options and
vector widths of the kernels. No kernels here (it imports no other attention module).

The hot helpers index flat arrays through quant.ld/st (no wraparound of negative indices):
numba's checked indexing with run-time trip counts keeps LLVM from vectorising the loops
(measured 8x slower per key).
"""

from __future__ import annotations

from numba import types

from moe_service.engine import quant as _q
from moe_service.engine.quant import ir as _qir

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}
# No fastmath: every reduction's order is the one written (the score dot products' lanes are
# explicit vector IR, see _lane_dot); LLVM's reassociation once lost a decisive greedy step
# of tiny-gpt-oss-l3-pattern3-q8_0 against its llama.cpp golden.
_JIT_VEC = {"nogil": True, "cache": True, "error_model": "numpy", "fastmath": False}
_JIT_INLINE = {**_JIT_VEC, "inline": "always"}  # small per-key helpers: a call per key costs more than the work
# Vector width of the score kernels (prefill, decode, latent) and the P.V kernel: 16 float32
# lanes where the 512-bit kernels run (AVX-512 BW + VL + VNNI, quant.ir._AVX512), else 8. The sums are the same either way
# (each lane's order is fixed by the contract; the width only sets how many lanes one
# instruction holds).
_SCORE_LANES = 16 if _qir._AVX512 else 8
# A decode reads the float16 cache in place: one KV head's rows sit NKV x D x 2 bytes apart,
# a few rows per 4 KiB page, which the hardware prefetchers do not follow across pages. The
# score and P.V kernels prefetch the rows this many keys ahead.
_KV_PREFETCH_KEYS = 16
_KEYS_PER_PASS = 2  # keys per pass of _dot16_heads_keys (4 measured no faster with 16 lanes)

FMT_F16 = 0
FMT_Q8_0 = 1
Q8_0_BLOCK = 32  # values per block
Q8_0_BYTES = 34  # float16 scale + 32 int8

_view_u16 = _q._addr_view(types.uint16)
_view_f64 = _q._addr_view(types.float64)

# op array (int64) of one attend call: addresses, then dims. Offsets:
O_Q, O_KC, O_VC, O_OUT, O_TASKS, O_PML, O_PACC, O_SINKS = range(8)
O_NH, O_D, O_NKV, O_DV, O_GROUP, O_BK = range(8, 14)
O_KFMT, O_K_SEQ, O_K_POS, O_K_HEAD = range(14, 18)  # strides in cache elements (u16 or bytes)
O_VFMT, O_V_SEQ, O_V_POS, O_V_HEAD = range(18, 22)
O_SCALE, O_WINDOW, O_HAS_SINKS, O_RMAX, O_NTOK = range(22, 27)
O_SC, O_META = 27, 28  # exact split decode: scores buffer (float32), group table (int64 [*, META_W])
O_WIDE = 29  # 1: a one-token step (ggml_vec_dot_f16's 64-lane score order), 0: 16 lanes (tinyBLAS)
OP_LEN = 30
META_W = 8  # sc offset, L, j_start, h_lo, h_hi, first part task, n parts, partial-acc offset

# task rows (int64 [n, TASK_W]): seq, t_lo, t_hi (query rows of q), p0 (cache position of
# t_lo), g (KV head), k_lo, k_hi (key positions this task reads), part (-1: final result to
# out; else the partial-result slot).
TASK_W = 8
