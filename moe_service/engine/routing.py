"""MoE routing with every rule llama.cpp's build_moe_ffn knows for DeepSeek-style routers,
on the CPU (numba, ggml's rounding) and in torch (same rule, device tensors).

Per token (REFERENCE.md "MoE routing"; llama-graph.cpp build_moe_ffn):

1. probs = softmax(logits) (GATING_SOFTMAX) or sigmoid(logits) (GATING_SIGMOID);
2. selection = probs + bias when a selection bias (``exp_probs_b``) is given: it moves the
   choice, never the weights;
3. with ``n_group`` > 1: experts form n_group consecutive groups; a group scores the sum of
   its two best selection values; only the ``n_group_used`` best groups stay selectable
   (the others' selection values become -inf);
4. the k best selection values pick the experts (descending, ties to the lower id);
5. weights = probs at the picked experts; with ``norm`` divided by their sum (the sum
   clamped below at 6.103515625e-5, the smallest normal float16, as llama.cpp does);
   multiplied by ``scale`` (1.0: unchanged).

Rounding as ggml's CPU ops: softmax exponentials expf(x - max) summed in float64 and scaled
by float32(1/sum); sigmoid 1/(1 + expf(-x)); a group's score is the float64 sum of its two
values rounded to float32; the weight sum is accumulated in float64 (ggml_sum_rows).

Shapes: T tokens, E experts, K experts per token, G groups.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

GATING_SOFTMAX = 0
GATING_SIGMOID = 1

_WEIGHT_SUM_MIN = np.float32(6.103515625e-5)
_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def route_kernel(logits, k, gating, n_group, n_group_used, bias, has_bias, norm, scale, ids, weights):
    """The routing rule of the module docstring for every token.

    logits: float32 [T, E]; k: experts per token (1..E, and at most the experts of the kept
    groups); gating: GATING_SOFTMAX / GATING_SIGMOID; n_group, n_group_used: group limit
    (n_group <= 1: none; E a multiple of n_group); bias: float32 [E] (read when has_bias);
    norm: renormalise; scale: float32 weight multiplier. Writes ids int32 [T, K] (descending
    selection) and weights float32 [T, K]. The caller validates the arguments.
    """
    n_e = logits.shape[1]
    probs = np.empty(n_e, np.float32)
    sel = np.empty(n_e, np.float32)
    taken = np.zeros(n_e, np.bool_)
    grouped = n_group > 1
    per = n_e // n_group if grouped else n_e
    gscore = np.empty(max(n_group, 1), np.float32)
    gkeep = np.zeros(max(n_group, 1), np.bool_)
    neg_inf = np.float32(-np.inf)
    for t in range(logits.shape[0]):
        if gating == GATING_SOFTMAX:
            mx = logits[t, 0]
            for e in range(n_e):
                mx = max(mx, logits[t, e])
            total = 0.0
            for e in range(n_e):
                v = np.exp(logits[t, e] - mx)
                probs[e] = v
                total += np.float64(v)
            inv = np.float32(1.0 / total)
            for e in range(n_e):
                probs[e] = probs[e] * inv
        else:
            for e in range(n_e):
                probs[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[t, e]))
        for e in range(n_e):
            sel[e] = probs[e] + bias[e] if has_bias else probs[e]
            taken[e] = False
        if grouped:
            for g in range(n_group):
                b1 = neg_inf
                b2 = neg_inf
                for e in range(g * per, (g + 1) * per):
                    v = sel[e]
                    if v > b1:
                        b2 = b1
                        b1 = v
                    elif v > b2:
                        b2 = v
                gscore[g] = np.float32(np.float64(b1) + np.float64(b2)) if per > 1 else b1
                gkeep[g] = False
            for _ in range(n_group_used):
                best = -1
                for g in range(n_group):
                    if not gkeep[g] and (best < 0 or gscore[g] > gscore[best]):
                        best = g
                gkeep[best] = True
            for g in range(n_group):
                if not gkeep[g]:
                    for e in range(g * per, (g + 1) * per):
                        sel[e] = neg_inf
        wsum = 0.0
        for j in range(k):
            best = -1
            for e in range(n_e):
                if not taken[e] and (best < 0 or sel[e] > sel[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = probs[best]
            wsum += np.float64(probs[best])
        if norm:
            s = np.float32(wsum)
            if s < _WEIGHT_SUM_MIN:
                s = _WEIGHT_SUM_MIN
            for j in range(k):
                weights[t, j] = weights[t, j] / s
        if scale != np.float32(1.0):
            for j in range(k):
                weights[t, j] = weights[t, j] * scale


def check_routing(n_expert: int, k: int, n_group: int, n_group_used: int) -> None:
    """Raises ValueError unless the rule can pick k distinct experts (names the numbers)."""
    if not 0 < k <= n_expert:
        raise ValueError(f"routing: {k} experts per token of {n_expert}")
    if n_group > 1:
        if n_expert % n_group or not 0 < n_group_used <= n_group:
            raise ValueError(f"routing: {n_group} groups ({n_group_used} used) do not divide {n_expert} experts")
        if k > n_group_used * (n_expert // n_group):
            raise ValueError(f"routing: {k} experts per token exceed the {n_group_used} kept groups of "
                             f"{n_expert // n_group}")


def route(logits: np.ndarray, k: int, *, gating: int = GATING_SOFTMAX, n_group: int = 0, n_group_used: int = 0,
          bias: np.ndarray | None = None, norm: bool = True, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """CPU routing (module docstring): logits float32 [T, E] -> ids int32 [T, K], weights
    float32 [T, K]. Raises ValueError for arguments that cannot pick k distinct experts."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    T, E = logits.shape
    check_routing(E, k, n_group, n_group_used)
    ids = np.empty((T, k), np.int32)
    w = np.empty((T, k), np.float32)
    b = np.ascontiguousarray(bias, dtype=np.float32) if bias is not None else np.zeros(1, np.float32)
    if bias is not None and b.shape != (E,):
        raise ValueError(f"routing: selection bias of shape {b.shape} for {E} experts")
    route_kernel(logits, int(k), int(gating), int(n_group), int(n_group_used), b, bias is not None, bool(norm),
                 np.float32(scale), ids, w)
    return ids, w


def route_torch(logits: torch.Tensor, k: int, *, gating: int = GATING_SOFTMAX, n_group: int = 0,
                n_group_used: int = 0, bias: torch.Tensor | None = None, norm: bool = True,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule as torch ops on logits' device: logits float32 [T, E] -> ids int64
    [T, K], weights float32 [T, K] (torch's own softmax/sigmoid rounding)."""
    T, E = logits.shape
    check_routing(E, k, n_group, n_group_used)
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1) if gating == GATING_SOFTMAX else torch.sigmoid(logits)
    sel = probs + bias if bias is not None else probs
    if n_group > 1:
        groups = sel.view(T, n_group, E // n_group)
        top2 = groups.topk(min(2, E // n_group), dim=-1).values
        gscore = top2.double().sum(-1).float()  # [T, G]
        keep = gscore.topk(n_group_used, dim=-1).indices
        mask = torch.ones_like(gscore, dtype=torch.bool).scatter_(1, keep, False)  # True: dropped group
        sel = groups.masked_fill(mask[:, :, None], float("-inf")).view(T, E)
    ids = sel.topk(k, dim=-1, sorted=True).indices
    w = probs.gather(-1, ids)
    if norm:
        w = w / w.double().sum(-1, keepdim=True).float().clamp_min(float(_WEIGHT_SUM_MIN))
    if scale != 1.0:
        w = w * scale
    return ids, w
