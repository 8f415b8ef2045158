"""Multi-head latent attention (DeepSeek V2/V3/R1, Kimi K2: ``deepseek2`` in GGUF) over a
latent KV cache, on the CPU (quantized kernels in place, numba glue) and in torch.

Shapes: T tokens of the step, NH heads, H hidden, Rq q_lora_rank, Rkv kv_lora_rank, Dn
qk_nope, Dr qk_rope (RoPE dims), Dv v_head, L = Rkv + Dr (latent cache row), S sequence
slots, C cache length.

::

    h [T, H] -> q  = W_qb rmsnorm(W_qa h)   (lite: W_q h)              [T, NH, Dn + Dr]
             -> kv = W_kva h                                            [T, Rkv + Dr]
    q_nope, q_pe = q[..., :Dn], q[..., Dn:];  kv_c, k_pe = kv[:, :Rkv], kv[:, Rkv:]
    q_pe, k_pe = rope(q_pe), rope(k_pe)  (adjacent pairs, YaRN tables); kv_c = rmsnorm(kv_c)
    q_abs[h] = W_kb[h] q_nope[h]                      (absorbed: [Rkv], W_kb[h] is [Rkv, Dn])
    cache row (per token, f16): [kv_c | k_pe]          L values: no per-head K or V is stored
    o_lat[h] = softmax(scale * [q_abs[h] | q_pe[h]] . cache rows) . cache rows[:, :Rkv]
    o[h] = W_vb[h] o_lat[h]  ([Dv], W_vb[h] is [Dv, Rkv]);  out = W_o o  [T, H]

Both GGUF forms: ``attn_k_b`` {Dn, Rkv, NH} / ``attn_v_b`` {Rkv, Dv, NH} (the split form;
llama.cpp computes exactly this absorbed form for every batch), or the legacy ``attn_kv_b``
{Rkv, NH*(Dn+Dv)} whose head h holds rows h*(Dn+Dv) .. +Dn (K, [Dn, Rkv]) then Dv rows
(V, [Dv, Rkv]). llama.cpp expands the legacy form into per-head K and V for every token (an
MHA cache of NH*(Dn+Dr+Dv) values per token); here it runs absorbed like the split form:
the V rows are used in place, the K rows are dequantized once at load and applied
transposed in float32 (q_abs[h] = K[h]^T q_nope[h]). The two orders differ by rounding only.

Numerics on the CPU path (as llama.cpp's non-flash path on these files): W_kb and W_vb are
quantized per-head matmuls (activations quantized to the weight's partner format per
(token, head) row); the cache holds float16; attention goes through
moe_service.engine.attention with ``vc is kc`` (V = the first Rkv dims of a cache row).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from moe_service.engine import quant
from moe_service.engine.quant import matmul_rows

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def _head_matmul_kernel(arena, w_off, head_stride, ggml_type, n_cols, rb, n_rows, n_head, n_tok,
                        xf, xq, xd, xs, xbs, out, kernels):
    rows = np.empty(n_tok, np.int64)
    for h in range(n_head):
        for t in range(n_tok):
            rows[t] = t * n_head + h
        matmul_rows(arena, w_off + h * head_stride, ggml_type, n_cols, rb, 0, n_rows, xf, xq, xd, xs, xbs,
                    rows, rows, out, n_rows, 0, kernels)


def head_matmul(arena: np.ndarray, offset: int, ggml_type: int, n_head: int, n_rows: int, n_cols: int,
                x: np.ndarray, head_stride_bytes: int | None = None) -> np.ndarray:
    """Per-head matmul on a 3-D GGUF weight read in place (ggml_mul_mat broadcast over heads):
    out[t, h] = W[h] @ x[t, h].

    arena: uint8 [*]; W[h]: ``n_rows`` rows of ``n_cols`` ``ggml_type`` elements starting at
    byte ``offset + h * head_stride_bytes`` (default: heads back to back); x: float32
    [T, NH, n_cols] (each (t, h) row quantized to the weight's partner format, as ggml
    does). Returns float32 [T, NH, n_rows]. Single-threaded on the calling thread.
    Raises ValueError when a head's rows run past the arena or x has the wrong shape.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 3 or x.shape[1] != n_head or x.shape[2] != n_cols:
        raise ValueError(f"head_matmul: x of shape {x.shape} for {n_head} heads of {n_cols} columns")
    rb = quant.row_bytes(ggml_type, n_cols)
    stride = n_rows * rb if head_stride_bytes is None else int(head_stride_bytes)
    quant.check_tensor(arena, int(offset) + (n_head - 1) * stride, ggml_type, n_rows, n_cols)
    T = x.shape[0]
    pa = quant.quantize_activations(x.reshape(T * n_head, n_cols), quant.block_format(ggml_type).partner)
    out = np.empty(T * n_head * n_rows, np.float32)
    _head_matmul_kernel(arena, int(offset), stride, int(ggml_type), int(n_cols), rb, int(n_rows), int(n_head), T,
                        pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, out, quant.ensure_kernels([ggml_type]))
    return out.reshape(T, n_head, n_rows)


def absorb_q_float(q_nope: np.ndarray, k_b: np.ndarray) -> np.ndarray:
    """q_abs[t, h, r] = sum_i k_b[h, i, r] q_nope[t, h, i] in float32 (the legacy form's K rows
    applied transposed). q_nope float32 [T, NH, Dn]; k_b float32 [NH, Dn, Rkv]."""
    return np.einsum("thi,hir->thr", q_nope, k_b, optimize=False).astype(np.float32, copy=False)


def split_legacy_kv_b(kv_b: np.ndarray, n_head: int, qk_nope: int, v_head: int) -> tuple[np.ndarray, np.ndarray]:
    """Legacy ``attn_kv_b`` dequantized, float32 [NH*(Dn+Dv), Rkv] -> (K [NH, Dn, Rkv],
    V [NH, Dv, Rkv]) (the converter's split: head h's first Dn rows are K, the next Dv V)."""
    w = kv_b.reshape(n_head, qk_nope + v_head, -1)
    return np.ascontiguousarray(w[:, :qk_nope]), np.ascontiguousarray(w[:, qk_nope:])


def attend_latent_torch(q: torch.Tensor, cache: torch.Tensor, spans, scale: float, rkv: int) -> torch.Tensor:
    """Attention of the step's queries over a latent cache in torch, as ggml's non-flash path
    rounds it (q and probabilities rounded to float16, the rest float32).

    q: float32 [T, NH, L]; cache: float16 [S, C, 1, L] already holding the step's rows;
    spans: (seq, a, e, n0) as moe_service.engine.attention. Returns float32 [T, NH, Rkv].
    """
    T, NH, L = q.shape
    out = torch.empty(T, NH, rkv, dtype=torch.float32, device=q.device)
    for s, a, e, n0 in spans:
        n = e - a
        keys = cache[s, : n0 + n, 0].float()  # [Lk, L]
        qs = q[a:e].to(torch.float16).float()  # [n, NH, L]
        scores = torch.einsum("thd,ld->htl", qs, keys) * scale  # [NH, n, Lk]
        if n > 1:
            qpos = torch.arange(n0, n0 + n, device=q.device)[:, None]
            kpos = torch.arange(0, n0 + n, device=q.device)[None, :]
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(torch.float16).float()
        out[a:e] = torch.einsum("htl,ld->thd", probs, keys[:, :rkv])
    return out
