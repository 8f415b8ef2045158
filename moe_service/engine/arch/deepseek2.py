"""``deepseek2``: DeepSeek V2 / V2.5 / V3 / R1 and Kimi K2 (llama.cpp src/models/deepseek2.cpp).

Shapes: T tokens, H hidden, NH heads, Rq q_lora_rank, Rkv kv_lora_rank, Dn qk_nope, Dr
qk_rope (rotated dims), Dv v_head, L = Rkv + Dr, E experts, I expert width, F dense width,
S shared experts.

Block::

    h = rmsnorm(x, attn_norm)
    q = W_qb rmsnorm(W_qa h, attn_q_a_norm)  (lite, Rq = 0: q = W_q h)   [T, NH, Dn + Dr]
    kv = W_kva h;  c = rmsnorm(kv[:, :Rkv], attn_kv_a_norm);  k_pe = rope(kv[:, Rkv:])
    q_pe = rope(q[..., Dn:]);  q_abs[h] = W_kb[h] q[h, :Dn]          absorbed: [T, NH, Rkv]
    latent cache row per token: [c | k_pe] (L values, float16; V = its first Rkv values)
    o_lat = attention([q_abs | q_pe], rows, scale = mscale^2 / sqrt(Dn + Dr))  [T, NH, Rkv]
    x = x + W_o (W_vb[h] o_lat[h])
    h = rmsnorm(x, ffn_norm)
    x = x + (layer < leading_dense_block_count ?  silu(h W_g) * h W_u) W_d
             : routed experts (sigmoid or softmax gating, selection bias, group limit,
               norm, scale) + shared experts silu(h W_gs) * h W_us) W_ds)

Both GGUF forms of the attention: the split ``attn_k_b`` {Dn, Rkv, NH} and ``attn_v_b``
{Rkv, Dv, NH} (written with ``key_length_mla`` / ``value_length_mla``; llama.cpp runs the
absorbed form above for every batch), and the legacy ``attn_kv_b`` {Rkv, NH*(Dn+Dv)}
(head h: Dn K rows then Dv V rows), which runs absorbed here too: its V rows in place, its
K rows dequantized once and applied transposed in float32 (llama.cpp expands this form
into per-head K and V instead; the two differ by rounding). The KV cache is the latent row
in both forms: L values per token per layer (V3: 576; expanded heads would be NH*(Dn+Dr+Dv)
= 40960).

Tensors (ggml ne; llama.cpp llama_model_deepseek2::load_arch_tensors)::

    token_embd {H, V}  output_norm {H}  output {H, V} (optional: tied)
    blk.i.attn_norm {H}  attn_q_a_norm {Rq}  attn_q_a {H, Rq}  attn_q_b {Rq, NH*(Dn+Dr)}  | attn_q {H, NH*(Dn+Dr)}
          attn_kv_a_norm {Rkv}  attn_kv_a_mqa {H, Rkv+Dr}
          attn_k_b {Dn, Rkv, NH}  attn_v_b {Rkv, Dv, NH}  | attn_kv_b {Rkv, NH*(Dn+Dv)}
          attn_output {NH*Dv, H}  ffn_norm {H}
      i < n_dense_lead: ffn_gate, ffn_up {H, F}  ffn_down {F, H}
      else:  ffn_gate_inp {H, E}  exp_probs_b.bias {E} (optional)
             ffn_gate_exps, ffn_up_exps {H, I, E} (or ffn_gate_up_exps {H, 2I, E})  ffn_down_exps {I, H, E}
             ffn_gate_shexp, ffn_up_shexp {H, I*S}  ffn_down_shexp {I*S, H}

Hyperparameters (``deepseek2.*``; llama_model_deepseek2::load_arch_hparams): see
:class:`Deepseek2HParams`. YaRN and DeepSeek's attention scale: :func:`yarn_from_metadata`.
Kimi K2 files carry this architecture string and the same keys (384 experts, one group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_service.engine.arch.base import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    MATRIX_TYPES,
    VECTOR_TYPES,
    Architecture,
    HParamReader,
    LayerKV,
    OneOf,
    RopeSpec,
    Routing,
    TensorSpec,
)
from moe_service.engine.quant.tensors import dequantize_tensor

F32 = np.float32


def _logf(x) -> np.float32:
    return F32(math.log(float(F32(x))))


@dataclass(frozen=True)
class Yarn:
    """What llama.cpp hands ggml_rope_ext for a deepseek2 file, and its softmax scale.

    From ``rope.scaling.type`` / ``factor`` / ``original_context_length`` /
    ``yarn_log_multiplier`` / ``attn_factor`` (llama-model.cpp, llama-context.cpp,
    models/deepseek2.cpp), in float32 as there:

        freq_scale = 1 / factor (1 without a factor or with type none); ext = 1 for yarn
        log_mul = yarn_log_multiplier / 0.1 (the converter writes 0.1 * mscale_all_dim)
        get_mscale(s, m) = 1 + 0.1 m ln s (1 when s <= 1)
        yarn: a = get_mscale(f, m') / get_mscale(f, log_mul), m' = log_mul when != 1 else 1
              (no log_mul: a = get_mscale(f, 1)); then a /= 1 + 0.1 ln f (ggml's rope multiplies
              its cos/sin by 1 + 0.1 ln(1/freq_scale) again)
        a *= rope.scaling.attn_factor
        kq_scale = m^2 / sqrt(Dn + Dr), m = a (1 + 0.1 ln(1/freq_scale)) (1 + 0.1 log_mul ln(1/freq_scale))
    """

    freq_scale: float
    ext_factor: float
    attn_factor: float
    n_ctx_orig: int
    log_mul: float

    def kq_scale(self, head_k: int) -> float:
        lf = _logf(F32(1.0) / F32(self.freq_scale))
        org = F32(F32(self.attn_factor) * F32(F32(1.0) + F32(F32(0.1) * lf)))
        m = F32(org * F32(F32(1.0) + F32(F32(F32(0.1) * F32(self.log_mul)) * lf)))
        return float(F32(F32(m * m) / F32(math.sqrt(float(head_k)))))


def yarn_from_metadata(r: HParamReader, n_ctx_train: int) -> Yarn:
    """The Yarn of a deepseek2 file (HParamError naming the key for a bad value)."""
    kind = r.str("rope.scaling.type", "linear") or "linear"
    if kind not in ("none", "linear", "yarn"):
        from moe_service.engine.arch.base import HParamError

        raise HParamError(f"{r.path}: metadata key {r.full('rope.scaling.type')} is {kind!r}, expected none, "
                          "linear or yarn", r.full("rope.scaling.type"))
    factor = r.float("rope.scaling.factor", 0.0, lo=0.0, hi=1e6)
    freq_scale = F32(1.0) if factor == 0.0 or kind == "none" else F32(F32(1.0) / F32(factor))
    ext = F32(1.0) if kind == "yarn" else F32(0.0)
    log_mul = F32(F32(r.float("rope.scaling.yarn_log_multiplier", 0.0, lo=0.0, hi=100.0)) / F32(0.1))
    attn = F32(1.0)
    if ext != 0:
        f = F32(F32(1.0) / freq_scale)

        def get_mscale(s, m):
            return F32(1.0) if s <= 1.0 else F32(F32(F32(F32(0.1) * F32(m)) * _logf(s)) + F32(1.0))

        if log_mul != 0:
            attn = F32(get_mscale(f, log_mul if log_mul != F32(1.0) else F32(1.0)) / get_mscale(f, log_mul))
        else:
            attn = get_mscale(f, F32(1.0))
        attn = F32(attn * F32(F32(1.0) / F32(F32(1.0) + F32(F32(0.1) * _logf(f)))))
    attn = F32(attn * F32(r.float("rope.scaling.attn_factor", 1.0, lo=0.0, lo_open=True, hi=1e6)))
    n_orig = r.int("rope.scaling.original_context_length", 0, hi=1 << 30) or n_ctx_train
    return Yarn(float(freq_scale), float(ext), float(attn), int(n_orig), float(log_mul))


@dataclass(frozen=True)
class Deepseek2HParams:
    """deepseek2 hyperparameters (GGUF key in parentheses, under ``deepseek2.``).

    n_layer (block_count minus nextn_predict_layers: the trunk), n_embd (embedding_length),
    n_head (attention.head_count),
    q_lora_rank (attention.q_lora_rank; absent or 0: lite, ``attn_q``), kv_lora_rank
    (attention.kv_lora_rank), qk_rope (rope.dimension_count), split_mla (both
    attention.key_length_mla and value_length_mla present: the split form), qk_nope + qk_rope
    = key_length_mla (split) or attention.key_length (legacy; default n_embd / n_head),
    v_head = value_length_mla or attention.value_length, n_ff (feed_forward_length, the
    leading dense layers), n_dense_lead (leading_dense_block_count), n_expert / n_expert_used
    (expert_count / expert_used_count), n_ff_exp (expert_feed_forward_length),
    n_expert_shared (expert_shared_count), n_group / n_group_used (expert_group_count /
    expert_group_used_count; <= 1: no group limit), gating (expert_gating_func: absent or 1
    softmax, 2 sigmoid; absent on a 47/48-layer 154880-token file: sigmoid, as llama.cpp for
    GLM-4.7 lite), weights_norm (expert_weights_norm), weights_scale
    (expert_weights_scale; absent or 0: 1), rope_base (rope.freq_base), rms_eps
    (attention.layer_norm_rms_epsilon), n_ctx_train (context_length), yarn (rope.scaling.*).
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_vocab: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    split_mla: bool
    n_ff: int
    n_dense_lead: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_group: int
    n_group_used: int
    gating: int
    weights_norm: bool
    weights_scale: float
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    yarn: Yarn

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent KV cache: Rkv + Dr."""
        return self.kv_lora_rank + self.qk_rope


class Deepseek2(Architecture):
    """deepseek2 (module docstring)."""

    names = ("deepseek2",)

    # -- hyperparameters -------------------------------------------------------------------

    def read_hparams(self, r: HParamReader) -> Deepseek2HParams:
        n_layer_all = r.int("block_count", lo=1, hi=1 << 16)
        # multi-token-prediction blocks (nextn) follow the trunk's layers; llama.cpp's n_layer()
        # is the trunk, and a plain decode never runs them
        n_layer = n_layer_all - r.int("nextn_predict_layers", 0, hi=n_layer_all - 1)
        n_embd = r.int("embedding_length", lo=1, hi=1 << 20)
        n_head = r.int("attention.head_count", lo=1, hi=1 << 16)
        k_mla = r.int("attention.key_length_mla", 0, hi=1 << 16)
        v_mla = r.int("attention.value_length_mla", 0, hi=1 << 16)
        split = k_mla > 0 and v_mla > 0
        if split:
            dk, dv = k_mla, v_mla
        else:
            dk = r.int("attention.key_length", n_embd // n_head, lo=1, hi=1 << 16)
            dv = r.int("attention.value_length", dk, lo=1, hi=1 << 16)
        gating = r.int("expert_gating_func", 0, hi=1 << 8)
        n_ctx_train = r.int("context_length", 4096, lo=1, hi=1 << 30)
        n_vocab = self.read_n_vocab(r)
        if gating == 0 and n_layer in (47, 48) and n_vocab == 154880:
            gating = 2  # llama.cpp: GLM-4.7 lite files without the key route by sigmoid
        return Deepseek2HParams(
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_vocab=n_vocab,
            q_lora_rank=r.int("attention.q_lora_rank", 0, hi=1 << 20),
            kv_lora_rank=r.int("attention.kv_lora_rank", lo=1, hi=1 << 20),
            qk_nope=dk - r.int("rope.dimension_count", lo=0, hi=1 << 16) if dk else 0,
            qk_rope=r.int("rope.dimension_count", lo=0, hi=1 << 16), v_head=dv, split_mla=split,
            n_ff=r.int("feed_forward_length", 0, hi=1 << 24),
            n_dense_lead=r.int("leading_dense_block_count", 0, hi=1 << 16),
            n_expert=r.int("expert_count", 0, hi=1 << 16), n_expert_used=r.int("expert_used_count", 0, hi=1 << 16),
            n_ff_exp=r.int("expert_feed_forward_length", 0, hi=1 << 24),
            n_expert_shared=r.int("expert_shared_count", 0, hi=1 << 8),
            n_group=r.int("expert_group_count", 0, hi=1 << 16),
            n_group_used=r.int("expert_group_used_count", 0, hi=1 << 16),
            gating=GATING_SIGMOID if gating == 2 else GATING_SOFTMAX,
            weights_norm=r.bool("expert_weights_norm", False),
            weights_scale=r.float("expert_weights_scale", 0.0, lo=0.0, hi=1e6) or 1.0,
            rope_base=r.float("rope.freq_base", 10000.0, lo=0.0, lo_open=True),
            rms_eps=r.float("attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0),
            n_ctx_train=n_ctx_train, yarn=yarn_from_metadata(r, n_ctx_train),
        )

    def check_hparams(self) -> list[tuple[str, str]]:
        hp, k = self.hp, self.key
        out = []
        gating = self.r.md.get(k("expert_gating_func"))
        if gating not in (None, 0, 1, 2):
            out.append((k("expert_gating_func"), f"{k('expert_gating_func')} = {gating} is not supported "
                        "(1 softmax, 2 sigmoid)"))
        if (k("attention.key_length_mla") in self.r.md) != (k("attention.value_length_mla") in self.r.md) \
                or (self.r.md.get(k("attention.key_length_mla"), 0) > 0) != (
                    self.r.md.get(k("attention.value_length_mla"), 0) > 0):
            out.append((k("attention.key_length_mla"), f"{k('attention.key_length_mla')} and "
                        f"{k('attention.value_length_mla')} must both be set (the split MLA form) or both absent"))
        n_kv = self.r.md.get(k("attention.head_count_kv"))
        want_kv = 1 if hp.split_mla else hp.n_head
        if n_kv is not None and n_kv != want_kv:
            form = "split MLA form caches one latent row per token" if hp.split_mla else \
                "legacy attn_kv_b form has a K and V head per query head"
            out.append((k("attention.head_count_kv"), f"{k('attention.head_count_kv')} = {n_kv}, expected {want_kv} "
                        f"(the {form})"))
        temp = self.r.md.get(k("attention.temperature_scale"))
        if temp:
            out.append((k("attention.temperature_scale"), f"{k('attention.temperature_scale')} = {temp}: the "
                        "position-dependent query temperature (Mistral Large 3 on deepseek2) is not supported"))
        key = k("attention.key_length_mla") if hp.split_mla else k("attention.key_length")
        if hp.qk_rope < 2 or hp.qk_rope % 2 or hp.qk_nope < 1:
            out.append((k("rope.dimension_count"), f"{k('rope.dimension_count')} = {hp.qk_rope} must be even, >= 2 and "
                        f"below the key length {hp.qk_nope + hp.qk_rope} ({key})"))
        if hp.n_dense_lead > hp.n_layer:
            out.append((k("leading_dense_block_count"), f"{k('leading_dense_block_count')} = {hp.n_dense_lead} "
                        f"exceeds {k('block_count')} = {hp.n_layer}"))
        if hp.n_dense_lead and not hp.n_ff:
            out.append((k("feed_forward_length"), f"{k('feed_forward_length')} is needed (> 0) for the "
                        f"{hp.n_dense_lead} leading dense layer(s)"))
        if hp.n_dense_lead < hp.n_layer:
            if not hp.n_expert or not 0 < hp.n_expert_used <= hp.n_expert:
                out.append((k("expert_used_count"), f"{k('expert_used_count')} = {hp.n_expert_used}, expected "
                            f"1..{k('expert_count')} = {hp.n_expert}"))
            elif not hp.n_ff_exp:
                out.append((k("expert_feed_forward_length"), f"{k('expert_feed_forward_length')} must be > 0"))
            elif hp.n_group > 1:
                if hp.n_expert % hp.n_group or not 0 < hp.n_group_used <= hp.n_group:
                    out.append((k("expert_group_count"), f"{k('expert_group_count')} = {hp.n_group} "
                                f"({k('expert_group_used_count')} = {hp.n_group_used}) does not divide "
                                f"{k('expert_count')} = {hp.n_expert} into groups"))
                elif hp.n_expert_used > hp.n_group_used * (hp.n_expert // hp.n_group):
                    out.append((k("expert_used_count"), f"{k('expert_used_count')} = {hp.n_expert_used} exceeds the "
                                f"{hp.n_group_used} kept groups of {hp.n_expert // hp.n_group} experts"))
        return out

    # -- tensors ---------------------------------------------------------------------------

    def tensors(self) -> list[TensorSpec | OneOf]:
        hp, s = self.hp, self.spec
        H, V, NH = hp.n_embd, hp.n_vocab, hp.n_head
        Dk, Rkv = hp.qk_nope + hp.qk_rope, hp.kv_lora_rank
        emb = ("embedding_length",)
        kl = ("attention.key_length_mla",) if hp.split_mla else ("attention.key_length",)
        vl = ("attention.value_length_mla",) if hp.split_mla else ("attention.value_length",)
        out: list[TensorSpec | OneOf] = [
            s("token_embd.weight", (H, V), keys=emb + ("vocab_size",), role="model"),
            s("output_norm.weight", (H,), VECTOR_TYPES, emb, role="model"),
            s("output.weight", (H, V), keys=emb + ("vocab_size",), required=False, role="model"),
        ]
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            out.append(s(b + "attn_norm.weight", (H,), VECTOR_TYPES, emb, role="vec"))
            if hp.q_lora_rank:
                ql = ("attention.q_lora_rank",)
                out += [s(b + "attn_q_a_norm.weight", (hp.q_lora_rank,), VECTOR_TYPES, ql, role="vec"),
                        s(b + "attn_q_a.weight", (H, hp.q_lora_rank), keys=emb + ql),
                        s(b + "attn_q_b.weight", (hp.q_lora_rank, NH * Dk), keys=ql + ("attention.head_count",) + kl)]
            else:
                out.append(s(b + "attn_q.weight", (H, NH * Dk), keys=emb + ("attention.head_count",) + kl))
            lr = ("attention.kv_lora_rank",)
            out += [s(b + "attn_kv_a_norm.weight", (Rkv,), VECTOR_TYPES, lr, role="vec"),
                    s(b + "attn_kv_a_mqa.weight", (H, Rkv + hp.qk_rope), keys=emb + lr + ("rope.dimension_count",))]
            if hp.split_mla:
                out += [s(b + "attn_k_b.weight", (hp.qk_nope, Rkv, NH),
                          keys=kl + ("rope.dimension_count",) + lr + ("attention.head_count",), role="custom"),
                        s(b + "attn_v_b.weight", (Rkv, hp.v_head, NH), keys=lr + vl + ("attention.head_count",),
                          role="custom")]
            else:
                out.append(s(b + "attn_kv_b.weight", (Rkv, NH * (hp.qk_nope + hp.v_head)),
                             keys=lr + ("attention.head_count",) + kl + vl, role="custom"))
            out += [s(b + "attn_output.weight", (NH * hp.v_head, H), keys=("attention.head_count",) + vl + emb),
                    s(b + "ffn_norm.weight", (H,), VECTOR_TYPES, emb, role="vec")]
            out += self.ffn_tensors(i)
        return out

    def ffn_tensors(self, i: int) -> list[TensorSpec | OneOf]:
        hp, s, b = self.hp, self.spec, f"blk.{i}."
        H = hp.n_embd
        if i < hp.n_dense_lead:
            ff = ("embedding_length", "feed_forward_length")
            return [s(b + "ffn_gate.weight", (H, hp.n_ff), keys=ff), s(b + "ffn_up.weight", (H, hp.n_ff), keys=ff),
                    s(b + "ffn_down.weight", (hp.n_ff, H), keys=ff)]
        E, I = hp.n_expert, hp.n_ff_exp  # noqa: E741 - the shape legend
        ek = ("embedding_length", "expert_feed_forward_length", "expert_count")
        out: list[TensorSpec | OneOf] = [
            s(b + "ffn_gate_inp.weight", (H, E), MATRIX_TYPES, ("embedding_length", "expert_count"), role="router"),
            s(b + "exp_probs_b.bias", (E,), VECTOR_TYPES, ("expert_count",), required=False, role="router_bias"),
            OneOf(((s(b + "ffn_gate_exps.weight", (H, I, E), MATRIX_TYPES, ek, role="expert"),
                    s(b + "ffn_up_exps.weight", (H, I, E), MATRIX_TYPES, ek, role="expert")),
                   (s(b + "ffn_gate_up_exps.weight", (H, 2 * I, E), MATRIX_TYPES, ek, role="expert"),)),
                  f"layer {i}'s gate/up experts"),
            s(b + "ffn_down_exps.weight", (I, H, E), MATRIX_TYPES, ek, role="expert"),
        ]
        if hp.n_expert_shared:
            S = I * hp.n_expert_shared
            sk = ("embedding_length", "expert_feed_forward_length", "expert_shared_count")
            out += [s(b + "ffn_gate_shexp.weight", (H, S), keys=sk), s(b + "ffn_up_shexp.weight", (H, S), keys=sk),
                    s(b + "ffn_down_shexp.weight", (S, H), keys=sk)]
        return out

    # -- runtime declarations --------------------------------------------------------------

    def kv_layers(self) -> list[LayerKV]:
        hp = self.hp
        return [LayerKV(1, hp.latent_dim, hp.kv_lora_rank, latent=True)] * hp.n_layer

    def rope(self) -> RopeSpec:
        hp, y = self.hp, self.hp.yarn
        return RopeSpec(dim=hp.qk_rope, base=hp.rope_base, neox=False, freq_scale=y.freq_scale,
                        ext_factor=y.ext_factor, attn_factor=y.attn_factor, n_ctx_orig=y.n_ctx_orig)

    def routing(self, k: int = 0) -> Routing | None:
        hp = self.hp
        if hp.n_dense_lead >= hp.n_layer:
            return None
        grouped = hp.n_group > 1
        if grouped and k > hp.n_group_used * (hp.n_expert // hp.n_group):
            from moe_service.errors import ConfigError

            raise ConfigError(f"engine.experts_per_token = {k}: this model routes among the experts of its "
                              f"{hp.n_group_used} best groups of {hp.n_expert // hp.n_group} "
                              f"(at most {hp.n_group_used * (hp.n_expert // hp.n_group)} per token)")
        return Routing(k=k or hp.n_expert_used, gating=hp.gating, norm=hp.weights_norm, scale=hp.weights_scale,
                       n_group=hp.n_group if grouped else 1, n_group_used=hp.n_group_used if grouped else 1)

    @property
    def kq_scale(self) -> float:
        return self.hp.yarn.kq_scale(self.hp.qk_nope + self.hp.qk_rope)

    # -- loading what the roles do not cover -------------------------------------------------

    def prepare_layer(self, be, lw) -> None:
        """The per-head MLA matrices: ``lw.heads["k_b"]`` (W_kb[h] [Rkv, Dn]) and
        ``lw.heads["v_b"]`` (W_vb[h] [Dv, Rkv]); from attn_k_b / attn_v_b in place, or from the
        legacy attn_kv_b (V rows in place, K rows dequantized and transposed)."""
        hp, b = self.hp, f"blk.{lw.index}."
        NH, Dn, Dv, Rkv = hp.n_head, hp.qk_nope, hp.v_head, hp.kv_lora_rank
        lw.heads = {}
        if hp.split_mla:
            lw.heads["k_b"] = be.head_mat(b + "attn_k_b.weight", NH, Rkv, Dn)
            lw.heads["v_b"] = be.head_mat(b + "attn_v_b.weight", NH, Dv, Rkv)
        else:
            name = b + "attn_kv_b.weight"
            w = dequantize_tensor(be.m.weights, name).reshape(NH, Dn + Dv, Rkv)
            lw.heads["k_b"] = be.head_mat_float(np.ascontiguousarray(w[:, :Dn].transpose(0, 2, 1)))  # [NH, Rkv, Dn]
            lw.heads["v_b"] = be.head_mat(name, NH, Dv, Rkv, row0=Dn, head_rows=Dn + Dv)

    # -- the block -------------------------------------------------------------------------

    def block(self, be, lw, x, st):
        eps = self.hp.rms_eps
        x = x + self.attention(be, lw, be.rmsnorm(x, lw.vecs["attn_norm"], eps), st)
        return x + self.ffn(be, lw, be.rmsnorm(x, lw.vecs["ffn_norm"], eps), st)

    def attention(self, be, lw, h, st):
        """MLA over the latent cache, absorbed (module docstring): h [T, H] -> [T, H]."""
        hp = self.hp
        NH, Dn, Dr, Rkv = hp.n_head, hp.qk_nope, hp.qk_rope, hp.kv_lora_rank
        if hp.q_lora_rank:
            qa, kv = be.linear(lw, ("attn_q_a", "attn_kv_a_mqa"), h)
            (q,) = be.linear(lw, ("attn_q_b",), be.rmsnorm(qa, lw.vecs["attn_q_a_norm"], hp.rms_eps))
        else:
            q, kv = be.linear(lw, ("attn_q", "attn_kv_a_mqa"), h)
        q = be.heads(q, NH, Dn + Dr)  # [T, NH, Dn + Dr]
        q_pe = be.rope(q[:, :, Dn:], st.positions, st.rope)  # [T, NH, Dr]
        k_pe = be.rope(be.heads(kv[:, Rkv:], 1, Dr), st.positions, st.rope)  # [T, 1, Dr]
        c = be.rmsnorm(kv[:, :Rkv], lw.vecs["attn_kv_a_norm"], hp.rms_eps)  # [T, Rkv]
        q_abs = be.head_linear(lw.heads["k_b"], q[:, :, :Dn])  # [T, NH, Rkv]
        lat = be.attention(lw.index, be.concat([q_abs, q_pe], 2), be.concat([be.heads(c, 1, Rkv), k_pe], 2), None,
                           st.spans, self.kq_scale, value_dim=Rkv)  # [T, NH, Rkv]
        o = be.head_linear(lw.heads["v_b"], lat)  # [T, NH, Dv]
        (y,) = be.linear(lw, ("attn_output",), be.flat(o))
        return y

    def ffn(self, be, lw, h, st):
        """Dense SwiGLU (leading layers), or routed experts plus the shared experts."""
        if lw.experts is None:
            return be.glu_ffn(lw, h, ("ffn_gate", "ffn_up", "ffn_down"))
        ids, w = st.route(lw, h)
        y = be.moe(lw, h, ids, w)
        if "ffn_gate_shexp" in lw.mats:
            y = y + be.glu_ffn(lw, h, ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))
        return y
