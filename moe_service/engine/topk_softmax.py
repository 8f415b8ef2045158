"""Routing rule "top-k of the raw logits, then softmax over the k selected" (gpt-oss).

llama.cpp ``build_moe_ffn`` with ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``: the router's
logits (W x + b, float32) are the selection scores as they are (no softmax over all E), the
k largest are picked (``ggml_argsort_top_k``, descending), and the weights are a softmax over
those k logits only (``ggml_soft_max`` of a [K] row: maximum, expf(x - max), sum in double,
every value times float32(1 / sum)). No renormalisation follows (the weights already sum
to 1 up to rounding); ``expert_weights_scale`` multiplies when it is set and not 1.

Both dense paths call this: :func:`route_topk_softmax` (numba, numpy in/out) on the CPU path,
:func:`route_topk_softmax_torch` on the torch path. Ties pick the lower expert id (ggml's
sort order for exact ties is unspecified; a tie in float32 router logits is measure-zero).

Shapes: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def route_topk_softmax(logits, k, scale, ids, weights):
    """logits float32 [T, E]; k: experts per token (1 <= k <= E); scale: float32 factor
    (1 for gpt-oss); writes ids int32 [T, K] (descending logit order) and weights float32
    [T, K] = softmax of the selected logits, times scale when scale != 1."""
    n_e = logits.shape[1]
    taken = np.zeros(n_e, np.bool_)
    sel = np.empty(k, np.float32)
    for t in range(logits.shape[0]):
        for e in range(n_e):
            taken[e] = False
        for j in range(k):
            best = -1
            for e in range(n_e):
                if not taken[e] and (best < 0 or logits[t, e] > logits[t, best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            sel[j] = logits[t, best]
        mx = sel[0]
        for j in range(k):
            mx = max(mx, sel[j])
        total = 0.0
        for j in range(k):
            v = np.exp(sel[j] - mx)
            sel[j] = v
            total += np.float64(v)
        inv = np.float32(1.0 / total)
        for j in range(k):
            w = sel[j] * inv
            weights[t, j] = w * scale if scale != np.float32(1.0) else w


def route_cpu(logits: np.ndarray, k: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """numpy wrapper: ids int32 [T, K], weights float32 [T, K] from logits float32 [T, E].
    Raises ValueError unless 1 <= k <= E."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n_tok, n_e = logits.shape
    if not 1 <= k <= n_e:
        raise ValueError(f"experts per token {k} must be in 1..{n_e}")
    ids = np.empty((n_tok, k), np.int32)
    w = np.empty((n_tok, k), np.float32)
    route_topk_softmax(logits, k, np.float32(scale), ids, w)
    return ids, w


def route_topk_softmax_torch(logits: torch.Tensor, k: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The same rule on a torch device: logits float32 [T, E] -> (ids int32 [T, K], weights
    float32 [T, K]) as numpy arrays (the routed experts run on the CPU pool). The softmax
    sums in float64 and scales by float32(1/sum), as ggml."""
    vals, ids = torch.topk(logits.float(), k, dim=-1, sorted=True)  # [T, K]
    ex = torch.exp(vals - vals.max(dim=-1, keepdim=True).values)
    inv = (1.0 / ex.double().sum(-1, keepdim=True)).float()
    w = ex * inv
    if scale != 1.0:
        w = w * scale
    return (np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int32),
            np.ascontiguousarray(w.float().cpu().numpy(), dtype=np.float32))
