"""``gpt-oss`` (gpt-oss-120b, gpt-oss-20b): attention with biases and per-head sinks, sliding
window on alternating layers, YaRN RoPE, MXFP4 experts with biases and a clamped SwiGLU,
routing by the raw router logits with a softmax over the selected experts.

Block (llama.cpp src/models/openai-moe.cpp; graph helpers in src/llama-graph.cpp)::

    h = rmsnorm(x, attn_norm)
    q, k, v = h Wq + bq, h Wk + bk, h Wv + bv        [T, NH, D], [T, NKV, D], [T, NKV, D]
    q, k = rope(q), rope(k)                            NEOX halves, YaRN (factor, original context)
    o = attention(q, k, v, scale 1/sqrt(D), sinks) Wo + bo
        sinks: one logit per query head joining the softmax denominator (ggml_soft_max_add_sinks)
        window: layers with is_swa see keys p - sliding_window < j <= p (LLAMA_SWA_TYPE_STANDARD)
    x = x + o
    h = rmsnorm(x, post_attention_norm)
    logits = h Wr + br                                 [T, E]
    ids = top-k(logits); w = softmax(logits[ids])      (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
    y_e = Wd_e act(Wg_e h + bg_e, Wu_e h + bu_e) + bd_e
        act(g, u) = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)   (ggml_swiglu_oai)
    x = x + sum_k w_k y_k

Sliding-window layers (llama.cpp load_swa_pattern(ml, 2), set_swa_pattern): the key
``attention.sliding_window_pattern`` as an array of booleans (one per layer, true = sliding)
or as a number n (layer i slides when n == 0 or i % n < n - 1); absent: n = 2, so the even
layers slide and the odd ones attend to the whole context. ``attention.sliding_window`` is
the window in tokens (128 in the releases).

RoPE: ``rope.freq_base`` (150000 in the releases) for every layer; YaRN from
``rope.scaling.*`` (arch/rope.py scaling_from_metadata: factor 32, original context 4096,
cos/sin scaled by 1 + 0.1 ln 32). llama.cpp lets sliding layers use ``rope.freq_base_swa``;
a file whose value differs from ``rope.freq_base`` is refused (no release has one).

Tensors (ggml ne; llama_model_openai_moe::load_arch_tensors)::

    token_embd {H, V}   output_norm {H}   output {H, V}
    blk.i.attn_norm {H}   post_attention_norm {H}
          attn_q {H, NH*D} attn_k {H, NKV*D} attn_v {H, NKV*D} (+ optional biases {NH*D}, {NKV*D})
          attn_output {NH*D, H} + bias {H}     attn_sinks {NH}
          ffn_gate_inp {H, E} + bias {E}
          ffn_gate_exps, ffn_up_exps {H, I, E} + biases {I, E}   ffn_down_exps {I, H, E} + bias {H, E}

The expert biases are read in place by the MoE kernels: float32 only. D is the rotated
dimension count (llama.cpp builds Q/K/V of n_head * n_rot): ``rope.dimension_count`` must
equal ``attention.key_length``, and ``attention.value_length`` too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_service.engine.arch.base import (
    ACT_SWIGLU_OAI,
    F32_ONLY,
    GATING_SOFTMAX_WEIGHT,
    MATRIX_TYPES,
    VECTOR_TYPES,
    Architecture,
    HParamError,
    HParamReader,
    LayerKV,
    MoEAct,
    RopeSpec,
    Routing,
    TensorSpec,
)
from moe_service.engine.arch.rope import scaling_from_metadata

SWIGLU_OAI = MoEAct(ACT_SWIGLU_OAI, alpha=1.702, limit=7.0)  # llama.cpp build_moe_ffn LLM_FFN_SWIGLU_OAI_MOE


@dataclass(frozen=True)
class GptOssHParams:
    """Hyperparameters (llama.cpp names in comments).

    n_layer (block_count), n_embd (embedding_length), n_head / n_head_kv
    (attention.head_count / head_count_kv), head_dim (attention.key_length, default
    n_embd / n_head; = value_length = rope.dimension_count), rms_eps
    (attention.layer_norm_rms_epsilon), n_ctx_train (context_length), n_expert /
    n_expert_used (expert_count / expert_used_count), n_ff_exp (expert_feed_forward_length),
    n_vocab (tokenizer tokens, else vocab_size, else token_embd rows), sliding_window
    (attention.sliding_window, tokens), swa (per layer: True = sliding window), rope_base
    (rope.freq_base), rope (RopeSpec kwargs from rope.scaling.*).
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    sliding_window: int
    swa: tuple[bool, ...]
    rope_base: float
    rope_scaling: dict


class GptOss(Architecture):
    """gpt-oss (module docstring)."""

    names = ("gpt-oss",)

    # -- hyperparameters -------------------------------------------------------------------

    def read_hparams(self, r: HParamReader) -> GptOssHParams:
        n_layer = r.int("block_count", lo=1, hi=1 << 16)
        n_embd = r.int("embedding_length", lo=1, hi=1 << 20)
        n_head = r.int("attention.head_count", lo=1, hi=1 << 16)
        head_dim = r.int("attention.key_length", n_embd // n_head, lo=1, hi=1 << 16)
        n_ctx_train = r.int("context_length", 0, hi=1 << 30)
        base = r.float("rope.freq_base", 10000.0, lo=0.0, lo_open=True)
        base_swa = r.float("rope.freq_base_swa", base, lo=0.0, lo_open=True)
        if base_swa != base:
            key = r.full("rope.freq_base_swa")
            raise HParamError(f"{r.path}: metadata key {key} = {base_swa} differs from {r.full('rope.freq_base')} = "
                              f"{base}; a separate RoPE base for sliding-window layers is not supported", key)
        n_vocab = self.read_n_vocab(r)
        return GptOssHParams(
            n_layer=n_layer, n_embd=n_embd, n_head=n_head,
            n_head_kv=r.int("attention.head_count_kv", n_head, lo=1, hi=1 << 16), head_dim=head_dim,
            rms_eps=r.float("attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0), n_ctx_train=n_ctx_train,
            n_expert=r.int("expert_count", lo=1, hi=1 << 16), n_expert_used=r.int("expert_used_count", lo=1, hi=1 << 16),
            n_ff_exp=r.int("expert_feed_forward_length", lo=1, hi=1 << 24), n_vocab=n_vocab,
            sliding_window=r.int("attention.sliding_window", lo=1, hi=1 << 30), swa=self._swa_layers(r, n_layer),
            rope_base=base, rope_scaling=scaling_from_metadata(r, n_ctx_train),
        )

    def _swa_layers(self, r: HParamReader, n_layer: int) -> tuple[bool, ...]:
        """Which layers slide (module docstring; llama.cpp load_swa_pattern with default 2)."""
        key = r.full("attention.sliding_window_pattern")
        v = r.md.get(key)
        if isinstance(v, list):
            if len(v) < n_layer or not all(isinstance(b, bool | int) for b in v):
                raise HParamError(f"{r.path}: metadata key {key} lists {len(v)} values, expected {n_layer} booleans "
                                  f"(one per layer of {r.full('block_count')})", key)
            return tuple(bool(b) for b in v[:n_layer])
        n = r.int("attention.sliding_window_pattern", 2, hi=1 << 16)
        return tuple(n == 0 or (i % n < n - 1) for i in range(n_layer))

    def check_hparams(self) -> list[tuple[str, str]]:
        hp, k = self.hp, self.key
        out = []
        if hp.n_head % hp.n_head_kv:
            out.append((k("attention.head_count_kv"), f"{k('attention.head_count')} = {hp.n_head} is not a multiple "
                        f"of {k('attention.head_count_kv')} = {hp.n_head_kv}"))
        rope_dim = self.r.int("rope.dimension_count", hp.head_dim, lo=0, hi=1 << 16)
        if rope_dim != hp.head_dim or hp.head_dim % 2:
            out.append((k("rope.dimension_count"), f"{k('rope.dimension_count')} = {rope_dim} must equal "
                        f"{k('attention.key_length')} = {hp.head_dim} and be even (gpt-oss rotates whole heads)"))
        dv = self.r.int("attention.value_length", hp.head_dim, lo=0, hi=1 << 16)
        if dv != hp.head_dim:
            out.append((k("attention.value_length"), f"{k('attention.value_length')} = {dv} must equal "
                        f"{k('attention.key_length')} = {hp.head_dim} for gpt-oss"))
        if not hp.n_expert_used <= hp.n_expert:
            out.append((k("expert_used_count"), f"{k('expert_used_count')} = {hp.n_expert_used}, expected "
                        f"1..{hp.n_expert} ({k('expert_count')})"))
        return out

    # -- tensors ---------------------------------------------------------------------------

    def tensors(self) -> list[TensorSpec]:
        hp, s = self.hp, self.spec
        H, V, E, I = hp.n_embd, hp.n_vocab, hp.n_expert, hp.n_ff_exp  # noqa: E741 - the shape legend
        q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        emb, voc = ("embedding_length",), ("embedding_length", "vocab_size")
        head = ("embedding_length", "attention.head_count", "attention.key_length")
        kv = ("embedding_length", "attention.head_count_kv", "attention.key_length")
        ex = ("embedding_length", "expert_feed_forward_length", "expert_count")
        out = [
            s("token_embd.weight", (H, V), keys=voc, role="model"),
            s("output_norm.weight", (H,), VECTOR_TYPES, emb, role="model"),
            s("output.weight", (H, V), keys=voc, role="model"),
        ]
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            out += [
                s(b + "attn_norm.weight", (H,), VECTOR_TYPES, emb, role="vec"),
                s(b + "post_attention_norm.weight", (H,), VECTOR_TYPES, emb, role="vec"),
                s(b + "attn_q.weight", (H, q_dim), keys=head),
                s(b + "attn_k.weight", (H, kv_dim), keys=kv),
                s(b + "attn_v.weight", (H, kv_dim), keys=kv),
                s(b + "attn_q.bias", (q_dim,), VECTOR_TYPES, head, required=False, role="vec"),
                s(b + "attn_k.bias", (kv_dim,), VECTOR_TYPES, kv, required=False, role="vec"),
                s(b + "attn_v.bias", (kv_dim,), VECTOR_TYPES, kv, required=False, role="vec"),
                s(b + "attn_output.weight", (q_dim, H), keys=head),
                s(b + "attn_output.bias", (H,), VECTOR_TYPES, emb, role="vec"),
                s(b + "attn_sinks.weight", (hp.n_head,), VECTOR_TYPES, ("attention.head_count",), role="vec"),
                s(b + "ffn_gate_inp.weight", (H, E), VECTOR_TYPES, ("embedding_length", "expert_count"), role="router"),
                s(b + "ffn_gate_inp.bias", (E,), VECTOR_TYPES, ("expert_count",), role="vec"),
                s(b + "ffn_gate_exps.weight", (H, I, E), MATRIX_TYPES, ex, role="expert"),
                s(b + "ffn_up_exps.weight", (H, I, E), MATRIX_TYPES, ex, role="expert"),
                s(b + "ffn_down_exps.weight", (I, H, E), MATRIX_TYPES, ex, role="expert"),
                s(b + "ffn_gate_exps.bias", (I, E), F32_ONLY, ex[1:], role="expert_bias"),
                s(b + "ffn_up_exps.bias", (I, E), F32_ONLY, ex[1:], role="expert_bias"),
                s(b + "ffn_down_exps.bias", (H, E), F32_ONLY, ("embedding_length", "expert_count"), role="expert_bias"),
            ]
        return out

    # -- runtime declarations --------------------------------------------------------------

    def kv_layers(self) -> list[LayerKV]:
        hp = self.hp
        return [LayerKV(hp.n_head_kv, hp.head_dim, hp.head_dim, window=hp.sliding_window if swa else 0)
                for swa in hp.swa]

    def rope(self) -> RopeSpec:
        hp = self.hp
        return RopeSpec(dim=hp.head_dim, base=hp.rope_base, neox=True, **hp.rope_scaling)

    def routing(self, k: int = 0) -> Routing:
        return Routing(k=k or self.hp.n_expert_used, gating=GATING_SOFTMAX_WEIGHT, norm=False)

    def moe_act(self) -> MoEAct:
        return SWIGLU_OAI

    # -- the block -------------------------------------------------------------------------

    def block(self, be, lw, x, st):
        hp = self.hp
        h = be.rmsnorm(x, lw.vecs["attn_norm"], hp.rms_eps)
        q, k, v = be.linear(lw, ("attn_q", "attn_k", "attn_v"), h)  # + bq, bk, bv
        q = be.rope(be.heads(q, hp.n_head, hp.head_dim), st.positions, st.rope)  # [T, NH, D]
        k = be.rope(be.heads(k, hp.n_head_kv, hp.head_dim), st.positions, st.rope)  # [T, NKV, D]
        v = be.heads(v, hp.n_head_kv, hp.head_dim)  # [T, NKV, D]
        window = hp.sliding_window if hp.swa[lw.index] else 0
        out = be.attention(lw.index, q, k, v, st.spans, 1.0 / math.sqrt(hp.head_dim), window=window,
                           sinks=lw.vecs["attn_sinks"])  # [T, NH, D]
        (o,) = be.linear(lw, ("attn_output",), be.flat(out))  # + bo
        x = x + o
        h = be.rmsnorm(x, lw.vecs["post_attention_norm"], hp.rms_eps)
        ids, w = st.route(lw, h)  # [T, K]: top-k of Wr h + br, softmax over those k
        return x + be.moe(lw, h, ids, w)
