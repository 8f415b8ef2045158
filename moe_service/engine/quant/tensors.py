"""Whole tensors to float32: the small ones (norms, biases, routers, rope factors) that the
dense path keeps as arrays, and matrices uploaded to a GPU or rearranged at load (deepseek2's
legacy attn_kv_b). Large tensors stay in their block format and are read in place by the
kernels (engine/quant/table.py); rows for embedding lookups go through dequant.py.
"""

from __future__ import annotations

import numpy as np


def dequantize_tensor(weights, name: str) -> np.ndarray:
    """Tensor ``name`` of ``weights`` (a WeightStore: ``catalog.tensors`` and ``tensor(name)``
    bytes) as float32 in numpy shape (GGUF's ne reversed), contiguous. gguf-py's
    ``gguf.quants.dequantize`` does the work, so every type it reads is read the same way.
    Raises KeyError for a tensor the catalog does not hold."""
    from gguf.quants import dequantize

    t = weights.catalog.tensors[name]
    raw = weights.tensor(name)
    return np.ascontiguousarray(dequantize(raw, t.ggml_type).reshape(t.shape).astype(np.float32, copy=False))
