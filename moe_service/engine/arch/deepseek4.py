"""``deepseek4``: DeepSeek V4 (V4-Flash), as llama.cpp 0.3.36 runs it (src/models/deepseek4.cpp,
src/llama-kv-cache-dsv4.cpp, src/llama-graph.cpp build_moe_ffn / build_ffn).

This module reads and checks the hyperparameters, declares every tensor with its shape and
types (so ``moe-service check`` / preflight / the start of ``serve`` check a V4 file before a
byte is loaded), describes the KV and routing needs, and runs the layer (:meth:`Deepseek4.block`)
on both backends.

Memory per sequence (planned by ``moe-service plan`` / preflight and allocated by the KV cache
from the same declaration, :meth:`Deepseek4.seq_state`): per trunk layer a ring of the last
``sliding_window`` raw K = V rows (D float16 values each: the window bounds the raw rows, as
llama.cpp's SWA cache; nothing per token of context), plus per compressed layer n_ctx // ratio
compressed rows of D float16 values and a ring of the last 2 ratio tokens' compressor inputs
(2 x c D float32), plus per ratio-4 layer n_ctx // 4 indexer keys of Di float16 values and its
ring (2 x 8 x 2 Di float32). The seam's row cache holds nothing for deepseek4 (kv_layers()
declares 0 KV heads).

Shapes: T tokens, H hidden (n_embd), NH heads, D head dim (key_length = value_length, 512 on
V4-Flash), R rotated dims (rope.dimension_count, 64: the LAST R dims of each head, ggml
rope_set_offset(D - R); NORM rope = adjacent pairs), Rq q_lora_rank, G output groups, Ro
output lora rank, C hyper-connection streams (4), M = (2 + C) C mixes, E experts, K experts
per token, I expert width, S shared experts, Ni indexer heads of Di dims, V vocab.

The layer (llama.cpp graph; x is [T, C, H]: C residual streams, the embedding repeated C times)::

    hc_pre(x, fn, scale, base):  (build_hc_pre)
        mixes = fn @ rmsnorm(x.reshape(T, C*H))                 [T, M]   (rmsnorm without weight)
        pre  = sigmoid(mixes[:C] * scale[0] + base[:C]) + eps   [T, C]
        post = 2 sigmoid(mixes[C:2C] * scale[1] + base[C:2C])   [T, C]
        comb = sinkhorn(mixes[2C:] * scale[2] + base[2C:])      [T, C(dst), C(src)]
               (softmax over dst, + eps, column-normalise (sum + eps), then
                sinkhorn_iterations - 1 times: row-normalise, column-normalise)
        h = sum_c pre[c] x[c]                                   [T, H]
    hc_post(y, x, post, comb): x'[dst] = post[dst] y + sum_src comb[dst, src] x[src]

    h = rmsnorm(hc_pre(x, hc_attn_*), attn_norm)
    qr = rmsnorm(W_q_a h, attn_q_a_norm)                        [T, Rq]
    q = rmsnorm_per_head(W_q_b qr) (no weight); rope on the last R dims     [T, NH, D]
    kv = rmsnorm(W_kv h, attn_kv_a_norm); rope on the last R dims           [T, 1, D]
    attention over [raw window (sliding_window, the token itself included) | compressed rows],
        one shared K = V head, scale 1/sqrt(D), attn_sinks per head
    o = inverse rope (rope_ext_back) of the output's last R dims            [T, NH, D]
    o = W_o_b (per group g: W_o_a[g] o[g heads])                            [T, H]
    x = hc_post(o, x, ...)
    h = rmsnorm(hc_pre(x, hc_ffn_*), ffn_norm)
    routed: probs = sqrt(softplus(W_gate_inp h)) (expert_gating_func 4), selection by
        probs + exp_probs_b (layers >= hash_layer_count) or by token id through
        ffn_gate_tid2eid[token] (the first hash_layer_count layers, no bias), weights = probs of
        the selected, normalised (sum clamped at 2^-14) when expert_weights_norm, times
        expert_weights_scale; experts swiglu_clamp(g, u, limit) = silu(min(g, L)) * clamp(u, -L, L)
        with L = swiglu_clamp_exp (off when <= 1e-6)
    shared: same clamp with swiglu_clamp_shexp (default: swiglu_clamp_exp)
    x = hc_post(routed + shared, x, ...)
    end: h = hc_head(x) (hc_pre with output_hc_fn/scale/base, pre only), rmsnorm(output_norm),
        output

Compressed KV (attention.compress_ratios[layer], llama-kv-cache-dsv4.cpp): ratio 0 layers
attend the raw window only. A ratio-r layer turns every complete block of r tokens into one
row: per dim, softmax over the block's tokens of (W_gate h + ape[pos % r]) weighting W_kv h,
then rmsnorm(attn_compressor_norm), rope at the block's first position with
compress_rope_freq_base (and the file's YaRN). Ratio 4 overlaps: W_kv / W_gate give 2D
values, the first D for the previous block's tokens and the last D for the current block's,
the softmax runs over both blocks (8 tokens; block 0 has no previous block: score -inf).
A token at position p sees (p + 1) // r compressed rows (a block is visible from its last
token on). Ratio 128 layers attend every visible compressed row; ratio 4 layers attend only
the top_k (attention.indexer.top_k) rows the lightning indexer picks: the indexer keeps its
own ratio-4 compressed keys of Di dims (indexer_compressor_*), its query is
W_indexer_q_b qr [T, Ni, Di] (rope on the last R dims, compress base), score(row) =
sum_heads relu(q . k) * (W_indexer_proj h) / sqrt(Di Ni); llama.cpp also multiplies q, k and
the output by a Hadamard rotation when its KV type is quantized (k_rot).
RoPE for layers with ratio 0 uses rope.freq_base without YaRN; compressed layers use
compress_rope_freq_base with the YaRN scaling for the whole layer (q, kv and the inverse).

MTP: ``nextn_predict_layers`` blocks at blk.<n_layer>.. carry the full layer plus
``nextn.eh_proj`` {2H, H}, ``nextn.enorm`` / ``nextn.hnorm`` {H} (and optional
``nextn.embed_tokens`` / ``shared_head_head`` {H, V}, ``shared_head_norm`` {H}); they are
declared and checked here (when ``blk.<n_layer>.nextn.eh_proj`` is present, as llama.cpp
probes it) and never run (speculative decoding comes later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as _GT

from moe_service.engine.arch.base import (
    ACT_SWIGLU_CLAMP,
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
from moe_service.engine.arch.deepseek2 import Yarn, yarn_from_metadata
from moe_service.engine.kv import SeqState
from moe_service.engine.mats import QMat
from moe_service.log import get_logger

log = get_logger(__name__)

I32_ONLY: frozenset[int] = frozenset({int(_GT.I32)})
"""ffn_gate_tid2eid: token id -> K expert ids, int32."""

GATING_SQRT_SOFTPLUS_GGUF = 4
"""``expert_gating_func`` value of sqrt(softplus(logit)) (llama-hparams.h); the only one
llama.cpp's deepseek4 loader accepts."""

RATIOS = (0, 4, 128)
"""The compression ratios llama.cpp's deepseek4 loader accepts."""


@dataclass(frozen=True)
class Deepseek4HParams:
    """deepseek4 hyperparameters (GGUF key under ``deepseek4.`` in parentheses).

    n_layer: trunk layers (block_count minus nextn_predict_layers, the latter counted only
    when blk.<trunk>.nextn.eh_proj exists, as llama.cpp); n_layer_all (block_count); n_embd
    (embedding_length); n_head (attention.head_count); head_dim (attention.key_length, must
    equal attention.value_length); n_rot (rope.dimension_count); q_lora_rank
    (attention.q_lora_rank); window (attention.sliding_window, tokens, the current one
    included); o_groups (attention.output_group_count); o_lora_rank
    (attention.output_lora_rank); compress_ratios (attention.compress_ratios, one per
    layer incl. MTP blocks: 0, 4 or 128); compress_rope_base
    (attention.compress_rope_freq_base); indexer_heads / indexer_dim / indexer_top_k
    (attention.indexer.head_count / key_length / top_k); hc (hyper_connection.count);
    hc_iters (hyper_connection.sinkhorn_iterations); hc_eps (hyper_connection.epsilon);
    hash_layers (hash_layer_count: the first layers route by token id); n_expert /
    n_expert_used (expert_count / expert_used_count); n_ff_exp (expert_feed_forward_length);
    n_expert_shared (expert_shared_count); weights_norm (expert_weights_norm); weights_scale
    (expert_weights_scale); clamp_exp / clamp_shexp (swiglu_clamp_exp / swiglu_clamp_shexp,
    per layer; shexp defaults to exp); rope_base (rope.freq_base); rms_eps
    (attention.layer_norm_rms_epsilon); n_ctx_train (context_length); yarn
    (rope.scaling.*, applied on compressed layers).
    """

    n_layer: int
    n_layer_all: int
    n_embd: int
    n_head: int
    n_vocab: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    window: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple[int, ...]
    compress_rope_base: float
    indexer_heads: int
    indexer_dim: int
    indexer_top_k: int
    hc: int
    hc_iters: int
    hc_eps: float
    hash_layers: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    weights_norm: bool
    weights_scale: float
    clamp_exp: tuple[float, ...]
    clamp_shexp: tuple[float, ...]
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    yarn: Yarn

    @property
    def n_mtp(self) -> int:
        """MTP (nextn) blocks after the trunk."""
        return self.n_layer_all - self.n_layer


def _per_layer(r: HParamReader, key: str, n: int, *, default=None, kind=float, lo=0.0, hi=1e9) -> tuple:
    """llama.cpp's get_key_or_arr: a scalar for every layer, or an array of at least ``n``
    values (HParamError naming the key otherwise)."""
    full = r.full(key)
    r.keys[key] = full
    v = r.md.get(full)
    if v is None:
        if default is None:
            raise HParamError(f"{r.path}: metadata key {full} is missing", full)
        return (default,) * n
    vals = v if isinstance(v, list) else [v] * n
    if len(vals) < n:
        raise HParamError(f"{r.path}: metadata key {full} has {len(vals)} values, block_count needs {n}", full)
    out = []
    for x in vals[:n]:
        if isinstance(x, bool) or not isinstance(x, int | float) or not (lo <= x <= hi):
            raise HParamError(f"{r.path}: metadata key {full} has value {x!r}, expected {kind.__name__} in "
                              f"[{lo}, {hi}]", full)
        out.append(kind(x))
    return tuple(out)


class Deepseek4(Architecture):
    """deepseek4 (module docstring). Declarations and checks; no forward pass yet."""

    kv_types = ("f16",)  # the window rows are float16 state arrays (seq_state); no q8_0 form

    names = ("deepseek4",)
    _kvstate: Any  # the compressed-KV state, made by _state at first use
    # a prefill step's attention output in group-major rows ([G, T, NH*D/G] float32, flat), kept
    # across steps and layers (a fresh 16 MB array per step page-faults); grown by _o_groups_scratch
    _o_groups_buf: np.ndarray | None = None

    def read_hparams(self, r: HParamReader) -> Deepseek4HParams:
        n_all = r.int("block_count", lo=1, hi=512)  # LLAMA_MAX_LAYERS
        n_nextn = r.int("nextn_predict_layers", 0, hi=n_all - 1)
        # llama.cpp: MTP blocks count only when the first one's eh_proj is in the file
        if n_nextn and f"blk.{n_all - n_nextn}.nextn.eh_proj.weight" not in self.tensor_ne and self.tensor_ne:
            n_nextn = 0
        n_embd = r.int("embedding_length", lo=1, hi=1 << 20)
        n_head = r.int("attention.head_count", lo=1, hi=1 << 12)
        head_dim = r.int("attention.key_length", n_embd // n_head, lo=1, hi=1 << 14)
        ratios_full = r.full("attention.compress_ratios")
        r.keys["attention.compress_ratios"] = ratios_full
        ratios = r.md.get(ratios_full)
        if not isinstance(ratios, list):
            raise HParamError(f"{r.path}: metadata key {ratios_full} is "
                              f"{'missing' if ratios is None else repr(ratios)}, expected an array with one "
                              "compression ratio per layer", ratios_full)
        if len(ratios) < n_all:
            raise HParamError(f"{r.path}: metadata key {ratios_full} has {len(ratios)} values but block_count is "
                              f"{n_all} (llama.cpp: compress_ratios is shorter than block_count)", ratios_full)
        for i, x in enumerate(ratios[:n_all]):
            if isinstance(x, bool) or x not in RATIOS:
                raise HParamError(f"{r.path}: metadata key {ratios_full}[{i}] is {x!r}, expected one of "
                                  f"{', '.join(map(str, RATIOS))}", ratios_full)
        n_vocab = self.read_n_vocab(r)
        n_ctx_train = r.int("context_length", lo=1, hi=1 << 30)
        clamp_exp = _per_layer(r, "swiglu_clamp_exp", n_all, lo=0.0, hi=1e6)
        clamp_sh = _per_layer(r, "swiglu_clamp_shexp", n_all, default=-1.0, lo=-1.0, hi=1e6)
        if clamp_sh[0] == -1.0 and r.md.get(r.full("swiglu_clamp_shexp")) is None:
            clamp_sh = clamp_exp
        return Deepseek4HParams(
            n_layer=n_all - n_nextn, n_layer_all=n_all, n_embd=n_embd, n_head=n_head, n_vocab=n_vocab,
            head_dim=head_dim, n_rot=r.int("rope.dimension_count", head_dim, lo=2, hi=head_dim),
            q_lora_rank=r.int("attention.q_lora_rank", lo=1, hi=1 << 20),
            window=r.int("attention.sliding_window", lo=1, hi=1 << 24),
            o_groups=r.int("attention.output_group_count", lo=1, hi=n_head),
            o_lora_rank=r.int("attention.output_lora_rank", lo=1, hi=1 << 20),
            compress_ratios=tuple(int(x) for x in ratios[:n_all]),
            compress_rope_base=r.float("attention.compress_rope_freq_base", lo=0.0, lo_open=True),
            indexer_heads=r.int("attention.indexer.head_count", lo=1, hi=1 << 12),
            indexer_dim=r.int("attention.indexer.key_length", lo=2, hi=1 << 14),
            indexer_top_k=r.int("attention.indexer.top_k", lo=1, hi=1 << 24),
            hc=r.int("hyper_connection.count", lo=1, hi=64),
            hc_iters=r.int("hyper_connection.sinkhorn_iterations", lo=1, hi=1000),
            hc_eps=r.float("hyper_connection.epsilon", lo=0.0, hi=1.0),
            hash_layers=r.int("hash_layer_count", lo=0, hi=n_all),
            n_expert=r.int("expert_count", lo=1, hi=1 << 16),
            n_expert_used=r.int("expert_used_count", lo=1, hi=1 << 16),
            n_ff_exp=r.int("expert_feed_forward_length", lo=1, hi=1 << 24),
            n_expert_shared=r.int("expert_shared_count", lo=0, hi=1 << 8),
            weights_norm=r.bool("expert_weights_norm"),
            weights_scale=r.float("expert_weights_scale", lo=0.0, hi=1e6),
            clamp_exp=clamp_exp, clamp_shexp=clamp_sh,
            rope_base=r.float("rope.freq_base", 10000.0, lo=0.0, lo_open=True),
            rms_eps=r.float("attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0),
            n_ctx_train=n_ctx_train, yarn=yarn_from_metadata(r, n_ctx_train),
        )

    def check_hparams(self) -> list[tuple[str, str]]:
        hp, k, md = self.hp, self.key, self.r.md
        out: list[tuple[str, str]] = []
        gating = md.get(k("expert_gating_func"))
        if gating != GATING_SQRT_SOFTPLUS_GGUF:
            out.append((k("expert_gating_func"), f"{k('expert_gating_func')} is {gating!r}; deepseek4 routes by "
                        f"sqrt(softplus) ({GATING_SQRT_SOFTPLUS_GGUF}), as llama.cpp requires"))
        dv = md.get(k("attention.value_length"), hp.head_dim)
        if dv != hp.head_dim:
            out.append((k("attention.value_length"), f"{k('attention.value_length')} = {dv} differs from "
                        f"{k('attention.key_length')} = {hp.head_dim} (deepseek4's K and V are one head)"))
        if hp.n_rot % 2:
            out.append((k("rope.dimension_count"), f"{k('rope.dimension_count')} = {hp.n_rot} must be even"))
        if hp.indexer_dim < hp.n_rot or hp.indexer_dim % 2:
            out.append((k("attention.indexer.key_length"), f"{k('attention.indexer.key_length')} = "
                        f"{hp.indexer_dim} must be even and at least {k('rope.dimension_count')} = {hp.n_rot}"))
        if hp.n_head % hp.o_groups:
            out.append((k("attention.output_group_count"), f"{k('attention.output_group_count')} = {hp.o_groups} "
                        f"does not divide {k('attention.head_count')} = {hp.n_head}"))
        if hp.hc != 4:
            out.append((k("hyper_connection.count"), f"{k('hyper_connection.count')} = {hp.hc}; llama.cpp's "
                        "deepseek4 graph requires 4 streams"))
        if hp.n_expert_used > hp.n_expert:
            out.append((k("expert_used_count"), f"{k('expert_used_count')} = {hp.n_expert_used} exceeds "
                        f"{k('expert_count')} = {hp.n_expert}"))
        if hp.hash_layers > hp.n_layer:
            out.append((k("hash_layer_count"), f"{k('hash_layer_count')} = {hp.hash_layers} exceeds the "
                        f"{hp.n_layer} trunk layers"))
        n_kv = md.get(k("attention.head_count_kv"))
        if n_kv is not None and n_kv != 1:
            out.append((k("attention.head_count_kv"), f"{k('attention.head_count_kv')} = {n_kv}, expected 1 "
                        "(deepseek4 attends one shared K = V head)"))
        lims = set(hp.clamp_exp[:hp.n_layer])
        if len(lims) > 1:
            out.append((k("swiglu_clamp_exp"), f"{k('swiglu_clamp_exp')} differs between layers ({sorted(lims)}); "
                        "one routed-expert clamp for every layer is supported"))
        for key in ("expert_group_count",):
            g = md.get(k(key))
            if g not in (None, 0, 1):
                out.append((k(key), f"{k(key)} = {g}: deepseek4 has no expert groups"))
        return out

    # -- tensors ----------------------------------------------------------------------------

    def tensors(self) -> list[TensorSpec]:
        hp, s = self.hp, self.spec
        H, V, NH, D = hp.n_embd, hp.n_vocab, hp.n_head, hp.head_dim
        C = hp.hc
        M = (2 + C) * C
        E, K, I, S = hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_exp * hp.n_expert_shared  # noqa: E741 - shape legend
        Rq, G, Ro = hp.q_lora_rank, hp.o_groups, hp.o_lora_rank
        emb, hc_k = ("embedding_length",), ("embedding_length", "hyper_connection.count")
        head = ("attention.head_count", "attention.key_length")
        vec, mat_or_vec = VECTOR_TYPES, MATRIX_TYPES | VECTOR_TYPES
        out: list[TensorSpec] = [
            s("token_embd.weight", (H, V), keys=emb + ("vocab_size",), role="model"),
            s("output_norm.weight", (H,), vec, emb, role="model"),
            s("output.weight", (H, V), keys=emb + ("vocab_size",), role="model"),
            s("output_hc_fn.weight", (C * H, C), mat_or_vec, hc_k, role="custom"),
            s("output_hc_base.weight", (C,), vec, ("hyper_connection.count",), role="custom"),
            s("output_hc_scale.weight", (1,), vec, role="custom"),
        ]
        for i in range(hp.n_layer_all):
            b = f"blk.{i}."
            out += [
                s(b + "attn_norm.weight", (H,), vec, emb, role="vec"),
                s(b + "attn_sinks.weight", (NH,), vec, ("attention.head_count",), role="vec"),
                s(b + "attn_q_a.weight", (H, Rq), keys=emb + ("attention.q_lora_rank",)),
                s(b + "attn_q_a_norm.weight", (Rq,), vec, ("attention.q_lora_rank",), role="vec"),
                s(b + "attn_q_b.weight", (Rq, NH * D), keys=("attention.q_lora_rank",) + head),
                s(b + "attn_kv.weight", (H, D), keys=emb + ("attention.key_length",)),
                s(b + "attn_kv_a_norm.weight", (D,), vec, ("attention.key_length",), role="vec"),
                # the file stores attn_output_a as {NH*D/G, Ro*G}; llama.cpp reads it as
                # {NH*D/G, Ro, G} (TENSOR_ALLOW_RESHAPE): the same bytes, G matrices of Ro rows
                s(b + "attn_output_a.weight", (NH * D // G, Ro * G),
                  keys=head + ("attention.output_group_count", "attention.output_lora_rank"), role="custom"),
                s(b + "attn_output_b.weight", (G * Ro, H),
                  keys=("attention.output_group_count", "attention.output_lora_rank") + emb),
                s(b + "hc_attn_fn.weight", (C * H, M), mat_or_vec, hc_k, role="custom"),
                s(b + "hc_attn_base.weight", (M,), vec, ("hyper_connection.count",), role="vec"),
                s(b + "hc_attn_scale.weight", (3,), vec, role="vec"),
                s(b + "hc_ffn_fn.weight", (C * H, M), mat_or_vec, hc_k, role="custom"),
                s(b + "hc_ffn_base.weight", (M,), vec, ("hyper_connection.count",), role="vec"),
                s(b + "hc_ffn_scale.weight", (3,), vec, role="vec"),
            ]
            ratio = hp.compress_ratios[i]
            if ratio:
                coff = 2 if ratio == 4 else 1
                rk = ("attention.compress_ratios", "attention.key_length")
                out += [
                    s(b + "attn_compressor_kv.weight", (H, coff * D), keys=emb + rk),
                    s(b + "attn_compressor_gate.weight", (H, coff * D), keys=emb + rk),
                    s(b + "attn_compressor_ape.weight", (coff * D, ratio), vec, rk, role="custom"),
                    s(b + "attn_compressor_norm.weight", (D,), vec, ("attention.key_length",), role="vec"),
                ]
                if ratio == 4:
                    Ni, Di = hp.indexer_heads, hp.indexer_dim
                    ik = ("attention.indexer.key_length",)
                    out += [
                        s(b + "indexer.proj.weight", (H, Ni), keys=emb + ("attention.indexer.head_count",)),
                        s(b + "indexer.attn_q_b.weight", (Rq, Ni * Di),
                          keys=("attention.q_lora_rank", "attention.indexer.head_count") + ik),
                        s(b + "indexer_compressor_kv.weight", (H, 2 * Di), keys=emb + ik),
                        s(b + "indexer_compressor_gate.weight", (H, 2 * Di), keys=emb + ik),
                        s(b + "indexer_compressor_ape.weight", (2 * Di, ratio), vec, ik, role="custom"),
                        s(b + "indexer_compressor_norm.weight", (Di,), vec, ik, role="vec"),
                    ]
            out.append(s(b + "ffn_gate_inp.weight", (H, E), keys=emb + ("expert_count",), role="router"))
            if i < hp.hash_layers:
                out.append(s(b + "ffn_gate_tid2eid.weight", (K, V), I32_ONLY,
                             ("expert_used_count", "vocab_size", "hash_layer_count"), role="custom"))
            else:
                out.append(s(b + "exp_probs_b.bias", (E,), vec, ("expert_count",), role="router_bias"))
            out.append(s(b + "exp_probs_b_vl.bias", (E,), vec, ("expert_count",), required=False, role="custom"))
            ek = emb + ("expert_feed_forward_length", "expert_count")
            sk = emb + ("expert_feed_forward_length", "expert_shared_count")
            out += [
                s(b + "ffn_norm.weight", (H,), vec, emb, role="vec"),
                s(b + "ffn_gate_exps.weight", (H, I, E), keys=ek, role="expert"),
                s(b + "ffn_up_exps.weight", (H, I, E), keys=ek, role="expert"),
                s(b + "ffn_down_exps.weight", (I, H, E), keys=ek, role="expert"),
                s(b + "ffn_gate_shexp.weight", (H, S), keys=sk),
                s(b + "ffn_up_shexp.weight", (H, S), keys=sk),
                s(b + "ffn_down_shexp.weight", (S, H), keys=sk),
            ]
            if i >= hp.n_layer:  # MTP block: loaded and validated, never run
                out += [
                    s(b + "nextn.eh_proj.weight", (2 * H, H), keys=emb, role="custom"),
                    s(b + "nextn.enorm.weight", (H,), vec, emb, role="custom"),
                    s(b + "nextn.hnorm.weight", (H,), vec, emb, role="custom"),
                    s(b + "nextn.embed_tokens.weight", (H, V), keys=emb, required=False, role="custom"),
                    s(b + "nextn.shared_head_head.weight", (H, V), keys=emb, required=False, role="custom"),
                    s(b + "nextn.shared_head_norm.weight", (H,), vec, emb, required=False, role="custom"),
                ]
        return out

    # -- what the runner needs ------------------------------------------------------------------

    def kv_layers(self) -> list[LayerKV]:
        """Per trunk layer: no rows in the seam's per-token cache (0 KV heads): the shared
        K = V rows live in a ring of ``sliding_window`` rows per sequence and the compressed
        rows in their own arrays, both declared by :meth:`seq_state`."""
        hp = self.hp
        return [LayerKV(0, hp.head_dim, hp.head_dim, latent=True)] * hp.n_layer

    def seq_state(self, n_ctx: int) -> list:
        """Per sequence (kv.SeqState; read back by :meth:`_state`): every trunk layer's
        ``raw`` [window, D] float16 ring of the last ``sliding_window`` K = V rows (position p
        at row p % window); per compressed layer ``comp`` [n_ctx // ratio, D] float16 compressed rows, ``ring_kv`` / ``ring_sc``
        [2 ratio, c D] float32 (the last 2 ratio tokens' compressor kv and score inputs, c = 2 on
        ratio-4 layers); ratio-4 layers add the indexer's ``icomp`` [n_ctx // 4, Di] float16
        and ``iring_kv`` / ``iring_sc`` [8, 2 Di] float32.

        Each declares its snapshot kind for the prefix cache (kv.SeqState, engine/prefix.py):
        the rings by the positions later steps read, the compressed rows as append-only; a
        change to what :meth:`_attention` / :meth:`_compress` read must change these too.
        :meth:`_attention` reports every position's ring rows (KVCache.note_ring)."""
        hp = self.hp
        # snapshot kinds (kv.SeqState): the raw ring reads the last window - 1 positions
        # (_attention: lo = n0 - W + 1); a compressor ring the tokens of the unfinished block,
        # and on ratio 4 also the previous block (the overlap; _compress: prev / cur); the
        # compressed rows are written once, when their block completes
        out = [SeqState(il, "raw", (hp.window, hp.head_dim), "float16", "ring", 1, hp.window)
               for il in range(hp.n_layer)]
        for il, r in enumerate(hp.compress_ratios[:hp.n_layer]):
            if not r:
                continue
            c, g = (2, 2) if r == 4 else (1, 1)
            out += [SeqState(il, "ring_kv", (2 * r, c * hp.head_dim), "float32", "ring", r, g),
                    SeqState(il, "ring_sc", (2 * r, c * hp.head_dim), "float32", "ring", r, g),
                    SeqState(il, "comp", (n_ctx // r, hp.head_dim), "float16", "rows", r)]
            if r == 4:
                Di = hp.indexer_dim
                out += [SeqState(il, "iring_kv", (8, 2 * Di), "float32", "ring", 4, 2),
                        SeqState(il, "iring_sc", (8, 2 * Di), "float32", "ring", 4, 2),
                        SeqState(il, "icomp", (n_ctx // 4, Di), "float16", "rows", 4)]
        return out

    def compressed_kv_values_per_token(self) -> float:
        """Cache values per token of context over all trunk layers beyond the raw windows:
        sum over compressed layers of D / ratio (+ Di / 4 for the indexer on ratio-4 layers)."""
        hp = self.hp
        total = 0.0
        for r in hp.compress_ratios[:hp.n_layer]:
            if r:
                total += hp.head_dim / r + (hp.indexer_dim / r if r == 4 else 0.0)
        return total

    def rope(self) -> RopeSpec:
        """RoPE of ratio-0 layers (rope.freq_base, no YaRN); compressed layers use
        :meth:`rope_compressed`. Rotated dims are the last ``n_rot`` of each head."""
        return RopeSpec(dim=self.hp.n_rot, base=self.hp.rope_base, neox=False)

    def rope_compressed(self) -> RopeSpec:
        hp, y = self.hp, self.hp.yarn
        attn = 1.0 if y.ext_factor == 0 else 1.0 / (1.0 + 0.1 * __import__("math").log(1.0 / y.freq_scale))
        return RopeSpec(dim=hp.n_rot, base=hp.compress_rope_base, neox=False, freq_scale=y.freq_scale,
                        ext_factor=y.ext_factor, attn_factor=attn, n_ctx_orig=y.n_ctx_orig)

    def routing(self, k: int = 0) -> Routing:
        hp = self.hp
        # GATING: sqrt(softplus) has no Routing constant yet (the forward pass is not built)
        return Routing(k=k or hp.n_expert_used, norm=hp.weights_norm, scale=hp.weights_scale or 1.0)

    def moe_act(self) -> MoEAct:
        """The routed experts' ggml_swiglu_clamp with swiglu_clamp_exp (plain SiLU when <= 1e-6)."""
        lim = self.hp.clamp_exp[0]
        return MoEAct(ACT_SWIGLU_CLAMP, limit=lim) if lim > 1e-6 else MoEAct()

    # -- the forward pass ---------------------------------------------------------------------
    # The hidden state between blocks is the C hyper-connection streams flattened, [T, C*H]
    # (block 0 receives the embedding [T, H] and repeats it C times); final_norm merges the
    # streams (hc_head) before the output norm. The parts new to this architecture
    # (hyper-connections, compression, the indexer, attention over window + compressed rows
    # with sinks) run as numpy (moe_service.engine.ds4_ops) on either backend; matmuls,
    # norms, the shared expert and the routed experts (the fused MoE kernel, or the GPU
    # offload) go through the backend's primitives.

    def prepare_layer(self, be, lw) -> None:
        hp = self.hp
        i = lw.index
        pre = f"blk.{i}."
        m = be.m
        # the mixing matrices as float64 (ds4_ops._mix: sums that do not depend on the step's rows)
        d: dict = {"hc_attn_fn": _np(be.matrix(pre + "hc_attn_fn.weight")).astype(np.float64),
                   "hc_ffn_fn": _np(be.matrix(pre + "hc_ffn_fn.weight")).astype(np.float64)}
        for short in ("attn_compressor_ape", "indexer_compressor_ape"):
            if pre + short + ".weight" in m.catalog.tensors:
                d[short] = _np(be.matrix(pre + short + ".weight"))  # [ratio, c*D]
        if i < hp.hash_layers:
            raw = m.weights.tensor(pre + "ffn_gate_tid2eid.weight")
            d["tid2eid"] = np.frombuffer(raw, dtype="<i4").reshape(hp.n_vocab, hp.n_expert_used).copy()
        for k, v in lw.vecs.items():
            d[k] = _np(v)
        lw.ds4 = d
        # attn_output_a {NH*D/G, Ro*G}: group g is rows g*Ro .. (g+1)*Ro, read in place
        name = pre + "attn_output_a.weight"
        t = m.catalog.tensors[name]
        row_bytes = m.catalog.tensors[name].nbytes // t.shape[0]
        off = m.weights.tensor_offset(name)
        Ro, G = hp.o_lora_rank, hp.o_groups
        dense = _np(be.matrix(name)) if m.dense_mode == "torch" else None
        for g in range(hp.o_groups):
            key = f"attn_output_a.{g}"
            lw.mats[key] = QMat(name, off + g * Ro * row_bytes, t.ggml_type, Ro, t.shape[1])
            if dense is not None:
                import torch

                lw.dense[key] = torch.from_numpy(dense[g * Ro:(g + 1) * Ro].copy()).to(m.device, m.dense_dtype)
        # CPU: attn_output_a's G groups as G "heads" of Ro rows read in place (mla.head_matmul:
        # each group's rows computed as by a 2-D matmul of that group, bit for bit)
        d["o_a_heads"] = (be.head_mat(name, G, Ro, t.shape[1], 0, Ro) if type(be).__name__ == "CpuPath"
                          else None)
        if i == 0 and hp.n_mtp:
            log.info("mtp_not_used", arch=self.name, mtp_blocks=hp.n_mtp,
                     first_block=hp.n_layer, what="multi-token-prediction blocks loaded and validated, not run "
                     "(speculative decoding is not implemented)")

    def _tables(self, n_ctx: int):
        t = getattr(self, "_rope_cache", None)
        if t is None or t[0] < n_ctx:
            from moe_service.engine.arch.rope import rope_tables

            t = self._rope_cache = (n_ctx, rope_tables(self.rope(), n_ctx), rope_tables(self.rope_compressed(), n_ctx))
        return t[1], t[2]

    def _state(self, be, il: int) -> dict:
        """Layer ``il``'s compressed-KV state for every sequence slot: the KV cache's arrays
        declared by :meth:`seq_state` ({name: [S, ...]})."""
        st: tuple[Any, dict[int, dict[str, Any]]] | None = getattr(self, "_kvstate", None)
        if st is None or st[0] is not be.m.kv:
            st = self._kvstate = (be.m.kv, {})
        if il not in st[1]:
            arrays = be.m.kv.state
            st[1][il] = {name: a for (layer, name), a in arrays.items() if layer == il}
            if not st[1][il]:
                raise RuntimeError(f"deepseek4 layer {il}: the KV cache has no compressed-KV state (seq_state)")
        return st[1][il]

    def block(self, be, lw, x, st):
        from moe_service.engine import ds4_ops as ops

        if all(e - a == 1 for _, a, e, _ in st.spans):  # decode: BLAS only in the indexer, limited there
            return self._block(be, lw, x, st)
        with ops.blas_one_thread():  # numpy's small float64 matmuls beside the worker pool
            return self._block(be, lw, x, st)

    def _block(self, be, lw, x, st):
        from moe_service.engine import ds4_compiled as dc

        hp, d = self.hp, lw.ds4
        C, H = hp.hc, hp.n_embd
        xs = _np(x)
        T = xs.shape[0]
        xs = np.repeat(xs[:, None, :], C, axis=1) if lw.index == 0 else xs.reshape(T, C, H)
        if "hc_attn_fnT" not in d:  # the mixing matrices as the compiled hc_pre reads them
            d["hc_attn_fnT"], d["hc_ffn_fnT"] = dc.mix_table(d["hc_attn_fn"]), dc.mix_table(d["hc_ffn_fn"])
        # compiled ds4_ops.hc_pre / hc_post (ds4_compiled; the same formulas)
        # multi-token steps spread the tokens over the worker pool (the same bits); a decode
        # step spreads hc_pre's mixing-table read over it (ds4_decode.HcPreOne, the same bits)
        wp = getattr(getattr(be.m, "ops", None), "pool", None)
        pool = wp if T > 1 else None
        h, post, comb = self._hc_pre(d, "hc_attn", xs, wp)
        h = be.rmsnorm(_back(be, h), lw.vecs["attn_norm"], hp.rms_eps)
        xs = dc.hc_post(_np(self._attention(be, lw, h, st)), xs, post, comb, pool)
        h, post, comb = self._hc_pre(d, "hc_ffn", xs, wp)
        h = be.rmsnorm(_back(be, h), lw.vecs["ffn_norm"], hp.rms_eps)
        xs = dc.hc_post(_np(self._ffn(be, lw, h, st)), xs, post, comb, pool)
        return _back(be, xs.reshape(T, C * H))

    def _hc_pre(self, d: dict, name: str, xs: np.ndarray, wp: Any):
        """ds4_compiled.hc_pre of the mix ``name`` ("hc_attn", "hc_ffn") on xs [T, C, H]: one
        token on a pool of 2+ workers with a float32 table through ds4_decode.HcPreOne (its
        split table kept in the layer's dict), else on the pool for multi-token steps."""
        from moe_service.engine import ds4_compiled as dc

        hp, T = self.hp, xs.shape[0]
        fnT = d[f"{name}_fnT"]
        M = fnT.shape[1]
        shares = min(wp.n_workers, 3) if wp is not None else 1  # 8+ columns a share: the sums in registers
        while shares > 1 and M % shares:
            shares -= 1
        if T == 1 and shares > 1 and fnT.dtype == np.float32:
            one = d.get(f"{name}_one")
            if one is None or one.n_shares != shares:
                from moe_service.engine import ds4_decode

                one = d[f"{name}_one"] = ds4_decode.HcPreOne(fnT, shares, hp.rms_eps, wp.n_nodes)
            return one(xs, d[f"{name}_scale"], d[f"{name}_base"], hp.hc_eps, hp.hc_iters, wp)
        return dc.hc_pre(xs, fnT, d[f"{name}_scale"], d[f"{name}_base"], hp.rms_eps, hp.hc_eps, hp.hc_iters,
                         wp if T > 1 else None)

    def final_norm(self, be, x, w):
        from moe_service.engine import ds4_ops as ops

        hp = self.hp
        head = getattr(self, "_hc_head", None)
        if head is None:
            fn, scale, base = (_np(be.matrix(f"output_hc_{n}.weight")) for n in ("fn", "scale", "base"))
            head = self._hc_head = (fn.astype(np.float64), scale, base)
        xs = _np(x)
        fn, scale, base = head
        h = ops.hc_head(xs.reshape(xs.shape[0], hp.hc, hp.n_embd), fn, scale.reshape(-1), base.reshape(-1),
                        hp.rms_eps, hp.hc_eps)
        return be.rmsnorm(_back(be, h), w, hp.rms_eps)

    def _attention(self, be, lw, h, st):
        from moe_service.engine import ds4_compiled as dc
        from moe_service.engine import ds4_indexer
        from moe_service.engine import ds4_ops as ops

        hp, d, il = self.hp, lw.ds4, lw.index
        NH, D, T = hp.n_head, hp.head_dim, h.shape[0]
        ratio = hp.compress_ratios[il]
        plain, comp_t = self._tables(be.m.n_ctx)
        cos, sin = comp_t if ratio else plain
        pos = np.asarray(_np(st.positions), dtype=np.int64)
        # every projection of h in one pool dispatch, then every projection of qr in another
        # (a group computes each matrix's rows as alone: the same results, fewer dispatches)
        h_names = _H_PROJ[min(ratio, 5)]
        proj = dict(zip(h_names, be.linear(lw, h_names, h), strict=True))
        qr = be.rmsnorm(proj["attn_q_a"], lw.vecs["attn_q_a_norm"], hp.rms_eps)
        qr_names = ("attn_q_b", "indexer.attn_q_b") if ratio == 4 else ("attn_q_b",)
        if T > 1 and ratio == 4:  # apart: q's own [T, NH*D] buffer, no strided 16 MB copy (the same results)
            for name in qr_names:
                proj.update(zip((name,), be.linear(lw, (name,), qr), strict=True))
        else:
            proj.update(zip(qr_names, be.linear(lw, qr_names, qr), strict=True))
        pool = getattr(getattr(be.m, "ops", None), "pool", None)
        # per-head rms, rope and float16 rounding in place in one compiled pass (the bits of
        # ds4_ops.rms, ds4_ops.rope_last, then astype(float16)), pooled over the tokens of a
        # multi-token step; the attention takes q rounded to float16 values. One token (T = 1):
        # that and the output's inverse rope are done in the attention's pool job
        # (ds4_decode.attend_one, the same bits)
        q = np.ascontiguousarray(_np(proj["attn_q_b"]), dtype=np.float32).reshape(T, NH, D)  # the step's own array
        if T > 1:
            q = dc.heads_inplace(q, pos, cos, sin, hp.rms_eps, True, pool)
        kv = _np(be.rmsnorm(proj["attn_kv"], lw.vecs["attn_kv_a_norm"], hp.rms_eps))
        kv = ops.rope_last(kv[:, None, :], pos, cos, sin)[:, 0, :]
        comp_in = idx_in = None
        if ratio:
            ckv, csc = proj["attn_compressor_kv"], proj["attn_compressor_gate"]
            comp_in = (_np(ckv), _np(csc) + d["attn_compressor_ape"][pos % ratio])
            if ratio == 4:
                ikv, isc = proj["indexer_compressor_kv"], proj["indexer_compressor_gate"]
                iq, iw = proj["indexer.attn_q_b"], proj["indexer.proj"]
                idx_in = (_np(ikv), _np(isc) + d["indexer_compressor_ape"][pos % 4],
                          ops.rope_last(_np(iq).reshape(T, hp.indexer_heads, hp.indexer_dim), pos, cos, sin),
                          _np(iw) / np.float32(np.sqrt(hp.indexer_dim * hp.indexer_heads)))
        state = self._state(be, il)
        kvc = be.m.kv
        ring, W = state["raw"], hp.window
        out = np.empty((T, NH, D), np.float32)
        for s, a, e, n0 in st.spans:
            n = e - a
            if n == 1:  # a decode step: the window read in place, the indexer only when it must choose
                out[a] = self._attend_one(be, lw, state, q[a], kv[a], comp_in, idx_in, a, s, n0, ratio, cos, sin,
                                          pool, int(pos[a]) if T == 1 else -1)
                continue
            new = kv[a:e].astype(np.float16)
            p = pos[a:e]
            lo = max(0, n0 - W + 1)
            win = np.concatenate([ring[s, np.arange(lo, n0) % W], new])  # float16, positions lo..
            keep = np.arange(max(n0, n0 + n - W), n0 + n)  # the span's last W rows stay
            ring[s, keep % W] = new[keep - n0]
            kvc.note_ring(s, il, "raw", n0, new)  # every position's row: the prefix cache's block snapshots
            j = np.arange(lo, n0 + n)
            mask = (j[None, :] <= p[:, None]) & (p[:, None] - j[None, :] < hp.window)
            if ratio:
                assert comp_in is not None  # built above for every compressed layer (ratio > 0)
                comp = self._compress(state, "ring_kv", "ring_sc", "comp", s, n0, comp_in[0][a:e], comp_in[1][a:e],
                                      ratio, d["attn_compressor_norm"], cos, sin)
                kvc.note_ring(s, il, "ring_kv", n0, comp_in[0][a:e])
                kvc.note_ring(s, il, "ring_sc", n0, comp_in[1][a:e])
                nb = (n0 + n) // ratio
                visible = np.arange(nb)[None, :] < ((p + 1) // ratio)[:, None]
                if ratio == 4:
                    assert idx_in is not None  # the indexer's inputs, built above when ratio == 4
                    ik = self._compress(state, "iring_kv", "iring_sc", "icomp", s, n0, idx_in[0][a:e],
                                        idx_in[1][a:e], 4, d["indexer_compressor_norm"], cos, sin)
                    kvc.note_ring(s, il, "iring_kv", n0, idx_in[0][a:e])
                    kvc.note_ring(s, il, "iring_sc", n0, idx_in[1][a:e])
                    # a query with at most top_k visible rows keeps them all (ds4_ops.top_k_rows):
                    # the scores are needed only when some query of the span sees more. The
                    # choice of _top_k (its float64 scores in a fixed order of blocked dots,
                    # pooled over the queries: 2.5x less CPU than its BLAS dgemm on one core at
                    # 128 queries x 1024 rows, 64 heads of 128); visible is a prefix of each row
                    n_vis = visible.sum(axis=1)
                    if nb > hp.indexer_top_k and int(n_vis.max()) > hp.indexer_top_k:
                        visible = ds4_indexer.lid_top_k(idx_in[2][a:e], idx_in[3][a:e], ik, n_vis, hp.indexer_top_k, pool)
                comp_rows, comp_mask = comp, visible
            else:
                comp_rows = comp_mask = None
            # compiled: ds4_ops.attend_sinks on the window rows then the compressed rows (q rounded above)
            o_span = dc.attend_rows(q[a:e], win, comp_rows, mask, comp_mask, d["attn_sinks"], 1.0 / np.sqrt(D), pool)
            if n == T:  # the step's only span (a prefill step): its array is the output, no 16 MB copy
                out = o_span
            else:
                out[a:e] = o_span
        G = hp.o_groups
        if lw.ds4.get("o_a_heads") is not None and T > 1:
            # CPU, several tokens: the inverse rope also writes each group's [T, NH*D/G] rows
            # contiguous (ds4_compiled.inverse_rope_groups, pooled), then one matmul per group
            # (its multi-token tiles; the same results as head_linear's per-group rows: 11% less
            # CPU for attn_output_a at 128 tokens on V4-Flash shapes, where head_linear's rows
            # of one group are G rows apart)
            # the group-major rows in a scratch kept by the model (a fresh 16 MB array per step
            # page-faults); used up by the matmuls below, before any other layer's step
            ogc = dc.inverse_rope_groups(out, pos, cos, sin, G, pool, self._o_groups_scratch(out.size))
            oa = np.empty((T, G * hp.o_lora_rank), np.float32)
            Ro = hp.o_lora_rank
            for g in range(G):
                oa[:, g * Ro:(g + 1) * Ro] = be.linear(lw, (f"attn_output_a.{g}",), ogc[g])[0]
            (y,) = be.linear(lw, ("attn_output_b",), oa)
            return y
        o = dc.heads_inplace(out, pos, cos, sin, hp.rms_eps, False, pool) if T > 1 else out  # the inverse rope
        og = o.reshape(T, G, NH * D // G)
        if lw.ds4.get("o_a_heads") is not None:  # CPU, one token: the G group matmuls in one pool dispatch
            oa = be.head_linear(lw.ds4["o_a_heads"], og).reshape(T, G * hp.o_lora_rank)
        else:
            oa = be.concat([be.linear(lw, (f"attn_output_a.{g}",), _back(be, np.ascontiguousarray(og[:, g])))[0]
                            for g in range(G)], axis=1)
        (y,) = be.linear(lw, ("attn_output_b",), oa)
        return y

    def _o_groups_scratch(self, n_values: int) -> np.ndarray:
        """The model's group-major scratch of at least ``n_values`` float32 values (a prefill
        step's T*NH*D), grown when a larger ubatch comes; ds4_compiled.inverse_rope_groups
        checks its size against the step's rows."""
        if self._o_groups_buf is None or self._o_groups_buf.size < n_values:
            self._o_groups_buf = np.empty(n_values, np.float32)
        return self._o_groups_buf

    def _attend_one(self, be, lw, state, q, kv, comp_in, idx_in, a, s, n0, ratio, cos, sin, pool, p_raw=-1):
        """One token of slot ``s`` at position n0 (a span of one: a decode step), as the span
        loop of :meth:`_attention` computes it (the same keys in the same order, the same
        state updates): the raw ring written in place and read from there
        (ds4_compiled.attend_one), every visible compressed row attended on ratio-128 layers,
        and on ratio-4 layers the indexer's scores computed (ds4_indexer.index_one) only when
        there are more visible rows than its top_k (else top-k keeps them all). q [NH, D] float32
        (rounded to float16 values), kv [D] float32. Returns float32 [NH, D]. ``p_raw`` >= 0: q
        is raw (the token at that position, alone in its step), prepared in place, and the
        output comes inverse-roped (ds4_decode.attend_one: the same bits)."""
        from moe_service.engine import ds4_compiled as dc
        from moe_service.engine import ds4_indexer

        hp, d, il = self.hp, lw.ds4, lw.index
        kvc = be.m.kv
        ring, W = state["raw"], hp.window
        new = kv.astype(np.float16)
        lo = max(0, n0 - W + 1)
        # ring row n0 % W held position n0 - W, outside the window lo .. n0: written first, as the span loop
        ring[s, n0 % W] = new
        kvc.note_ring(s, il, "raw", n0, new[None])
        comp = sel = None
        if ratio:
            comp = self._compress(state, "ring_kv", "ring_sc", "comp", s, n0, comp_in[0][a:a + 1],
                                  comp_in[1][a:a + 1], ratio, d["attn_compressor_norm"], cos, sin)
            kvc.note_ring(s, il, "ring_kv", n0, comp_in[0][a:a + 1])
            kvc.note_ring(s, il, "ring_sc", n0, comp_in[1][a:a + 1])
            nb = (n0 + 1) // ratio  # every block so far is visible from position n0
            if ratio == 4:
                ik = self._compress(state, "iring_kv", "iring_sc", "icomp", s, n0, idx_in[0][a:a + 1],
                                    idx_in[1][a:a + 1], 4, d["indexer_compressor_norm"], cos, sin)
                kvc.note_ring(s, il, "iring_kv", n0, idx_in[0][a:a + 1])
                kvc.note_ring(s, il, "iring_sc", n0, idx_in[1][a:a + 1])
                if nb > hp.indexer_top_k:  # compiled, float64 (ds4_indexer.index_one: _top_k's choice)
                    sel = ds4_indexer.index_one(idx_in[2][a], idx_in[3][a], ik, nb, hp.indexer_top_k, pool)
        if p_raw >= 0:
            from moe_service.engine import ds4_decode

            o = ds4_decode.attend_one(q, p_raw, cos, sin, hp.rms_eps, ring[s], lo, n0, new, comp, sel, d["attn_sinks"],
                                      1.0 / np.sqrt(hp.head_dim), pool)
            return o[0]
        o = dc.attend_one(q[None], ring[s], lo, n0, new, comp, sel, d["attn_sinks"], 1.0 / np.sqrt(hp.head_dim), pool)
        return o[0]

    def _compress(self, state, ring_kv, ring_sc, comp_key, s, n0, kv_new, sc_new, ratio, norm_w, cos, sin):
        """Append a span's compressor inputs for slot ``s`` (positions n0..) and compute the
        blocks they complete; returns the slot's compressed rows [(n0 + n) // ratio, D']."""
        from moe_service.engine import ds4_ops as ops

        n = kv_new.shape[0]
        R2 = 2 * ratio
        comp = state[comp_key]
        first, last = n0 // ratio, (n0 + n) // ratio  # blocks completed in this span
        # the ring holds position p's inputs at p % R2: only the span's (last R2) rows change
        keep = np.arange(max(n0, n0 + n - R2), n0 + n)
        if first == last:  # no block completes (most decode steps): the new rows into the ring
            state[ring_kv][s, keep % R2] = kv_new[keep - n0]
            state[ring_sc][s, keep % R2] = sc_new[keep - n0]
            return comp[s, :last]
        p0 = max(0, n0 - R2)
        ring_idx = np.arange(p0, n0) % R2
        kv_all = np.concatenate([state[ring_kv][s, ring_idx], kv_new])  # positions p0 .. n0 + n - 1
        sc_all = np.concatenate([state[ring_sc][s, ring_idx], sc_new])
        overlap = ratio == 4
        Dp = kv_all.shape[1] // (2 if overlap else 1)
        for b in range(first, last):
            cur = slice(b * ratio - p0, (b + 1) * ratio - p0)
            if overlap:
                if b > 0:
                    prev = slice((b - 1) * ratio - p0, b * ratio - p0)
                    v = np.concatenate([kv_all[prev, :Dp], kv_all[cur, Dp:]])
                    sc = np.concatenate([sc_all[prev, :Dp], sc_all[cur, Dp:]])
                else:
                    v, sc = kv_all[cur, Dp:], sc_all[cur, Dp:]
            else:
                v, sc = kv_all[cur], sc_all[cur]
            row = ops.compress(v, sc, len(v), overlap=False)  # one block of len(v) tokens
            row = ops.rms(row, self.hp.rms_eps) * norm_w
            row = ops.rope_last(row[:, None, :], np.array([b * ratio]), cos, sin)[:, 0, :]
            comp[s, b] = row[0].astype(np.float16)
        state[ring_kv][s, keep % R2] = kv_new[keep - n0]
        state[ring_sc][s, keep % R2] = sc_new[keep - n0]
        return comp[s, :last]

    def _ffn(self, be, lw, h, st):
        from moe_service.engine import ds4_decode
        from moe_service.engine import ds4_ops as ops

        hp, d, il = self.hp, lw.ds4, lw.index
        probs = ops.sqrt_softplus(np.asarray(be.router_logits(lw, h), dtype=np.float32))
        # one token: compiled (ds4_decode.route_one, ds4_ops.route's bits) where the bias is float32
        if il < hp.hash_layers:
            route = ds4_decode.route_one if probs.shape[0] == 1 else ops.route
            ids, w = route(probs, hp.n_expert_used, None, d["tid2eid"][st.tokens], hp.weights_norm, hp.weights_scale)
        else:
            k = be.m.routing.k if be.m.routing is not None else hp.n_expert_used
            bias = _np(lw.router_bias)
            route = ds4_decode.route_one if probs.shape[0] == 1 and bias.dtype == np.float32 else ops.route
            ids, w = route(probs, k, bias, None, hp.weights_norm, hp.weights_scale)
        y = be.moe(lw, h, np.ascontiguousarray(ids, dtype=np.int32), np.ascontiguousarray(w, dtype=np.float32))
        lim = hp.clamp_shexp[il]
        act = MoEAct(ACT_SWIGLU_CLAMP, limit=lim) if lim > 1e-6 else MoEAct()
        return y + be.glu_ffn(lw, h, ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"), act=act)


_H_PROJ: dict[int, tuple[str, ...]] = {
    0: ("attn_q_a", "attn_kv"),
    4: ("attn_q_a", "attn_kv", "attn_compressor_kv", "attn_compressor_gate", "indexer_compressor_kv",
        "indexer_compressor_gate", "indexer.proj"),
    5: ("attn_q_a", "attn_kv", "attn_compressor_kv", "attn_compressor_gate"),
}
"""The projections of the attention's input h, one dispatch per layer, by compress ratio
(0; 4 with the indexer's; any other ratio, min(ratio, 5) = 5, the compressor's)."""


def _np(x) -> np.ndarray:
    """A backend array as numpy float32 (torch tensors are copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    return x.detach().float().cpu().numpy()


def _back(be, a: np.ndarray):
    """numpy -> the backend's array type (torch on the TorchPath's device)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if type(be).__name__ == "CpuPath":
        return a
    import torch

    return torch.from_numpy(a).to(be.m.device)


def _top_k(q: np.ndarray, w: np.ndarray, k: np.ndarray, visible: np.ndarray, top_k: int) -> np.ndarray:
    """The lightning indexer's choice (the reference of ds4_indexer.lid_top_k, which the layer
    runs): bool [n, nb], the ``top_k`` visible compressed rows by
    sum_heads relu(q . k) * w (q [n, Ni, Di] roped, w [n, Ni] scaled, k [nb, Di]), ties broken as
    llama.cpp's ggml_top_k (models/deepseek4.cpp build_lid_top_k, ggml-cpu ops.cpp top_k)."""
    # float64 (BLAS dgemm): the selection is discrete, so the score must not depend on how
    # many rows a step has (float32 kernels block differently per shape and flip near-ties)
    n, Ni, Di = q.shape
    s = q.astype(np.float64).reshape(n * Ni, Di) @ k.astype(np.float64).T
    score = (np.maximum(s, 0.0).reshape(n, Ni, -1) * w.astype(np.float64)[:, :, None]).sum(axis=1)
    # visible is a prefix of each row (block b from position (b + 1) * 4 - 1 on); ties (exact
    # zeros from the ReLU) broken as ggml's top-k breaks them (ds4_ops.top_k_rows)
    from moe_service.engine import ds4_ops as ops

    return ops.top_k_rows(score, visible.sum(axis=1), top_k) & visible
