"""A float64 reference forward pass of a gpt-oss GGUF, written from llama.cpp's graph
(src/models/openai-moe.cpp, build_moe_ffn with SWIGLU_OAI_MOE and SOFTMAX_WEIGHT gating,
build_attn with sinks on the sliding-window / full layers) with every weight dequantized by
gguf-py and no activation quantization: an oracle independent of the engine's kernels, for
small synthetic files (tests and tools; it recomputes attention over the whole prefix).

Block: x += Wo(attn(rope(Wq h + bq), rope(Wk h + bk), Wv h + bv)) + bo, h = rmsnorm(x) * attn_norm;
then x += sum_k w_k (Wd_e act(Wg_e h' + bg_e, Wu_e h' + bu_e) + bd_e), h' = rmsnorm(x) *
post_attention_norm, e and w from top-k of (Wr h' + br) with w = softmax of the k selected
logits; act(g, u) = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1).
"""

from __future__ import annotations

import math

import numpy as np


class GptOssReference:
    """Dequantized weights of a gpt-oss file (float64) and its hyperparameters."""

    def __init__(self, path):
        import gguf
        from gguf.quants import dequantize

        from moe_service.engine.arch.gpt_oss import GptOss
        from moe_service.engine.arch.rope import rope_tables
        from moe_service.engine.tokenizer import read_gguf_metadata

        r = gguf.GGUFReader(str(path))
        md = read_gguf_metadata(path, prefixes=("gpt-oss.",))
        a = "gpt-oss."
        self.n_layer = int(md[a + "block_count"])
        self.n_head = int(md[a + "attention.head_count"])
        self.n_head_kv = int(md[a + "attention.head_count_kv"])
        self.head_dim = int(md[a + "attention.key_length"])
        self.k = int(md[a + "expert_used_count"])
        self.eps = float(md[a + "attention.layer_norm_rms_epsilon"])
        self.window = int(md[a + "attention.sliding_window"])
        pat = md.get(a + "attention.sliding_window_pattern", 2)
        if isinstance(pat, list):
            self.swa = [bool(v) for v in pat]
        else:
            n = int(pat)
            self.swa = [n == 0 or (i % n < n - 1) for i in range(self.n_layer)]
        self.w: dict[str, np.ndarray] = {}
        for t in r.tensors:
            shape = tuple(reversed([int(x) for x in t.shape]))
            self.w[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
        cos, sin = rope_tables(GptOss(md, path).rope(), 4096)  # YaRN tables: tested against the formula
        self.cos, self.sin = cos.astype(np.float64), sin.astype(np.float64)

    def _norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos):  # x [T, heads, D], NEOX halves
        half = x.shape[-1] // 2
        c, s = self.cos[pos][:, None, :half], self.sin[pos][:, None, :half]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def logits(self, ids: list[int]) -> np.ndarray:
        """float64 [T, V]: logits at every position of ``ids`` (one sequence from position 0)."""
        w, T = self.w, len(ids)
        pos = np.arange(T)
        x = w["token_embd.weight"][ids]
        nh, nkv, d = self.n_head, self.n_head_kv, self.head_dim
        for il in range(self.n_layer):
            b = f"blk.{il}."
            h = self._norm(x, w[b + "attn_norm.weight"])
            q = (h @ w[b + "attn_q.weight"].T + w[b + "attn_q.bias"]).reshape(T, nh, d)
            k = (h @ w[b + "attn_k.weight"].T + w[b + "attn_k.bias"]).reshape(T, nkv, d)
            v = (h @ w[b + "attn_v.weight"].T + w[b + "attn_v.bias"]).reshape(T, nkv, d)
            q, k = self._rope(q, pos), self._rope(k, pos)
            rep = nh // nkv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            scores = np.einsum("thd,lhd->htl", q, k) / math.sqrt(d)  # [NH, T, T]
            mask = pos[None, :] > pos[:, None]
            if self.swa[il]:
                mask |= pos[None, :] <= pos[:, None] - self.window
            scores = np.where(mask[None], -np.inf, scores)
            sinks = w[b + "attn_sinks.weight"][:, None, None]
            m = np.maximum(scores.max(-1, keepdims=True), sinks)
            e = np.exp(scores - m)
            p = e / (e.sum(-1, keepdims=True) + np.exp(sinks - m))
            o = np.einsum("htl,lhd->thd", p, v).reshape(T, nh * d)
            x = x + o @ w[b + "attn_output.weight"].T + w[b + "attn_output.bias"]
            h = self._norm(x, w[b + "post_attention_norm.weight"])
            r = h @ w[b + "ffn_gate_inp.weight"].T + w[b + "ffn_gate_inp.bias"]  # [T, E]
            sel = np.argsort(-r, axis=1, kind="stable")[:, : self.k]
            out = np.zeros_like(x)
            for t in range(T):
                lg = r[t, sel[t]]
                wt = np.exp(lg - lg.max())
                wt /= wt.sum()
                for j, ex in enumerate(sel[t]):
                    g = w[b + "ffn_gate_exps.weight"][ex] @ h[t] + w[b + "ffn_gate_exps.bias"][ex]
                    u = w[b + "ffn_up_exps.weight"][ex] @ h[t] + w[b + "ffn_up_exps.bias"][ex]
                    g = np.minimum(g, 7.0)
                    u = np.clip(u, -7.0, 7.0)
                    act = g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)
                    out[t] += wt[j] * (w[b + "ffn_down_exps.weight"][ex] @ act + w[b + "ffn_down_exps.bias"][ex])
            x = x + out
        x = self._norm(x, w["output_norm.weight"])
        return x @ w["output.weight"].T
