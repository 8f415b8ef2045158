"""``llama``: dense Llama and Mixtral-style MoE; the base the Qwen modules derive from.

Block (llama.cpp src/models/llama.cpp)::

    h = rmsnorm(x, attn_norm)
    q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)   [T, NH, D], [T, NKV, D], [T, NKV, Dv]
    (qk_norm: per-head rmsnorm of q and k)         qwen3, qwen3moe
    q, k = rope(q), rope(k)                         adjacent pairs (llama) / neox halves (qwen)
    o = attention(q, k, v, scale 1/sqrt(D)) Wo      causal, GQA
    x = x + o
    h = rmsnorm(x, ffn_norm)
    x = x + ffn(h)      dense: (silu(h Wg) * h Wu) Wd
                        MoE:   softmax router -> top-k (renormalised) -> experts (SiLU)

Tensors (ggml ne, create_tensor in src/llama-model.cpp)::

    token_embd {H, V}  output_norm {H}  output {H, V} (optional: tied to token_embd)
    rope_freqs {R/2} (optional, llama3)
    blk.i.attn_norm {H}  attn_q {H, NH*D}  attn_k {H, NKV*D}  attn_v {H, NKV*Dv}  attn_output {NH*Dv, H}
          (biases attn_q/k/v.bias {NH*D}, {NKV*D}, {NKV*Dv}: optional for llama, required for qwen2)
          (attn_q_norm, attn_k_norm {D}: qwen3, qwen3moe)
    blk.i.ffn_norm {H}
          dense: ffn_gate {H, F}  ffn_up {H, F}  ffn_down {F, H}
          MoE:   ffn_gate_inp {H, E}  ffn_gate_exps, ffn_up_exps {H, I, E} (or ffn_gate_up_exps {H, 2I, E})
                 ffn_down_exps {I, H, E}

For ``llama`` the expert width I is ``feed_forward_length`` (llama.cpp), and the rotated
dims must equal the head dim (llama.cpp: "invalid n_rot").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_service.engine.arch.base import (
    MATRIX_TYPES,
    VECTOR_TYPES,
    Architecture,
    HParamReader,
    LayerKV,
    MoEAct,
    OneOf,
    RopeSpec,
    Routing,
    TensorSpec,
)


@dataclass(frozen=True)
class LlamaHParams:
    """Hyperparameters of the llama family (llama.cpp llama_hparams names in comments).

    n_layer (block_count), n_embd (embedding_length), n_head (attention.head_count),
    n_head_kv (attention.head_count_kv, default n_head), head_dim (attention.key_length,
    default n_embd / n_head), head_dim_v (attention.value_length, default head_dim), rope_dim
    (rope.dimension_count, default head_dim), rope_base (rope.freq_base, default 10000),
    rms_eps (attention.layer_norm_rms_epsilon), n_ctx_train (context_length), n_ff (dense FFN
    width, feed_forward_length), n_expert / n_expert_used (expert_count / expert_used_count,
    0 for dense), n_ff_exp (expert width), n_vocab (token_embd rows).
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int


class Llama(Architecture):
    """llama: adjacent-pair RoPE, no q/k norm, optional attention biases, dense or MoE FFN."""

    names = ("llama",)
    neox = False  # RoPE pairs (i, i + R/2) instead of (2i, 2i+1)
    qk_norm = False  # per-head RMSNorm of q and k before RoPE
    qkv_bias = False  # attn_q/k/v biases required (qwen2); otherwise optional
    expert_width_key: str | None = None  # metadata key of the expert width; None: feed_forward_length (llama)
    rope_dim_is_head_dim = True  # llama.cpp refuses rope.dimension_count != head_dim

    # -- hyperparameters -------------------------------------------------------------------

    def read_hparams(self, r: HParamReader) -> LlamaHParams:
        n_layer = r.int("block_count", lo=1, hi=1 << 16)
        n_embd = r.int("embedding_length", lo=1, hi=1 << 20)
        n_head = r.int("attention.head_count", lo=1, hi=1 << 16)
        n_head_kv = r.int("attention.head_count_kv", n_head, lo=1, hi=1 << 16)
        head_dim = r.int("attention.key_length", n_embd // n_head, lo=1, hi=1 << 16)
        head_dim_v = r.int("attention.value_length", head_dim, lo=1, hi=1 << 16)
        n_expert = r.int("expert_count", 0, hi=1 << 16)
        n_expert_used = r.int("expert_used_count", 0, hi=1 << 16)
        if n_expert and self.expert_width_key:  # the dense width is informational then
            n_ff = r.int("feed_forward_length", 0, hi=1 << 24)
            n_ff_exp = r.int(self.expert_width_key, lo=1, hi=1 << 24)
        else:
            n_ff = r.int("feed_forward_length", lo=1, hi=1 << 24)
            n_ff_exp = n_ff if n_expert else 0
        return LlamaHParams(
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            head_dim_v=head_dim_v, rope_dim=r.int("rope.dimension_count", head_dim, lo=0, hi=1 << 16),
            rope_base=r.float("rope.freq_base", 10000.0, lo=0.0, lo_open=True),
            rms_eps=r.float("attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0),
            n_ctx_train=r.int("context_length", 0, hi=1 << 30), n_ff=n_ff, n_expert=n_expert,
            n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, n_vocab=self._n_vocab(r),
        )

    def _n_vocab(self, r: HParamReader) -> int:
        """Vocabulary size: the tokenizer's token list, else ``vocab_size``, else 0 (then the
        token_embd tensor's rows decide)."""
        tokens = r.md.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            return len(tokens)
        return r.int("vocab_size", 0, hi=1 << 24)

    def check_hparams(self) -> list[tuple[str, str]]:
        hp, k = self.hp, self.key
        out = []
        if hp.n_head % hp.n_head_kv:
            out.append((k("attention.head_count_kv"), f"{k('attention.head_count')} = {hp.n_head} is not a multiple "
                        f"of {k('attention.head_count_kv')} = {hp.n_head_kv}"))
        if hp.rope_dim % 2 or not 0 < hp.rope_dim <= hp.head_dim:
            out.append((k("rope.dimension_count"), f"{k('rope.dimension_count')} = {hp.rope_dim} must be even and in "
                        f"2..{hp.head_dim} (the head dim)"))
        elif self.rope_dim_is_head_dim and hp.rope_dim != hp.head_dim:
            out.append((k("rope.dimension_count"), f"{k('rope.dimension_count')} = {hp.rope_dim} must equal the head "
                        f"dim {hp.head_dim} for {self.name}"))
        if hp.n_expert and not 0 < hp.n_expert_used <= hp.n_expert:
            out.append((k("expert_used_count"), f"{k('expert_used_count')} = {hp.n_expert_used}, expected "
                        f"1..{hp.n_expert} ({k('expert_count')})"))
        if not hp.n_expert and hp.n_expert_used:
            out.append((k("expert_used_count"), f"{k('expert_used_count')} = {hp.n_expert_used} but "
                        f"{k('expert_count')} is 0"))
        return out

    # -- tensors ---------------------------------------------------------------------------

    def tensors(self) -> list[TensorSpec | OneOf]:
        hp, s = self.hp, self.spec
        H, V = hp.n_embd, hp.n_vocab or self._embd_rows()
        q_dim, k_dim, v_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.n_head_kv * hp.head_dim_v
        o_dim = hp.n_head * hp.head_dim_v
        emb = ("embedding_length",)
        out: list[TensorSpec | OneOf] = [
            s("token_embd.weight", (H, V), keys=emb + ("vocab_size",), role="model"),
            s("output_norm.weight", (H,), VECTOR_TYPES, emb, role="model"),
            s("output.weight", (H, V), keys=emb + ("vocab_size",), required=False, role="model"),
            s("rope_freqs.weight", (hp.rope_dim // 2,), VECTOR_TYPES, ("rope.dimension_count",), required=False,
              role="model"),
        ]
        head = ("embedding_length", "attention.head_count", "attention.key_length")
        kv = ("embedding_length", "attention.head_count_kv", "attention.key_length")
        kvv = ("embedding_length", "attention.head_count_kv", "attention.value_length")
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            out += [
                s(b + "attn_norm.weight", (H,), VECTOR_TYPES, emb, role="vec"),
                s(b + "attn_q.weight", (H, q_dim), keys=head),
                s(b + "attn_k.weight", (H, k_dim), keys=kv),
                s(b + "attn_v.weight", (H, v_dim), keys=kvv),
                s(b + "attn_output.weight", (o_dim, H), keys=("attention.head_count", "attention.value_length",
                                                            "embedding_length")),
                s(b + "attn_q.bias", (q_dim,), VECTOR_TYPES, head, required=self.qkv_bias, role="vec"),
                s(b + "attn_k.bias", (k_dim,), VECTOR_TYPES, kv, required=self.qkv_bias, role="vec"),
                s(b + "attn_v.bias", (v_dim,), VECTOR_TYPES, kvv, required=self.qkv_bias, role="vec"),
                s(b + "attn_output.bias", (H,), VECTOR_TYPES, emb, required=False, role="vec"),
                s(b + "ffn_norm.weight", (H,), VECTOR_TYPES, emb, role="vec"),
            ]
            if self.qk_norm:
                out += [s(b + "attn_q_norm.weight", (hp.head_dim,), VECTOR_TYPES, ("attention.key_length",), role="vec"),
                        s(b + "attn_k_norm.weight", (hp.head_dim,), VECTOR_TYPES, ("attention.key_length",), role="vec")]
            out += self.ffn_tensors(i)
        return out

    def ffn_tensors(self, i: int) -> list[TensorSpec | OneOf]:
        """Layer ``i``'s FFN: dense when expert_count is 0, else router + routed experts."""
        hp, s, b = self.hp, self.spec, f"blk.{i}."
        H, F = hp.n_embd, hp.n_ff
        if not hp.n_expert:
            ff = ("embedding_length", "feed_forward_length")
            return [s(b + "ffn_gate.weight", (H, F), keys=ff), s(b + "ffn_up.weight", (H, F), keys=ff),
                    s(b + "ffn_down.weight", (F, H), keys=ff)]
        return self.expert_tensors(i)

    def expert_tensors(self, i: int) -> list[TensorSpec | OneOf]:
        hp, s, b = self.hp, self.spec, f"blk.{i}."
        H, E, I = hp.n_embd, hp.n_expert, hp.n_ff_exp  # noqa: E741 - the shape legend
        ik = (self.expert_width_key or "feed_forward_length",)
        ek = ("embedding_length",) + ik + ("expert_count",)
        return [
            # the router is dequantized to float32 once at load: any type the catalog reads (llama.cpp
            # multiplies it as any other matrix)
            s(b + "ffn_gate_inp.weight", (H, E), MATRIX_TYPES, ("embedding_length", "expert_count"), role="router"),
            OneOf(((s(b + "ffn_gate_exps.weight", (H, I, E), MATRIX_TYPES, ek, role="expert"),
                    s(b + "ffn_up_exps.weight", (H, I, E), MATRIX_TYPES, ek, role="expert")),
                   (s(b + "ffn_gate_up_exps.weight", (H, 2 * I, E), MATRIX_TYPES, ek, role="expert"),)),
                  f"layer {i}'s gate/up experts"),
            s(b + "ffn_down_exps.weight", (I, H, E), MATRIX_TYPES, ik + ("embedding_length", "expert_count"),
              role="expert"),
        ]

    def _embd_rows(self) -> int:
        ne = self.tensor_ne.get("token_embd.weight")
        return int(ne[1]) if ne is not None and len(ne) == 2 else 0

    # -- runtime declarations --------------------------------------------------------------

    def kv_layers(self) -> list[LayerKV]:
        hp = self.hp
        return [LayerKV(hp.n_head_kv, hp.head_dim, hp.head_dim_v)] * hp.n_layer

    def rope(self) -> RopeSpec:
        hp = self.hp
        return RopeSpec(dim=hp.rope_dim, base=hp.rope_base, neox=self.neox, freqs_tensor="rope_freqs.weight")

    def routing(self, k: int = 0) -> Routing | None:
        if not self.hp.n_expert:
            return None
        return Routing(k=k or self.hp.n_expert_used, norm=True)

    def moe_act(self) -> MoEAct:
        return MoEAct()

    # -- the block -------------------------------------------------------------------------

    def block(self, be, lw, x, st):
        eps = self.hp.rms_eps
        if _one_token(x):  # a CPU decode step: the residual add and ffn_norm in one compiled call
            o = self.attention(be, lw, be.rmsnorm(x, lw.vecs["attn_norm"], eps), st)
            x1, h = be.add_rms_norm(x, o, lw.vecs["ffn_norm"], eps)
            return x1 + self.ffn(be, lw, h, st)
        x = x + self.attention(be, lw, be.rmsnorm(x, lw.vecs["attn_norm"], eps), st)
        return x + self.ffn(be, lw, be.rmsnorm(x, lw.vecs["ffn_norm"], eps), st)

    def attention(self, be, lw, h, st):
        """Self-attention of h [T, H] -> [T, H] (module docstring)."""
        hp = self.hp
        q, k, v = be.linear(lw, ("attn_q", "attn_k", "attn_v"), h)  # biases added when the layer has them
        q = be.heads(q, hp.n_head, hp.head_dim)  # [T, NH, D]
        k = be.heads(k, hp.n_head_kv, hp.head_dim)  # [T, NKV, D]
        v = be.heads(v, hp.n_head_kv, hp.head_dim_v)  # [T, NKV, Dv]
        if _one_token(q) and _one_token(k):  # CPU decode step: q/k norms and rope in one compiled call
            wq, wk = (lw.vecs["attn_q_norm"], lw.vecs["attn_k_norm"]) if self.qk_norm else (None, None)
            be.qk_norm_rope_one(q[0], k[0], wq, wk, hp.rms_eps, int(st.positions[0]), st.rope)
        else:
            if self.qk_norm:
                q = be.rmsnorm_heads(q, lw.vecs["attn_q_norm"], hp.rms_eps)
                k = be.rmsnorm_heads(k, lw.vecs["attn_k_norm"], hp.rms_eps)
            q, k = be.rope(q, st.positions, st.rope), be.rope(k, st.positions, st.rope)
        out = be.attention(lw.index, q, k, v, st.spans, 1.0 / math.sqrt(hp.head_dim))  # [T, NH, Dv]
        (o,) = be.linear(lw, ("attn_output",), be.flat(out))
        return o

    def ffn(self, be, lw, h, st):
        """Dense SwiGLU FFN, or routed experts with this architecture's routing and activation."""
        if lw.experts is None:
            return be.glu_ffn(lw, h, ("ffn_gate", "ffn_up", "ffn_down"))
        ids, w = st.route(lw, h)
        return be.moe(lw, h, ids, w)


def _one_token(x) -> bool:
    """x is one token's C-contiguous float32 numpy rows (the CPU path's decode step)."""
    return isinstance(x, np.ndarray) and x.shape[0] == 1 and x.dtype == np.float32 and x.flags.c_contiguous

