"""A whole-sequence deepseek4 forward pass in numpy (float32/float64, weights dequantized),
composed of moe_service.engine.ds4_ops, for checking llama.cpp facts against its goldens.
One sequence, every position at once, masks as llama.cpp's dsv4 KV cache builds them:
raw keys in the sliding window (p - j < window), compressed row b visible from position
(b + 1) * ratio - 1 on, ratio-4 rows further limited to the indexer's top-k.

``hook`` (optional): ``hook(name, il, value) -> value`` is called at each intermediate that
llama.cpp's deepseek4 graph names with ``cb`` (src/models/deepseek4.cpp: "attn_norm", "q",
"kv", "lid_score_masked", "attn_out", "l_last", ...; il -1 outside the layers), value in
numpy's [T, ...] order (llama.cpp's ggml ne reversed); what it returns replaces the value, so a
caller can record ours and continue from llama.cpp's (tools/compare_ops.py). None: no calls.
Names not computed as one tensor there are ours ("lid_score": the indexer's visible scores
[T, nb] before the top-k; "lid_top_k": the selection bool [T, nb]; "csa_comp", "hca_comp",
"lid_comp": a layer's compressed rows [nb, D])."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from moe_service.engine import ds4_ops as ops
from moe_service.engine.arch.base import RopeSpec
from moe_service.engine.arch.deepseek4 import Deepseek4
from moe_service.engine.arch.rope import rope_tables


class Ds4Reference:
    def __init__(self, path: str | Path, n_ctx: int = 2048, hook=None):
        self.hook = hook
        rd = GGUFReader(str(path))
        md = {}
        for f in rd.fields.values():
            if f.name.startswith("GGUF."):
                continue
            v = f.contents()
            md[f.name] = v
        self.w: dict[str, np.ndarray] = {}
        for t in rd.tensors:
            a = dequantize(t.data, t.tensor_type) if t.tensor_type.name not in ("I32",) else np.asarray(t.data)
            self.w[t.name] = np.asarray(a).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
        self.arch = Deepseek4(md, path, tensor_ne={t.name: tuple(int(n) for n in t.shape) for t in rd.tensors})
        hp = self.hp = self.arch.hp
        half = hp.n_rot // 2
        self.rope_plain = rope_tables(RopeSpec(dim=hp.n_rot, base=hp.rope_base, neox=False), n_ctx)
        self.rope_comp = rope_tables(self.arch.rope_compressed(), n_ctx)
        assert self.rope_plain[0].shape[1] == half

    def _h(self, name: str, il: int, value):
        return value if self.hook is None else self.hook(name, il, value)

    def W(self, name):
        return self.w[name].astype(np.float32)

    def lin(self, name, x):
        return (x @ self.W(name).T).astype(np.float32)

    def norm(self, x, name):
        return ops.rms(x, self.hp.rms_eps) * self.W(name)

    def forward(self, ids: list[int]) -> np.ndarray:
        """Logits [T, V] for one sequence."""
        hp = self.hp
        ids = np.asarray(ids)
        T = len(ids)
        pos = np.arange(T)
        x = np.repeat(self.W("token_embd.weight")[ids][:, None, :], hp.hc, axis=1)
        x = self._h("hc_init", -1, x)
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            h, post, comb = ops.hc_pre(x, self.W(b + "hc_attn_fn.weight"), self.W(b + "hc_attn_scale.weight"),
                                       self.W(b + "hc_attn_base.weight"), hp.rms_eps, hp.hc_eps, hp.hc_iters)
            post, comb = self._h("hc_post", il, post), self._h("hc_comb", il, comb)
            h = self._h("hc_attn_pre", il, h)
            h = self._h("attn_norm", il, self.norm(h, b + "attn_norm.weight"))
            y = self._h("attn_out", il, self.attention(il, h, pos))
            x = self._h("hc_attn_post", il, ops.hc_post(y, x, post, comb))
            h, post, comb = ops.hc_pre(x, self.W(b + "hc_ffn_fn.weight"), self.W(b + "hc_ffn_scale.weight"),
                                       self.W(b + "hc_ffn_base.weight"), hp.rms_eps, hp.hc_eps, hp.hc_iters)
            post, comb = self._h("hc_post", il, post), self._h("hc_comb", il, comb)
            h = self._h("hc_ffn_pre", il, h)
            h = self._h("ffn_norm", il, self.norm(h, b + "ffn_norm.weight"))
            y = self._h("ffn_out", il, self.ffn(il, h, ids))
            x = self._h("l_last", il, ops.hc_post(y, x, post, comb))
        h = ops.hc_head(x, self.W("output_hc_fn.weight"), self.W("output_hc_scale.weight"),
                        self.W("output_hc_base.weight"), hp.rms_eps, hp.hc_eps)
        h = self._h("hc_head", -1, h)
        h = self._h("result_norm", -1, self.norm(h, "output_norm.weight"))
        return self._h("result_output", -1, self.lin("output.weight", h))

    def _compressed(self, h, pos, kv_name, gate_name, ape_name, norm_name, ratio, cos, sin, tag="", il=-1):
        kv = self.lin(kv_name, h)
        score = self.lin(gate_name, h) + self.W(ape_name)[pos % ratio]
        if tag:
            kv = self._h(f"{tag}_state_kv", il, kv)
            score = self._h(f"{tag}_state_score_ape", il, score)
        comp = ops.compress(kv, score, ratio, overlap=ratio == 4)
        comp = self.norm(comp, norm_name)
        comp = ops.rope_last(comp[:, None, :], np.arange(len(comp)) * ratio, cos, sin)[:, 0, :]
        return self._h(f"{tag}_comp", il, comp) if tag else comp

    def attention(self, il, h, pos):
        hp = self.hp
        b = f"blk.{il}."
        T, NH, D = len(pos), hp.n_head, hp.head_dim
        ratio = hp.compress_ratios[il]
        cos, sin = self.rope_comp if ratio else self.rope_plain
        qr = self._h("qr_norm", il, self.norm(self.lin(b + "attn_q_a.weight", h), b + "attn_q_a_norm.weight"))
        q = self._h("q_norm", il, ops.rms(self.lin(b + "attn_q_b.weight", qr).reshape(T, NH, D), hp.rms_eps))
        q = self._h("q", il, ops.rope_last(q, pos, cos, sin))
        kv = self.norm(self.lin(b + "attn_kv.weight", h), b + "attn_kv_a_norm.weight")
        kv = self._h("kv_norm", il, kv[:, None, :])[:, 0, :]
        kv = self._h("kv", il, ops.rope_last(kv[:, None, :], pos, cos, sin))[:, 0, :]
        i, j = pos[:, None], pos[None, :]
        mask = (j <= i) & (i - j < hp.window)
        keys = kv
        if ratio:
            comp = self._compressed(h, pos, b + "attn_compressor_kv.weight", b + "attn_compressor_gate.weight",
                                    b + "attn_compressor_ape.weight", b + "attn_compressor_norm.weight", ratio,
                                    cos, sin, "csa" if ratio == 4 else "hca", il)
            nb = len(comp)
            visible = np.arange(nb)[None, :] < ((pos + 1) // ratio)[:, None]
            if ratio == 4:
                visible = visible & self.indexer_topk(il, h, qr, pos, visible, cos, sin)
            keys = np.concatenate([kv, comp])
            mask = np.concatenate([mask, visible], axis=1)
        o = ops.attend_sinks(q, keys, mask, self.W(b + "attn_sinks.weight"), 1.0 / np.sqrt(D))
        name = "attn_raw" if not ratio else "attn_csa_lid" if ratio == 4 else "attn_hca"
        o = self._h(name, il, o.reshape(T, NH * D)).reshape(T, NH, D)
        o = self._h("attn_derope", il, ops.rope_last(o, pos, cos, sin, inverse=True))
        G, Ro = hp.o_groups, hp.o_lora_rank
        wa = self.W(b + "attn_output_a.weight").reshape(G, Ro, NH * D // G)
        og = o.reshape(T, G, NH * D // G)
        oa = np.einsum("tgi,gri->tgr", og, wa).reshape(T, G * Ro).astype(np.float32)
        return self.lin(b + "attn_output_b.weight", oa)

    def indexer_topk(self, il, h, qr, pos, visible, cos, sin):
        hp = self.hp
        b = f"blk.{il}."
        T, Ni, Di = len(pos), hp.indexer_heads, hp.indexer_dim
        k = self._compressed(h, pos, b + "indexer_compressor_kv.weight", b + "indexer_compressor_gate.weight",
                             b + "indexer_compressor_ape.weight", b + "indexer_compressor_norm.weight", 4, cos, sin,
                             "lid", il)
        q = ops.rope_last(self.lin(b + "indexer.attn_q_b.weight", qr).reshape(T, Ni, Di), pos, cos, sin)
        q = self._h("lid_q_rope", il, q)
        w = self._h("lid_weights", il, self.lin(b + "indexer.proj.weight", h) / np.float32(np.sqrt(Di * Ni)))
        s = np.einsum("thd,nd->thn", q.astype(np.float64), k.astype(np.float64))
        score = np.einsum("thn,th->tn", np.maximum(s, 0.0), w.astype(np.float64))
        score = self._h("lid_score", il, np.where(visible, score, -np.inf))
        sel = ops.top_k_rows(score, visible.sum(axis=1), hp.indexer_top_k)  # ties as ggml_top_k
        return self._h("lid_top_k", il, sel & visible)

    def ffn(self, il, h, ids):
        hp = self.hp
        b = f"blk.{il}."
        probs = self._h("ffn_moe_probs", il, ops.sqrt_softplus(self.lin(b + "ffn_gate_inp.weight", h)))
        if il < hp.hash_layers:
            e_ids, w = ops.route(probs, hp.n_expert_used, None, self.w[b + "ffn_gate_tid2eid.weight"][ids],
                                 hp.weights_norm, hp.weights_scale)
        else:
            e_ids, w = ops.route(probs, hp.n_expert_used, self.W(b + "exp_probs_b.bias"), None, hp.weights_norm,
                                 hp.weights_scale)
        e_ids = self._h("ffn_moe_topk", il, e_ids)
        gw, uw, dw = (self.w[b + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for t in range(len(h)):
            for e, we in zip(e_ids[t], w[t], strict=True):
                a = ops.swiglu_clamp(gw[e] @ h[t], uw[e] @ h[t], hp.clamp_exp[il])
                out[t] += we * (dw[e] @ a)
        a = ops.swiglu_clamp(self.lin(b + "ffn_gate_shexp.weight", h), self.lin(b + "ffn_up_shexp.weight", h),
                             hp.clamp_shexp[il])
        out = self._h("ffn_moe_out", il, out)
        return out + self._h("ffn_shexp", il, self.lin(b + "ffn_down_shexp.weight", a))
