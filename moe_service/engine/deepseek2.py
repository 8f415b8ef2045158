"""The ``deepseek2`` architecture (DeepSeek V2/V2.5/V3/R1, Kimi K2): hyperparameters, the
tensor list with shapes, and the forward pass on the CPU path and the torch path.

Shapes: T tokens, H hidden, NH heads, Rq q_lora_rank, Rkv kv_lora_rank, Dn qk_nope, Dr
qk_rope, Dv v_head, E experts, K experts per token, I expert width, F dense FFN width.

::

    tokens -> embed [T, H]
      per layer: rmsnorm -> MLA attention over the latent cache (moe_service.engine.mla)
                 -> + residual -> rmsnorm
                 -> layer < leading_dense_block_count: dense SwiGLU FFN [T, H]
                    else: router [T, E] -> (softmax | sigmoid) (+ selection bias) -> group
                          limit -> top-k -> weights (norm, x scale) -> fused MoE [T, H]
                          + shared experts (SwiGLU of width I * expert_shared_count)
                 -> + residual
      -> rmsnorm -> output -> logits

Hyperparameters (GGUF keys ``deepseek2.*``; llama.cpp models/deepseek2.cpp):
``attention.q_lora_rank`` (absent or 0: lite, ``attn_q``), ``attention.kv_lora_rank``,
``attention.key_length_mla`` / ``value_length_mla`` (present: the split MLA form with
``attn_k_b``/``attn_v_b``; absent: the legacy ``attn_kv_b`` with ``key_length`` /
``value_length`` as the per-head dims), ``rope.dimension_count`` (Dr; Dn = key dim - Dr),
``leading_dense_block_count``, ``expert_*`` (count, used_count, feed_forward_length,
shared_count, weights_scale, weights_norm, gating_func: absent -> softmax, 2 -> sigmoid,
group_count, group_used_count), YaRN keys (moe_service.engine.rope_yarn). Kimi K2 files
carry the same architecture string and keys (384 experts, one group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from moe_service.engine import attention, cpu_layers, mla, routing
from moe_service.engine.model import (
    ArchSpec,
    CpuPath,
    ExpertSet,
    KVCache,
    LayerWeights,
    Model,
    TorchPath,
    _dequantize,
)
from moe_service.engine.rope_yarn import RopeScaling
from moe_service.errors import ModelFileError

ARCH = "deepseek2"


@dataclass(frozen=True)
class Deepseek2Params:
    """deepseek2 hyperparameters, read from GGUF metadata (module docstring)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_vocab: int
    q_lora_rank: int  # 0: lite (attn_q)
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    split_mla: bool  # attn_k_b / attn_v_b (else legacy attn_kv_b)
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int
    n_dense_lead: int
    n_expert_shared: int
    n_group: int
    n_group_used: int
    gating: int  # routing.GATING_*
    weights_norm: bool
    weights_scale: float
    rms_eps: float
    n_ctx_train: int
    rope: RopeScaling

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent KV cache: Rkv + Dr."""
        return self.kv_lora_rank + self.qk_rope

    @property
    def kq_scale(self) -> float:
        return self.rope.deepseek_kq_scale(self.qk_nope + self.qk_rope)

    @classmethod
    def from_metadata(cls, md: dict, path: str, n_vocab: int) -> Deepseek2Params:
        """Raises ModelFileError naming the file and key for a missing or inconsistent value."""
        a = ARCH

        def get(key: str, default=None, required: bool = False):
            k = f"{a}.{key}"
            if k not in md:
                if required:
                    raise ModelFileError(f"{path}: metadata key {k!r} is missing")
                return default
            v = md[k]
            if isinstance(v, list | tuple):
                v = max(v) if v else default
            return v

        def count(key: str, default=None, required: bool = False, minimum: int = 0) -> int:
            v = get(key, default, required)
            try:
                n = int(v)
            except (TypeError, ValueError):
                raise ModelFileError(f"{path}: {a}.{key} must be an integer (got {v!r})") from None
            if n < minimum:
                raise ModelFileError(f"{path}: {a}.{key} must be >= {minimum} (got {n})")
            return n

        n_embd = count("embedding_length", required=True, minimum=1)
        n_head = count("attention.head_count", required=True, minimum=1)
        kv_lora = count("attention.kv_lora_rank", required=True, minimum=1)
        dr = count("rope.dimension_count", required=True, minimum=2)
        k_mla = count("attention.key_length_mla", 0)
        v_mla = count("attention.value_length_mla", 0)
        split = k_mla > 0 and v_mla > 0
        if (k_mla > 0) != (v_mla > 0):
            raise ModelFileError(f"{path}: {a}.attention.key_length_mla and value_length_mla must be set together "
                                 f"(got {k_mla} and {v_mla})")
        if split:
            dk, dv = k_mla, v_mla
        else:
            dk = count("attention.key_length", n_embd // n_head, minimum=1)
            dv = count("attention.value_length", dk, minimum=1)
        if dr % 2 or dk <= dr:
            raise ModelFileError(f"{path}: {a}.rope.dimension_count = {dr} must be even and below the key length {dk}")
        gating_key = count("expert_gating_func", 0)
        if gating_key not in (0, 1, 2):
            raise ModelFileError(f"{path}: {a}.expert_gating_func = {gating_key} is not supported "
                                 f"(1 softmax, 2 sigmoid)")
        n_expert = count("expert_count", 0)
        n_used = count("expert_used_count", 0)
        n_group = count("expert_group_count", 0)
        n_group_used = count("expert_group_used_count", 0)
        if n_expert:
            try:
                routing.check_routing(n_expert, n_used, n_group, n_group_used)
            except ValueError as exc:
                raise ModelFileError(f"{path}: {a}.expert_count/expert_used_count/expert_group_count: {exc}") from None
        scale = float(get("expert_weights_scale", 0.0) or 0.0)
        if not math.isfinite(scale) or scale < 0:
            raise ModelFileError(f"{path}: {a}.expert_weights_scale must be a finite number >= 0 (got {scale})")
        freq_base = float(get("rope.freq_base", 10000.0))
        n_ctx_train = count("context_length", 4096, minimum=1)
        try:
            rope = RopeScaling.from_metadata(md, a, freq_base, n_ctx_train)
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
        n_layer = count("block_count", required=True, minimum=1)
        return cls(
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_vocab=n_vocab,
            q_lora_rank=count("attention.q_lora_rank", 0), kv_lora_rank=kv_lora, qk_nope=dk - dr, qk_rope=dr,
            v_head=dv, split_mla=split, n_expert=n_expert, n_expert_used=n_used,
            n_ff_exp=count("expert_feed_forward_length", 0), n_ff=count("feed_forward_length", 0),
            n_dense_lead=min(count("leading_dense_block_count", 0), n_layer),
            n_expert_shared=count("expert_shared_count", 0), n_group=n_group, n_group_used=n_group_used,
            gating=routing.GATING_SIGMOID if gating_key == 2 else routing.GATING_SOFTMAX,
            weights_norm=bool(get("expert_weights_norm", False)), weights_scale=scale or 1.0,
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), n_ctx_train=n_ctx_train, rope=rope,
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs with its ggml ne (llama.cpp's create_tensor shapes);
        ``output.weight`` may be absent (tied to token_embd)."""
        H, NH, V = self.n_embd, self.n_head, self.n_vocab
        Dk = self.qk_nope + self.qk_rope
        out = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
        for i in range(self.n_layer):
            b = f"blk.{i}."
            out[b + "attn_norm.weight"] = (H,)
            if self.q_lora_rank:
                out[b + "attn_q_a_norm.weight"] = (self.q_lora_rank,)
                out[b + "attn_q_a.weight"] = (H, self.q_lora_rank)
                out[b + "attn_q_b.weight"] = (self.q_lora_rank, NH * Dk)
            else:
                out[b + "attn_q.weight"] = (H, NH * Dk)
            out[b + "attn_kv_a_norm.weight"] = (self.kv_lora_rank,)
            out[b + "attn_kv_a_mqa.weight"] = (H, self.kv_lora_rank + self.qk_rope)
            if self.split_mla:
                out[b + "attn_k_b.weight"] = (self.qk_nope, self.kv_lora_rank, NH)
                out[b + "attn_v_b.weight"] = (self.kv_lora_rank, self.v_head, NH)
            else:
                out[b + "attn_kv_b.weight"] = (self.kv_lora_rank, NH * (self.qk_nope + self.v_head))
            out[b + "attn_output.weight"] = (NH * self.v_head, H)
            out[b + "ffn_norm.weight"] = (H,)
            if i < self.n_dense_lead:
                out[b + "ffn_gate.weight"] = (H, self.n_ff)
                out[b + "ffn_up.weight"] = (H, self.n_ff)
                out[b + "ffn_down.weight"] = (self.n_ff, H)
                continue
            E, I, S = self.n_expert, self.n_ff_exp, self.n_ff_exp * self.n_expert_shared  # noqa: E741
            out[b + "ffn_gate_inp.weight"] = (H, E)
            out[b + "ffn_gate_exps.weight"] = (H, I, E)
            out[b + "ffn_up_exps.weight"] = (H, I, E)
            out[b + "ffn_down_exps.weight"] = (I, H, E)
            if S:
                out[b + "ffn_gate_shexp.weight"] = (H, S)
                out[b + "ffn_up_shexp.weight"] = (H, S)
                out[b + "ffn_down_shexp.weight"] = (S, H)
        return out

    def check_tensors(self, catalog) -> None:
        """Every needed tensor present with its expected shape (the fused ``ffn_gate_up_exps``
        {H, 2I, E} stands for gate+up; ``exp_probs_b.bias`` {E} is optional). Raises
        ModelFileError naming the file, the tensor and expected vs found shapes."""
        path = catalog.shards[0].path
        t = catalog.tensors
        for name, ne in self.tensor_shapes().items():
            if name == "output.weight" and name not in t:
                continue
            if name not in t and name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
                fused = name.rsplit(".", 2)[0] + ".ffn_gate_up_exps.weight"
                if fused in t:
                    name, ne = fused, (ne[0], 2 * ne[1], ne[2])
            if name not in t:
                raise ModelFileError(f"{path}: tensor {name!r} is missing (deepseek2 needs it with ne {list(ne)})")
            if tuple(t[name].ne) != tuple(ne):
                raise ModelFileError(f"{path}: tensor {name!r} has ne {list(t[name].ne)}, the header's "
                                     f"hyperparameters need {list(ne)}")
        for i in range(self.n_dense_lead, self.n_layer):
            name = f"blk.{i}.exp_probs_b.bias"
            if name in t and tuple(t[name].ne) != (self.n_expert,):
                raise ModelFileError(f"{path}: tensor {name!r} has ne {list(t[name].ne)}, expected [{self.n_expert}]")


def params_of(catalog) -> Deepseek2Params:
    """The model's Deepseek2Params, checked against its tensors (ModelFileError)."""
    hp = Deepseek2Params.from_metadata(catalog.metadata, str(catalog.shards[0].path), catalog.params.n_vocab)
    hp.check_tensors(catalog)
    return hp


# ---------------------------------------------------------------------------------------------
# The two dense paths


class _LatentKV(KVCache):
    """KVCache whose K list is the latent cache and whose V list is the same arrays (vc is kc)."""

    def bytes(self) -> int:
        return sum(int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else t.nbytes for t in self.k)


class Deepseek2Cpu(CpuPath):
    """The CPU path's deepseek2 pieces: MLA over the latent cache, routing, shared experts."""

    def kv_storage(self, n_layer, n_seq, n_ctx, latent_dim):
        k = [cpu_layers._resident_zeros_u16((n_seq, n_ctx, 1, latent_dim)) for _ in range(n_layer)]
        return k, k

    def rope_tables(self, cos, sin):
        return cos, sin

    def attention(self, lw: LayerWeights, h: np.ndarray, positions: np.ndarray, spans) -> np.ndarray:
        m, P = self.m, self.m.hp
        T, NH, Dn, Dr, Rkv = h.shape[0], P.n_head, P.qk_nope, P.qk_rope, P.kv_lora_rank
        if P.q_lora_rank:
            qa, kv = self.linear(lw, ("attn_q_a", "attn_kv_a_mqa"), h)
            (q,) = self.linear(lw, ("attn_q_b",), self.rmsnorm(np.ascontiguousarray(qa), lw.vecs["attn_q_a_norm"]))
        else:
            q, kv = self.linear(lw, ("attn_q", "attn_kv_a_mqa"), h)
        q = np.ascontiguousarray(q).reshape(T, NH, Dn + Dr)
        q_nope = np.ascontiguousarray(q[:, :, :Dn])  # [T, NH, Dn]
        q_pe = np.ascontiguousarray(q[:, :, Dn:])  # [T, NH, Dr]
        k_pe = np.ascontiguousarray(kv[:, Rkv:]).reshape(T, 1, Dr)
        cos, sin = m._rope_cache
        cpu_layers.rope(q_pe, positions, cos, sin, Dr, False)
        cpu_layers.rope(k_pe, positions, cos, sin, Dr, False)
        kv_c = self.rmsnorm(np.ascontiguousarray(kv[:, :Rkv]), lw.vecs["attn_kv_a_norm"])  # [T, Rkv]
        arena = m.weights.arena
        if P.split_mla:
            off, typ = lw.mla["k_b"]
            q_abs = mla.head_matmul(arena, off, typ, NH, Rkv, Dn, q_nope)  # [T, NH, Rkv]
        else:
            q_abs = mla.absorb_q_float(q_nope, lw.mla["k_b_float"])
        qq = np.concatenate([q_abs, q_pe], axis=2)  # [T, NH, L]
        kk = np.concatenate([kv_c[:, None, :], k_pe], axis=2)  # [T, 1, L]
        kc = m.kv.k[lw.index]
        attention.store(kc, kc, kk, None, spans)
        lat = np.empty((T, NH, Rkv), np.float32)
        attention.attend(m.ops, qq, kc, kc, spans, np.float32(P.kq_scale), lat)
        off, typ, stride = lw.mla["v_b"]
        o = mla.head_matmul(arena, off, typ, NH, P.v_head, Rkv, lat, head_stride_bytes=stride)  # [T, NH, Dv]
        (y,) = self.linear(lw, ("attn_output",), o.reshape(T, NH * P.v_head))
        return y

    def route(self, lw: LayerWeights, h: np.ndarray):
        P = self.m.hp
        logits = np.ascontiguousarray(self.router_logits(lw, h), dtype=np.float32)
        return routing.route(logits, P.n_expert_used, gating=P.gating, n_group=P.n_group,
                             n_group_used=P.n_group_used, bias=lw.router_bias, norm=P.weights_norm,
                             scale=P.weights_scale)

    def shared_ffn(self, lw: LayerWeights, h: np.ndarray) -> np.ndarray:
        g, u = self.linear(lw, ("ffn_gate_shexp", "ffn_up_shexp"), h)
        act = np.empty(g.shape, np.float32)
        cpu_layers.silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u), act)
        (y,) = self.linear(lw, ("ffn_down_shexp",), act)
        return y


class Deepseek2Torch(TorchPath):
    """The torch path's deepseek2 pieces (dense matrices dequantized on the device)."""

    def kv_storage(self, n_layer, n_seq, n_ctx, latent_dim):
        dev = self.m.device
        k = [torch.zeros((n_seq, n_ctx, 1, latent_dim), dtype=torch.float16, device=dev) for _ in range(n_layer)]
        return k, k

    def _rope_pairs(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Adjacent-pair rotation of the whole last dim (x [T, heads, Dr])."""
        cos, sin = (c[positions][:, None, :] for c in self.m._rope_cache)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    def attention(self, lw: LayerWeights, h: torch.Tensor, positions: torch.Tensor, spans) -> torch.Tensor:
        m, P = self.m, self.m.hp
        T, NH, Dn, Rkv = h.shape[0], P.n_head, P.qk_nope, P.kv_lora_rank
        if P.q_lora_rank:
            qa, kv = self.linear(lw, ("attn_q_a", "attn_kv_a_mqa"), h)
            (q,) = self.linear(lw, ("attn_q_b",), self.rmsnorm(qa, lw.vecs["attn_q_a_norm"]))
        else:
            q, kv = self.linear(lw, ("attn_q", "attn_kv_a_mqa"), h)
        q = q.reshape(T, NH, Dn + P.qk_rope)
        q_pe = self._rope_pairs(q[..., Dn:], positions)
        k_pe = self._rope_pairs(kv[:, None, Rkv:], positions)  # [T, 1, Dr]
        kv_c = self.rmsnorm(kv[:, :Rkv], lw.vecs["attn_kv_a_norm"])
        q_abs = torch.einsum("thd,hdr->thr", q[..., :Dn], lw.mla["k_b_t"])  # [T, NH, Rkv]
        cache = m.kv.k[lw.index]
        for s, a, e, n0 in spans:
            cache[s, n0 : n0 + (e - a), 0] = torch.cat([kv_c[a:e], k_pe[a:e, 0]], dim=-1).to(torch.float16)
        lat = mla.attend_latent_torch(torch.cat([q_abs, q_pe], dim=-1), cache, spans, P.kq_scale, Rkv)
        o = torch.einsum("thr,hvr->thv", lat, lw.mla["v_b_t"])  # [T, NH, Dv]
        (y,) = self.linear(lw, ("attn_output",), o.reshape(T, NH * P.v_head))
        return y

    def route(self, lw: LayerWeights, h: torch.Tensor):
        P = self.m.hp
        ids, w = routing.route_torch(h @ lw.router.T, P.n_expert_used, gating=P.gating, n_group=P.n_group,
                                     n_group_used=P.n_group_used, bias=lw.router_bias, norm=P.weights_norm,
                                     scale=P.weights_scale)
        return (np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int32),
                np.ascontiguousarray(w.float().cpu().numpy(), dtype=np.float32))

    def shared_ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        g, u = self.linear(lw, ("ffn_gate_shexp", "ffn_up_shexp"), h)
        (y,) = self.linear(lw, ("ffn_down_shexp",), torch.nn.functional.silu(g) * u)
        return y


class Deepseek2Model(Model):
    """A deepseek2 model ready to compute; the same interface as Model (``step``, ``kv``,
    ``route``). Arguments as Model. The KV cache is latent: one float16 row of Rkv + Dr
    values per token per layer (V3: 576 values, 1152 bytes; an expanded MHA cache would hold
    NH * (Dn + Dr + Dv) = 40960). Raises ModelFileError naming the file, key or tensor when
    the header and tensors disagree."""

    def __init__(self, catalog, weights, ops, *, device: str = "cpu", dense: str = "quant", n_seq: int = 4,
                 n_ctx: int = 4096, dense_dtype: torch.dtype = torch.float32, offload=None):
        p = catalog.params
        if p.arch != ARCH:
            raise ModelFileError(f"{catalog.shards[0].path}: architecture {p.arch!r} is not {ARCH!r}")
        self.catalog, self.weights, self.ops, self.p = catalog, weights, ops, p
        self.hp = hp = params_of(catalog)
        self.arch = ArchSpec(rope="norm", qk_norm=False,
                             gating="sigmoid" if hp.gating == routing.GATING_SIGMOID else "softmax",
                             norm_topk=hp.weights_norm)
        self.device = torch.device(device)
        if dense == "quant" and self.device.type != "cpu":
            raise ValueError(f"dense = 'quant' runs on the CPU (device {device!r} needs dense = 'torch')")
        self.dense_mode, self.dense_dtype, self.offload = dense, dense_dtype, offload
        self.path = Deepseek2Cpu(self) if dense == "quant" else Deepseek2Torch(self)
        self.n_ctx = min(n_ctx or hp.n_ctx_train, hp.n_ctx_train)
        self.rope_dim = hp.qk_rope
        self.expert_weights_scale = hp.weights_scale
        self.layers = [self._load_layer(i) for i in range(hp.n_layer)]
        self.tok_embd = self._qmat("token_embd.weight")
        self.output = self._qmat("output.weight") if "output.weight" in catalog.tensors else self.tok_embd
        self.output_group = (self.output,)
        self.output_norm = self.path.vec("output_norm.weight")
        if dense == "torch":
            self.output_dense = self._to_device(self.output.name)
        k, v = self.path.kv_storage(hp.n_layer, n_seq, self.n_ctx, hp.latent_dim)
        self.kv = _LatentKV(n_seq, self.n_ctx, k, v)
        self._rope_cache = self.path.rope_tables(*hp.rope.tables(self.n_ctx, hp.qk_rope))
        import threading

        self._lock = threading.Lock()

    def _load_layer(self, i: int) -> LayerWeights:
        hp, t, pre = self.hp, self.catalog.tensors, f"blk.{i}."
        lw = LayerWeights(i)
        names = (["attn_q_a", "attn_q_b"] if hp.q_lora_rank else ["attn_q"]) + ["attn_kv_a_mqa", "attn_output"]
        if i < hp.n_dense_lead:
            names += ["ffn_gate", "ffn_up", "ffn_down"]
        elif hp.n_expert_shared:
            names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        if not hp.split_mla:
            names.append("attn_kv_b")
        for n in names:
            lw.mats[n] = self._qmat(f"{pre}{n}.weight")
            if self.dense_mode == "torch" and n != "attn_kv_b":
                lw.dense[n] = self._to_device(f"{pre}{n}.weight")
        for n in ("attn_norm", "ffn_norm", "attn_q_a_norm", "attn_kv_a_norm"):
            if f"{pre}{n}.weight" in t:
                lw.vecs[n] = self.path.vec(f"{pre}{n}.weight")
        NH, Dn, Dv = hp.n_head, hp.qk_nope, hp.v_head
        lw.mla = {}
        if hp.split_mla:
            kb, vb = t[f"{pre}attn_k_b.weight"], t[f"{pre}attn_v_b.weight"]
            lw.mla["k_b"] = (self.weights.tensor_offset(kb.name), kb.ggml_type)
            lw.mla["v_b"] = (self.weights.tensor_offset(vb.name), vb.ggml_type, Dv * vb.row_bytes)
            if self.dense_mode == "torch":
                # attn_k_b numpy [NH, Rkv, Dn] -> [NH, Dn, Rkv]; attn_v_b [NH, Dv, Rkv]
                lw.mla["k_b_t"] = self._to_device(kb.name).transpose(1, 2).contiguous()
                lw.mla["v_b_t"] = self._to_device(vb.name)
        else:
            kvb = t[f"{pre}attn_kv_b.weight"]
            k_b, v_b = mla.split_legacy_kv_b(_dequantize(self.weights, kvb.name), NH, Dn, Dv)
            lw.mla["k_b_float"] = k_b  # [NH, Dn, Rkv] float32
            lw.mla["v_b"] = (self.weights.tensor_offset(kvb.name) + Dn * kvb.row_bytes, kvb.ggml_type,
                             (Dn + Dv) * kvb.row_bytes)
            if self.dense_mode == "torch":
                lw.mla["k_b_t"] = torch.from_numpy(k_b).to(self.device, self.dense_dtype)
                lw.mla["v_b_t"] = torch.from_numpy(v_b).to(self.device, self.dense_dtype)
        if i >= hp.n_dense_lead:
            lw.router = self.path.matrix(f"{pre}ffn_gate_inp.weight")  # [E, H] float32
            if f"{pre}exp_probs_b.bias" in t:
                lw.router_bias = self.path.vec(f"{pre}exp_probs_b.bias")
            kinds = self.catalog.expert_layers.get(i)
            if not kinds:
                raise ModelFileError(f"{self.catalog.shards[0].path}: layer {i} has a router but no expert tensors")
            lw.experts = ExpertSet(layer=i, n_expert=hp.n_expert, n_embd=hp.n_embd, n_ff_exp=hp.n_ff_exp,
                                   types={k: et.tensor.ggml_type for k, et in kinds.items()},
                                   copies={k: self.weights.expert_copies(i, k) for k in kinds})
            lw.shared = hp.n_expert_shared > 0
        return lw

    def _ffn(self, lw: LayerWeights, h):
        if lw.experts is None:
            return self.path.dense_ffn(lw, h)
        ids, w = self.route(lw, h)
        y = self.path.moe(lw, h, ids, w)
        if lw.shared:
            y = y + self.path.shared_ffn(lw, h)
        return y
