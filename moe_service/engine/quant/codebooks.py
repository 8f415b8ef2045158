"""The i-quant codebooks, derived from gguf-py's published tables (gguf/quants.py), never retyped.

gguf-py stores each grid as hex digits of 2-bit (3-bit for the IQ3 grids) indices into a small
value map (``grid_map``) and expands it with ``init_grid``; the values are those of ggml's
``iq2xxs_grid``, ``iq2xs_grid``, ``iq2s_grid``, ``iq3xxs_grid``, ``iq3s_grid`` and
``iq1s_grid`` (ggml-common.h). Here each grid becomes an int8 array [entries, 8 or 4]
(one row per grid index), the sign table ``ksigns_iq2xs`` a uint8 [128], and the IQ1 delta a
float. No numba here: formats.py, the dequantizers, the kernels' constant tables
(tiles_k.py), the torch dequantizers and the synthetic writers all read these.

Grids, per format (entries x elements per entry, values):

- IQ2_XXS 256 x 8, IQ2_XS 512 x 8, IQ2_S 1024 x 8: {8, 25, 43}
- IQ3_XXS 256 x 4: {4, 12, 20, 28, 36, 44, 52, 62}; IQ3_S 512 x 4: {1, 3, ..., 15}
- IQ1_S / IQ1_M 2048 x 8: {-1, 0, 1}
"""

from __future__ import annotations

from functools import cache

import numpy as np
from gguf import quants as _gq

GRID_CLASSES = {
    "IQ2_XXS": _gq.IQ2_XXS, "IQ2_XS": _gq.IQ2_XS, "IQ2_S": _gq.IQ2_S, "IQ3_XXS": _gq.IQ3_XXS,
    "IQ3_S": _gq.IQ3_S, "IQ1_S": _gq.IQ1_S, "IQ1_M": _gq.IQ1_M,
}
"""Format name -> gguf-py's class holding its grid."""

IQ1_DELTA = float(_gq.IQ1_S.delta)
"""ggml's IQ1S_DELTA (= IQ1M_DELTA): the offset added to every IQ1 grid value, signed per group."""


@cache
def grid(name: str) -> np.ndarray:
    """int8 [entries, 8 or 4]: the grid of i-quant ``name`` (see the module docstring), read-only."""
    cls = GRID_CLASSES[name]
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    out = g.astype(np.int8)
    if not np.array_equal(out.astype(np.float32), g):
        raise AssertionError(f"gguf-py's {name} grid is not integer valued")
    out.setflags(write=False)
    return out


@cache
def ksigns() -> np.ndarray:
    """uint8 [128]: ggml's ksigns_iq2xs (7 sign bits plus an even-parity 8th), read-only."""
    out = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    out.setflags(write=False)
    return out


def grid_words(name: str) -> list[int]:
    """The grid of ``name`` as little-endian unsigned words (u64 for 8 values, u32 for 4), each
    entry's value j in byte j: the form ggml's tables have and the kernels load."""
    g = grid(name)
    dt = np.uint64 if g.shape[1] == 8 else np.uint32
    return [int(v) for v in np.ascontiguousarray(g).view(np.uint8).view(dt).reshape(-1)]
