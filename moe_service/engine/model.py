"""The forward pass, generic over architectures: embed, one block per layer, norm, head.

Shapes: T tokens in this step (all sequences together), S sequences, H hidden (n_embd),
NH query heads, NKV kv heads, D head dim, E experts, K experts per token (top-k), I expert
width, F dense FFN width, V vocab, C context (cache) length.

::

    tokens [T] -> embed [T, H]
      per layer: x = arch.block(backend, layer, x, step)     moe_service/engine/arch/<arch>.py
                 (e.g. llama: rmsnorm -> q,k,v -> rope -> KV cache -> attention -> o -> + x
                  -> rmsnorm -> router -> top-k -> fused MoE (or dense FFN) -> + x)
      -> output norm -> output head, last token of each sequence -> logits [S, V]

What differs between architectures (hyperparameters, tensors, KV layout, RoPE, routing
rule, MoE activation, the block itself) is declared in moe_service.engine.arch, one module
per architecture; see its docstring for how to add one. This module holds what they share:
the weights as the engine sees them (:class:`QMat`, :class:`ExpertSet`,
:class:`LayerWeights`, loaded generically from the architecture's tensor list), the KV
cache, and the two backends implementing the primitives blocks are composed of.

Where each part runs: the routed experts always go through moe_service.engine.moe on the
placed memory (CPU worker pool, node-homed), except big prefills that a GPU offload takes.
The dense part follows one of two backends with the same primitives (:class:`CpuPath`,
:class:`TorchPath`): on the CPU (``dense = "quant"``), activations are numpy float32, dense
matrices go through the quantized kernels in place and the glue (norms, RoPE, attention,
router) through the numba kernels of cpu_layers and attention, one call per piece per
layer; on a GPU host (``dense = "torch"``), dense matrices are dequantized once to the torch
device and the glue runs as torch ops there. Neither backend knows which architecture runs.

Numerics follow llama.cpp on CPU: activations of quantized matmuls are quantized to the
weight's 8-bit partner format inside the kernels, the KV cache is float16, attention scores
and softmax are float32.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moe_service.engine import arch as archs
from moe_service.engine import attention, cpu_layers, kv, torch_quant
from moe_service.engine.arch.base import (
    ACT_SILU,
    ACT_SWIGLU_CLAMP,
    GATING_SIGMOID,
    GATING_SOFTMAX_WEIGHT,
    LayerKV,
    MoEAct,
    Routing,
)
from moe_service.engine.arch.rope import rope_tables
from moe_service.engine.mats import HeadMat, QMat  # noqa: F401  (importable from here too)
from moe_service.engine.quant.tensors import dequantize_tensor as _dequantize
from moe_service.errors import ConfigError, ModelFileError
from moe_service.formats import GGML_F32
from moe_service.log import get_logger

log = get_logger(__name__)

SILU = MoEAct()  # silu(g) * u, the default GLU activation
_ROUTER_POOL_MACS = 1 << 20  # an F32 router step below this runs on the calling thread (no dispatch)


# ---------------------------------------------------------------------------------------------
# Weights as the engine sees them


@dataclass(frozen=True)
class ExpertSet:
    """The routed experts of one layer, for moe_service.engine.moe and the GPU offload.

    ``gate``/``up``/``down``: (offsets int64 [E, C], nodes int32 [E, C]) slab copies in the
    arena (see WeightStore.expert_copies); ``gate_up`` instead of gate/up when the file fuses
    them (gate rows first). ``types``: ggml type per kind. I = ``n_ff_exp``. ``act``,
    ``alpha``, ``limit``: the architecture's activation (moe.ACT_SILU or ACT_SWIGLU_OAI);
    ``biases``: kind -> arena byte offset of a float32 per-expert bias ('gate'/'up' [E, I],
    'gate_up' [E, 2I], 'down' [E, H]; gpt-oss).
    """

    layer: int
    n_expert: int
    n_embd: int
    n_ff_exp: int
    types: dict[str, int]
    copies: dict[str, tuple[np.ndarray, np.ndarray]]
    act: int = ACT_SILU
    alpha: float = 1.702
    limit: float = 7.0
    biases: dict[str, int] = field(default_factory=dict)


class LayerWeights:
    """Everything one block needs, keyed by the tensor name without ``blk.N.`` and
    ``.weight`` (a bias keeps ``.bias``: ``"attn_q.bias"``): ``mats`` dense QMats, ``vecs``
    float32 vectors (numpy on the CPU path, torch on the device path; norms, biases, sinks),
    ``dense`` dequantized matrices (device path only), ``router`` [E, H] float32,
    ``router_bias`` [E] selection bias (exp_probs_b) or None, ``experts``."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.mats: dict[str, QMat] = {}
        self.groups: dict[tuple[str, ...], tuple[QMat, ...]] = {}  # projection groups, one dispatch each
        self.vecs: dict = {}
        self.dense: dict[str, torch.Tensor] = {}  # dequantized on the torch device (dense="torch")
        self.experts: ExpertSet | None = None
        # numpy on the CPU path, torch on the device path (like ``vecs``)
        self.router: Any = None  # [E, H] float32
        self.router_mat: QMat | None = None  # the router read in place (CPU path: pool kernels)
        self.router_bias: Any = None  # [E] selection bias (exp_probs_b), or None


def _value_dim(v) -> int:
    """Dv of the values v [T, NKV, Dv]; a latent cache passes v None and says value_dim."""
    if v is None:
        raise ValueError("attention: a latent cache (v None) needs value_dim")
    return v.shape[2]


@dataclass
class Step:
    """What a block needs about the step besides its layer: ``positions`` [T] (backend
    array), ``spans`` (seq, a, e, n0) as engine/attention/, ``rope`` the backend's
    :class:`RopeTable`, ``route(lw, h) -> (ids, w)`` the model's router."""

    positions: Any
    spans: list
    rope: Any
    route: Any
    tokens: Any = None  # int64 [T] token ids (numpy; deepseek4's hash routing)


@dataclass(frozen=True)
class RopeTable:
    """cos/sin [C, R/2] on the backend (numpy or torch), R = ``dim``, pairing per ``neox``."""

    cos: Any
    sin: Any
    dim: int
    neox: bool


# ---------------------------------------------------------------------------------------------
# KV cache


# The KV cache lives in moe_service.engine.kv (planned memory, formats, rows for the prefix
# cache); the name stays importable from here.
KVCache = kv.KVCache


def _cache_shapes(layer: LayerKV, n_seq: int, n_ctx: int) -> tuple[tuple, tuple | None]:
    """(k shape, v shape or None for a latent layer) of one layer's float16 cache on a torch
    device (the CPU path's layout comes from kv.KVCache.allocate)."""
    if layer.latent:
        return (n_seq, n_ctx, layer.n_head_kv, layer.key_dim), None
    return (n_seq, n_ctx, layer.n_head_kv, layer.key_dim), (n_seq, n_ctx, layer.n_head_kv, layer.value_dim)


def _seq_state(m, n_ctx: int) -> list:
    """The architecture's per-sequence state arrays (kv.SeqState) for ``n_ctx`` tokens."""
    arch = getattr(m, "arch", None)
    return list(arch.seq_state(n_ctx)) if arch is not None else []


# ---------------------------------------------------------------------------------------------
# The two backends: same primitives, numpy + numba on the CPU, torch on a device

_NO_NORM_W = np.zeros(0, np.float32)  # CpuPath.qk_norm_rope_one without q/k norm weights (llama, qwen2)


class CpuPath:
    """Dense part on the CPU: float32 numpy activations, quantized matmuls in place on the
    worker pool, glue from cpu_layers / attention (numba, ggml rounding)."""

    def __init__(self, model: Model):
        self.m = model

    # -- loading ---------------------------------------------------------------------------

    def vec(self, name: str) -> np.ndarray:
        return _dequantize(self.m.weights, name).reshape(-1)

    def matrix(self, name: str) -> np.ndarray:
        return _dequantize(self.m.weights, name)

    def rope_table(self, cos: np.ndarray, sin: np.ndarray, dim: int, neox: bool) -> RopeTable:
        return RopeTable(cos, sin, dim, neox)

    def kv_cache(self, layers: list[LayerKV], n_seq: int, n_ctx: int) -> KVCache:
        """The planned KV cache (engine/kv.py): every layer in one bound, populated mapping, in
        the model's kv_type (f16 bits as uint16, or q8_0 blocks) on its kv_node."""
        m = self.m  # a bare model (tests) has neither: float16, no binding
        return kv.KVCache.allocate(layers, n_seq, n_ctx, kv_type=getattr(m, "kv_type", "f16"),
                                   node=getattr(m, "kv_node", None), state=_seq_state(m, n_ctx))

    # -- primitives --------------------------------------------------------------------------

    def positions(self, pos: list[int]) -> np.ndarray:
        return np.asarray(pos, dtype=np.int64)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        m = self.m
        return m.ops.get_rows(m.weights.arena, m.tok_embd, ids)  # [T, H]

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        cpu_layers.rms_norm(x, w, np.float32(eps), out)
        return out

    def rmsnorm_heads(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """Per-head RMSNorm of x [T, heads, d] (in place; x contiguous float32)."""
        cpu_layers.rms_norm_heads(x, w, np.float32(eps))
        return x

    def heads(self, x: np.ndarray, n: int, d: int) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], n, d)

    def flat(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).reshape(x.shape[0], -1)

    def linear(self, lw: LayerWeights, names: tuple[str, ...], x: np.ndarray) -> list[np.ndarray]:
        """x [T, n_cols] times each named weight's transpose, one pool dispatch, plus the
        layer's ``<name>.bias`` where it has one. The QMat tuple per (layer, names) is kept so
        the pool finds its cached plan by identity."""
        mats = lw.groups.get(names)
        if mats is None:
            mats = lw.groups[names] = tuple(lw.mats[n] for n in names)
        out = self.m.ops.matmul(self.m.weights.arena, mats, np.ascontiguousarray(x))
        for i, n in enumerate(names):
            b = lw.vecs.get(n + ".bias")
            if b is not None:
                out[i] = out[i] + b
        return out

    def head(self, h: np.ndarray) -> np.ndarray:
        m = self.m
        (logits,) = m.ops.matmul(m.weights.arena, m.output_group, np.ascontiguousarray(h))
        return logits

    def rope(self, x: np.ndarray, positions: np.ndarray, table: RopeTable) -> np.ndarray:
        """Rotate the first table.dim dims of each head of x [T, heads, D] (in place)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        cpu_layers.rope(x, positions, table.cos, table.sin, table.dim, table.neox)
        return x

    def qk_norm_rope_one(self, q: np.ndarray, k: np.ndarray, wq: np.ndarray | None, wk: np.ndarray | None,
                         eps: float, pos: int, table: RopeTable) -> None:
        """One token's q float32 [NH, D] and k float32 [NKV, D] (C-contiguous) in place: the
        per-head RMSNorm by wq / wk float32 [D] (None, None: no q/k norm), then RoPE at
        position ``pos``, in one compiled call (cpu_layers.qk_norm_rope_one; the bits of
        :meth:`rmsnorm_heads` then :meth:`rope`)."""
        has_norm = wq is not None and wk is not None
        cpu_layers.qk_norm_rope_one(q, k, wq if has_norm else _NO_NORM_W, wk if has_norm else _NO_NORM_W,
                                    has_norm, np.float32(eps), pos, table.cos, table.sin, table.dim, table.neox)

    def add_rms_norm(self, x: np.ndarray, o: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """(x + o, rmsnorm(x + o) * w) of float32 [T, H] rows (x C-contiguous) in one compiled
        call (cpu_layers.add_rms_norm; the bits of ``x + o`` then :meth:`rmsnorm`)."""
        x1 = np.empty_like(x)
        h = np.empty_like(x)
        cpu_layers.add_rms_norm(x, np.ascontiguousarray(o, dtype=np.float32), w, np.float32(eps), x1, h)
        return x1, h

    def attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray | None, spans, scale: float, *,
                  window: int = 0, sinks: np.ndarray | None = None, value_dim: int = 0) -> np.ndarray:
        """Store k, v in layer ``layer``'s cache, attend (engine/attention/): [T, NH, Dv]."""
        kc, vc = self.m.kv.k[layer], self.m.kv.v[layer]
        dv = value_dim or _value_dim(v)
        out = np.empty((q.shape[0], q.shape[1], dv), np.float32)
        attention.store(kc, vc, k, v, spans)
        attention.attend(self.m.ops, np.ascontiguousarray(q, dtype=np.float32), kc, vc, spans, scale, out,
                         window=window, sinks=sinks)
        return out

    def glu_ffn(self, lw: LayerWeights, h: np.ndarray, names=("ffn_gate", "ffn_up", "ffn_down"),
                act: MoEAct = SILU) -> np.ndarray:
        """down(act(gate h, up h)) [T, H] (dense FFN or shared experts)."""
        g, u = self.linear(lw, names[:2], h)
        out = np.empty(g.shape, np.float32)
        if act.kind == ACT_SILU:
            cpu_layers.silu_mul(g, u, out)
        else:
            from moe_service.engine.moe import act_rows

            act_rows(act.kind, np.ascontiguousarray(g).reshape(-1), np.ascontiguousarray(u).reshape(-1),
                     np.float32(act.alpha), np.float32(act.limit), out.reshape(-1))
        (y,) = self.linear(lw, names[2:], out)
        return y

    def head_mat(self, name: str, n_head: int, n_rows: int, n_cols: int, row0: int = 0,
                 head_rows: int | None = None) -> HeadMat:
        """Per-head matrices W[h] [n_rows, n_cols] read in place from tensor ``name``: rows
        ``h * head_rows + row0 ..`` (``head_rows`` default n_rows: a 3-D tensor {n_cols,
        n_rows, n_head}; larger: head-strided row groups of a 2-D tensor). ModelFileError
        naming the tensor when the rows do not fit it."""
        t = self.m.catalog.tensors[name]
        head_rows = n_rows if head_rows is None else head_rows
        if t.ne[0] != n_cols or (n_head - 1) * head_rows + row0 + n_rows > t.n_rows:
            raise ModelFileError(f"{self.m.catalog.shards[0].path}: tensor {name!r} (ne {list(t.ne)}) does not hold "
                                 f"{n_head} heads of {n_rows} x {n_cols}")
        return HeadMat(name, self.m.weights.tensor_offset(name) + row0 * t.row_bytes, t.ggml_type, n_head, n_rows,
                       n_cols, head_rows * t.row_bytes)

    def head_mat_float(self, w: np.ndarray) -> np.ndarray:
        """Per-head float matrices float32 [NH, rows, cols] for :meth:`head_linear`."""
        return np.ascontiguousarray(w, dtype=np.float32)

    def head_linear(self, w, x: np.ndarray) -> np.ndarray:
        """out[t, h] = W[h] @ x[t, h]: x [T, NH, cols] -> [T, NH, rows]. ``w``: a HeadMat
        (quantized in place; each (t, h) row quantized to the weight's partner format, as
        ggml's broadcast mul_mat) or float32 [NH, rows, cols] (:meth:`head_mat_float`)."""
        from moe_service.engine import mla

        if isinstance(w, HeadMat):
            return mla.head_matmul(self.m.weights.arena, w.offset, w.ggml_type, w.n_head, w.n_rows, w.n_cols, x,
                                   head_stride_bytes=w.head_stride, pool=getattr(self.m.ops, "pool", None))
        return np.einsum("hrc,thc->thr", w, np.ascontiguousarray(x, dtype=np.float32),
                         optimize=False).astype(np.float32, copy=False)

    def concat(self, parts: list[np.ndarray], axis: int = -1) -> np.ndarray:
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=axis)

    def router_logits(self, lw: LayerWeights, h: np.ndarray) -> np.ndarray:
        """h [T, H] times the router [E, H]^T (+ the router's logit bias): [T, E] float32.

        The router is read in place as ggml's mul_mat reads it: an F32 router sums in
        ggml's F32 order (quant.ir.dot_f32_ggml) on the calling thread when the step is
        small (a decode step), else on the worker pool (the same numbers); other types go
        through their format kernel on the pool (F16 / BF16: the activation rounded to the
        weight's precision; quantized: the partner format). A row's result never depends
        on T, so chunked prefill equals one-shot."""
        mat = lw.router_mat
        h = np.ascontiguousarray(h, dtype=np.float32)
        n_expert, n_embd = lw.router.shape
        if mat is None or (mat.ggml_type == GGML_F32 and h.shape[0] * n_expert * n_embd < _ROUTER_POOL_MACS):
            out = np.empty((h.shape[0], n_expert), np.float32)  # [T, E]
            if h.shape[1] != n_embd:
                raise ValueError(f"router_logits: h has {h.shape[1]} columns, the router {n_embd}")
            if mat is None:  # a router made up in code (tests), not read from the file
                cpu_layers.router_logits(h, np.ascontiguousarray(lw.router, dtype=np.float32).reshape(-1).view(np.uint8),
                                         0, out)
            else:
                arena = self.m.weights.arena
                if mat.offset + n_expert * n_embd * 4 > arena.size:  # checked at load; never read past it
                    raise ModelFileError(f"router {mat.name} runs past the weights")
                cpu_layers.router_logits(h, arena, mat.offset, out)
            b = lw.vecs.get("ffn_gate_inp.bias")
            return out if b is None else out + b
        (out,) = self.linear(lw, ("ffn_gate_inp",), h)
        return out

    def route(self, lw: LayerWeights, h: np.ndarray, rule: Routing) -> tuple[np.ndarray, np.ndarray]:
        """ids int32 [T, K], weights float32 [T, K] by ``rule`` (cpu_layers.route)."""
        logits = np.ascontiguousarray(self.router_logits(lw, h), dtype=np.float32)
        T, K = h.shape[0], rule.k
        ids = np.empty((T, K), np.int32)
        w = np.empty((T, K), np.float32)
        bias = lw.router_bias if lw.router_bias is not None else np.zeros(0, np.float32)
        cpu_layers.route(logits, K, rule.gating, rule.norm, np.float32(rule.scale), bias, lw.router_bias is not None,
                         rule.n_group, rule.n_group_used, ids, w)
        return ids, w

    def moe(self, lw: LayerWeights, h: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        return self.m.ops.moe(self.m.weights.arena, np.ascontiguousarray(h), ids, w, lw.experts)

    def gather_rows(self, x: np.ndarray, rows: list[int]) -> np.ndarray:
        return np.ascontiguousarray(x[rows])

    def logits_out(self, logits: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))


class TorchPath:
    """Dense part on a torch device (a GPU host; the CPU device in tests): dense matrices
    dequantized there once, glue as torch ops; routed experts on the CPU pool (hidden states
    cross over and back per layer) or, for big batches, the GPU offload."""

    def __init__(self, model: Model):
        self.m = model

    # -- loading ---------------------------------------------------------------------------

    def vec(self, name: str) -> torch.Tensor:
        return torch.from_numpy(_dequantize(self.m.weights, name).reshape(-1)).to(self.m.device)

    def matrix(self, name: str) -> torch.Tensor:
        return self.m._to_device(name, torch.float32)

    def rope_table(self, cos: np.ndarray, sin: np.ndarray, dim: int, neox: bool) -> RopeTable:
        return RopeTable(torch.from_numpy(cos).to(self.m.device), torch.from_numpy(sin).to(self.m.device), dim, neox)

    def kv_cache(self, layers: list[LayerKV], n_seq: int, n_ctx: int) -> KVCache:
        dev = self.m.device
        kv_type = getattr(self.m, "kv_type", "f16")
        if kv_type != "f16":
            raise ValueError(f"engine.kv_type = {kv_type} runs on the CPU path only (dense = 'quant')")
        k, v = [], []
        for layer in layers:
            ks, vs = _cache_shapes(layer, n_seq, n_ctx)
            kc = torch.zeros(ks, dtype=torch.float16, device=dev)
            k.append(kc)
            v.append(kc if vs is None else torch.zeros(vs, dtype=torch.float16, device=dev))
        decl = _seq_state(self.m, n_ctx)
        return KVCache(n_seq, n_ctx, k, v, layers, state=KVCache.state_arrays(decl, n_seq), state_decl=decl)

    # -- primitives --------------------------------------------------------------------------

    def positions(self, pos: list[int]) -> torch.Tensor:
        return torch.as_tensor(pos, dtype=torch.long, device=self.m.device)

    def embed(self, ids: np.ndarray) -> torch.Tensor:
        m = self.m
        return torch.from_numpy(m.ops.get_rows(m.weights.arena, m.tok_embd, ids)).to(m.device)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """As cpu_layers.rms_norm: float64 sum of float32 squares, correctly rounded sqrt
        (torch's float32 sqrt is not)."""
        ss = (x * x).double().sum(-1, keepdim=True)
        mean = (ss / x.shape[-1]).float()
        var = mean + torch.tensor(eps, dtype=torch.float32, device=x.device)
        scale = 1.0 / torch.sqrt(var.double()).float()
        return (x * scale) * w

    def rmsnorm_heads(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self.rmsnorm(x, w, eps)

    def heads(self, x: torch.Tensor, n: int, d: int) -> torch.Tensor:
        return x.reshape(x.shape[0], n, d)

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)

    def linear(self, lw: LayerWeights, names, x: torch.Tensor) -> list[torch.Tensor]:
        xd = x.to(self.m.dense_dtype)
        out = [(xd @ lw.dense[n].T).float() for n in names]
        for i, n in enumerate(names):
            b = lw.vecs.get(n + ".bias")
            if b is not None:
                out[i] = out[i] + b
        return out

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return (h.to(self.m.dense_dtype) @ self.m.output_dense.T).float()

    def rope(self, x: torch.Tensor, positions: torch.Tensor, table: RopeTable) -> torch.Tensor:
        """Rotate the first table.dim dims of each head. x [T, heads, D]."""
        cos, sin = (c[positions][:, None, :] for c in (table.cos, table.sin))  # [T, 1, R/2]
        r = table.dim
        xr, rest = x[..., :r], x[..., r:]
        if table.neox:
            a, b = xr[..., : r // 2], xr[..., r // 2 :]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, spans, scale: float, *,
                  window: int = 0, sinks: torch.Tensor | None = None, value_dim: int = 0) -> torch.Tensor:
        """engine/attention's contract with torch ops: causal (+ sliding window), GQA,
        sinks, latent cache (``v`` None, V = the key's first ``value_dim`` dims)."""
        m = self.m
        kc, vc = m.kv.k[layer], m.kv.v[layer]
        latent = vc is kc
        T, nh = q.shape[0], q.shape[1]
        dv = value_dim or _value_dim(v)
        out = torch.empty(T, nh, dv, dtype=torch.float32, device=m.device)
        nkv = kc.shape[2]
        group = nh // nkv
        for s, a, e, n0 in spans:
            n = e - a
            kc[s, n0 : n0 + n] = k[a:e].to(torch.float16)
            if not latent:
                assert v is not None  # only a latent cache (vc is kc) comes without values
                vc[s, n0 : n0 + n] = v[a:e].to(torch.float16)
            # K/V heads are not repeated per query head (an MLA layer has one shared row of
            # NH x more values than a head would: repeating it cost NH x the cache in memory)
            keys = kc[s, : n0 + n].float()  # [L, NKV, D]
            vals = (kc[s, : n0 + n, :, :dv] if latent else vc[s, : n0 + n]).float()  # [L, NKV, Dv]
            qs = q[a:e].to(torch.float16).float().reshape(n, nkv, group, -1)  # ggml: K·Q with Q in f16
            scores = torch.einsum("tkgd,lkd->kgtl", qs, keys).reshape(nh, n, -1) * scale  # [NH, n, L]
            qpos = torch.arange(n0, n0 + n, device=m.device)[:, None]
            kpos = torch.arange(0, n0 + n, device=m.device)[None, :]
            mask = kpos > qpos
            if window > 0:
                mask = mask | (kpos <= qpos - window)
            scores = scores.masked_fill(mask, float("-inf"))
            if sinks is not None:
                sink = sinks.float().view(nh, 1, 1).expand(nh, n, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            probs = probs.to(torch.float16).float()  # ggml: KQ converted to f16 for V·KQ
            out[a:e] = torch.einsum("kgtl,lkd->tkgd", probs.reshape(nkv, group, n, -1), vals).reshape(n, nh, dv)
        return out

    def glu_ffn(self, lw: LayerWeights, h: torch.Tensor, names=("ffn_gate", "ffn_up", "ffn_down"),
                act: MoEAct = SILU) -> torch.Tensor:
        g, u = self.linear(lw, names[:2], h)
        (y,) = self.linear(lw, names[2:], torch_act(act, g, u))
        return y

    def head_mat(self, name: str, n_head: int, n_rows: int, n_cols: int, row0: int = 0,
                 head_rows: int | None = None) -> torch.Tensor:
        """CpuPath.head_mat's matrices dequantized on the device: [NH, n_rows, n_cols]."""
        t = self.m.catalog.tensors[name]
        head_rows = n_rows if head_rows is None else head_rows
        if t.ne[0] != n_cols or (n_head - 1) * head_rows + row0 + n_rows > t.n_rows:
            raise ModelFileError(f"{self.m.catalog.shards[0].path}: tensor {name!r} (ne {list(t.ne)}) does not hold "
                                 f"{n_head} heads of {n_rows} x {n_cols}")
        full = self.m._to_device(name).reshape(-1, n_cols)
        idx = (torch.arange(n_head)[:, None] * head_rows + row0 + torch.arange(n_rows)[None, :]).to(full.device)
        return full[idx].contiguous()  # [NH, n_rows, n_cols]

    def head_mat_float(self, w: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(self.m.device, self.m.dense_dtype)

    def head_linear(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hrc,thc->thr", w, x.to(w.dtype)).float()

    def concat(self, parts: list[torch.Tensor], axis: int = -1) -> torch.Tensor:
        return torch.cat(parts, dim=axis)

    def router_logits(self, lw: LayerWeights, h: torch.Tensor) -> np.ndarray:
        return self._logits(lw, h).cpu().numpy()

    def _logits(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        logits = h @ lw.router.T  # [T, E]
        b = lw.vecs.get("ffn_gate_inp.bias")
        return logits if b is None else logits + b

    def route(self, lw: LayerWeights, h: torch.Tensor, rule: Routing) -> tuple[np.ndarray, np.ndarray]:
        ids, w = torch_route(self._logits(lw, h), rule, lw.router_bias)
        return (
            np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int32),
            np.ascontiguousarray(w.float().cpu().numpy(), dtype=np.float32),
        )

    def moe(self, lw: LayerWeights, h: torch.Tensor, ids: np.ndarray, w: np.ndarray) -> torch.Tensor:
        m = self.m
        if m.offload is not None and h.shape[0] >= m.offload.min_batch_tokens:
            return m.offload.moe(lw.experts, h, ids, w)  # [T, H] float32 on the device
        xs = np.ascontiguousarray(h.detach().cpu().numpy(), dtype=np.float32)
        return torch.from_numpy(m.ops.moe(m.weights.arena, xs, ids, w, lw.experts)).to(m.device)

    def gather_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return x[torch.as_tensor(rows, device=x.device)]

    def logits_out(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().cpu()


def torch_act(act, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The GLU activation with torch ops: silu(g) * u, or gpt-oss' clamped SwiGLU
    (moe.act_value). ``act``: anything with ``kind``, ``alpha``, ``limit`` (MoEAct, ExpertSet)."""
    kind = act.kind if isinstance(act, MoEAct) else act.act
    if kind == ACT_SILU:
        return torch.nn.functional.silu(g) * u
    x = g.clamp(max=act.limit)
    y = u.clamp(min=-act.limit, max=act.limit)
    if kind == ACT_SWIGLU_CLAMP:
        return torch.nn.functional.silu(x) * y
    return x * torch.sigmoid(act.alpha * x) * (y + 1.0)


def torch_route(logits: torch.Tensor, rule: Routing, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing (Routing's docstring) with torch ops: ids long [T, K], weights float32 [T, K]."""
    if rule.gating == GATING_SIGMOID:
        probs = torch.sigmoid(logits)
    elif rule.gating == GATING_SOFTMAX_WEIGHT:
        probs = logits
    else:
        probs = torch.softmax(logits, dim=-1)
    select = probs + bias if bias is not None else probs
    if rule.n_group > 1:
        T, E = select.shape
        per = E // rule.n_group
        grouped = select.view(T, rule.n_group, per)
        gscore = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
        keep = gscore.topk(rule.n_group_used, dim=-1, sorted=True).indices
        gmask = torch.ones(T, rule.n_group, dtype=torch.bool, device=logits.device)
        gmask.scatter_(1, keep, False)
        select = select.masked_fill(gmask.repeat_interleave(per, dim=1), float("-inf"))
    _, ids = torch.topk(select, rule.k, dim=-1, sorted=True)
    w = probs.gather(-1, ids)
    if rule.gating == GATING_SOFTMAX_WEIGHT:
        w = torch.softmax(w, dim=-1)
    if rule.norm:
        w = w / w.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    if rule.scale != 1.0:
        w = w * rule.scale
    return ids, w


# ---------------------------------------------------------------------------------------------
# The model


class Model:
    """A loaded model ready to compute: :meth:`step` runs one forward pass over a batch of
    sequences (prefill chunks and decode tokens mixed) and returns each one's last logits.

    ``catalog``: GGUFModel; ``weights``: WeightStore over the placed arena; ``ops``: the CPU
    kernel backend (moe_service.engine.ops.CpuOps) used for quantized matmuls and the fused
    MoE; ``device``: torch device of the dense part; ``dense``: "quant" (the CPU path:
    matmuls in place, numba glue; needs ``device = "cpu"``) or "torch" (dense matrices
    dequantized to ``device``, glue as torch ops); ``n_seq``: sequence slots; ``n_ctx``: tokens
    per sequence. ``dense_dtype``: dtype of the dequantized dense matrices with ``dense =
    "torch"`` (float32 default: the same values as the CPU path's weights; bfloat16 halves the
    GPU memory at ~0.4% relative error per matmul). ``kv_type``: "f16" or "q8_0" (CPU path);
    ``kv_node``: NUMA node the KV cache is bound to (None: first touch) (engine/kv.py). ``offload``: an
    moe_service.engine.offload.ExpertOffload; with ``dense = "torch"``, batches of at least
    its ``min_batch_tokens`` tokens compute their routed experts through it (on the GPU)
    instead of ``ops.moe``. ``experts_per_token``: routed experts per token (0: the model's
    own ``expert_used_count``; fewer trades quality for speed). Choosing ``device``/``dense``
    from the config: moe_service.engine.device.resolve_device.

    Attributes: ``arch`` (the moe_service.engine.arch Architecture, hyperparameters in
    ``arch.hp``), ``p`` (the catalog's ModelParams), ``routing`` (the Routing in use, None
    for a dense model), ``layers``, ``kv``.

    Raises ModelFileError naming the file, architecture, key or tensor when the file cannot
    be run (moe_service.engine.arch.validate, before anything is allocated); ConfigError for
    ``experts_per_token`` above the model's expert count; ValueError for ``dense = "quant"``
    on a non-CPU device.
    """

    def __init__(
        self, catalog, weights, ops, *, device: str = "cpu", dense: str = "quant", n_seq: int = 4, n_ctx: int = 4096,
        dense_dtype: torch.dtype = torch.float32, offload=None, experts_per_token: int = 0,
        kv_type: str = "f16", kv_node: int | None = None,
    ):
        self.arch = archs.validate(catalog)
        p = catalog.params
        self.catalog, self.weights, self.ops, self.p = catalog, weights, ops, p
        self.device = torch.device(device)
        if dense == "quant" and self.device.type != "cpu":
            raise ValueError(f"dense = 'quant' runs on the CPU (device {device!r} needs dense = 'torch')")
        self.dense_mode = dense
        self.dense_dtype = dense_dtype
        self.offload = offload
        self.path = CpuPath(self) if dense == "quant" else TorchPath(self)
        n_expert = getattr(self.arch.hp, "n_expert", 0)
        if experts_per_token < 0 or (experts_per_token and experts_per_token > n_expert):
            raise ConfigError(f"engine.experts_per_token = {experts_per_token}: the model has {n_expert} experts "
                              "per layer (0 = the model's own top-k)")
        self.routing = self.arch.routing(experts_per_token)
        n_ctx_train = getattr(self.arch.hp, "n_ctx_train", 0)
        self.n_ctx = min(n_ctx or n_ctx_train, n_ctx_train) if n_ctx_train else n_ctx
        self.layers = self._load_layers()
        self.tok_embd = self._qmat("token_embd.weight")
        self.output = self._qmat("output.weight") if "output.weight" in catalog.tensors else self.tok_embd
        self.output_group = (self.output,)
        self.output_norm = self.path.vec("output_norm.weight")
        if dense == "torch":
            self.output_dense = self._to_device(self.output.name)
        # -- the KV cache: built from the architecture's per-layer needs (LayerKV). ------------
        kv_types = getattr(self.arch, "kv_types", ("f16", "q8_0"))
        if kv_type not in kv_types:
            raise ConfigError(f"engine.kv_type = {kv_type}: {self.arch.name} supports {', '.join(kv_types)}")
        self.kv_type, self.kv_node = kv_type, kv_node
        self.kv = self.path.kv_cache(self.arch.kv_layers(), n_seq, self.n_ctx)
        # -----------------------------------------------------------------------------------------
        self._rope = self._rope_table()
        self._lock = threading.Lock()
        if self.routing is not None:
            log.info("model_routing", arch=self.arch.name, experts_per_token=self.routing.k,
                     model_experts_per_token=getattr(self.arch.hp, "n_expert_used", 0), n_expert=n_expert)

    # -- loading --------------------------------------------------------------------------

    def _qmat(self, name: str) -> QMat:
        t = self.catalog.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.catalog.shards[0].path}: tensor {name!r} is missing")
        if len(t.shape) != 2:
            raise ModelFileError(f"{self.catalog.shards[0].path}: tensor {name!r} should be 2-D (shape {t.shape})")
        return QMat(name, self.weights.tensor_offset(name), t.ggml_type, t.shape[0], t.shape[1])

    def _to_device(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A whole tensor as values on the dense device: its raw block bytes are uploaded and
        expanded there (torch_quant; bit-identical to gguf-py in float32), so a GPU host copies
        the file's bytes, not 4-byte floats. Types torch_quant lacks go through gguf-py on the
        host. ``dtype``: default ``dense_dtype``."""
        dtype = dtype or self.dense_dtype
        t = self.catalog.tensors[name]
        if torch_quant.supports(t.ggml_type):
            return torch_quant.dequantize_numpy(self.weights.tensor(name), t.ggml_type, tuple(t.shape), self.device, dtype)
        return torch.from_numpy(_dequantize(self.weights, name)).to(self.device, dtype)

    def _load_layers(self) -> list[LayerWeights]:
        """Every layer's weights, loaded by the role its architecture gives each tensor
        (arch.base.TensorSpec.role); tensors the file lacks (optional ones) are skipped."""
        per_layer: dict[int, list] = {}
        for item in self.arch.tensors():
            specs = [s for opt in item.options for s in opt] if isinstance(item, archs.OneOf) else [item]
            for s in specs:
                if s.role != "model" and s.name in self.catalog.tensors and s.name.startswith("blk."):
                    per_layer.setdefault(int(s.name.split(".")[1]), []).append(s)
        return [self._load_layer(i, per_layer.get(i, [])) for i in range(len(self.arch.kv_layers()))]

    def _load_layer(self, i: int, specs: list) -> LayerWeights:
        lw = LayerWeights(i)
        pre = f"blk.{i}."
        biases: dict[str, int] = {}
        for s in specs:
            short = s.name[len(pre):]
            key = short[: -len(".weight")] if short.endswith(".weight") else short
            if s.role == "mat":
                lw.mats[key] = self._qmat(s.name)
                if self.dense_mode == "torch":
                    lw.dense[key] = self._to_device(s.name)
            elif s.role == "vec":
                lw.vecs[key] = self.path.vec(s.name)
            elif s.role == "router":
                lw.router = self.path.matrix(s.name)  # [E, H] float32
                lw.router_mat = lw.mats["ffn_gate_inp"] = self._qmat(s.name)
            elif s.role == "router_bias":
                lw.router_bias = self.path.vec(s.name)
            elif s.role == "expert_bias":  # ffn_{gate,up,down,gate_up}_exps.bias: read in place
                biases[key.split("_exps")[0][len("ffn_"):]] = self.weights.tensor_offset(s.name)
        kinds = self.catalog.expert_layers.get(i)
        if kinds:
            act = self.arch.moe_act()
            down = kinds["down"].tensor
            lw.experts = ExpertSet(
                layer=i, n_expert=down.ne[2], n_embd=down.ne[1], n_ff_exp=down.ne[0],
                types={k: et.tensor.ggml_type for k, et in kinds.items()},
                copies={k: self.weights.expert_copies(i, k) for k in kinds},
                act=act.kind, alpha=act.alpha, limit=act.limit, biases=biases,
            )
        self.arch.prepare_layer(self.path, lw)
        return lw

    def _rope_table(self) -> RopeTable | None:
        """The architecture's RoPE cos/sin [C, R/2] on the backend (arch/rope.py: ggml's
        rounding, YaRN, the rope_freqs factors when the file has them)."""
        spec = self.arch.rope()
        if spec is None:
            return None
        factors = None
        if spec.freqs_tensor and spec.freqs_tensor in self.catalog.tensors:
            factors = _dequantize(self.weights, spec.freqs_tensor).reshape(-1)
        cos, sin = rope_tables(spec, self.n_ctx, factors)
        return self.path.rope_table(cos, sin, spec.dim, spec.neox)

    # -- the step ----------------------------------------------------------------------------

    def step(self, batch: list[tuple[int, list[int]]], *, want_logits: list[bool] | None = None) -> torch.Tensor:
        """One forward pass. ``batch``: (sequence slot, new token ids) pairs, each sequence at
        most once; its tokens are appended at its current length. Returns float32 logits
        [S, V] on the CPU, row i for the last new token of ``batch[i]``.

        want_logits: one flag per batch entry, or None for all. Only the flagged entries get a
        row, in batch order ([sum(want_logits), V]; [0, V] when none is flagged, and the output
        head does not run): a prompt chunk that is not the prompt's last needs no logits, and
        the head (vocabulary x hidden) costs as much as a layer on small models.

        Raises ValueError naming the slot when a sequence would exceed the context, or when
        want_logits does not have one flag per batch entry.
        """
        if want_logits is not None and len(want_logits) != len(batch):
            raise ValueError(f"want_logits has {len(want_logits)} flags for {len(batch)} batch entries")
        with self._lock:
            spans: list[tuple[int, int, int, int]] = []
            tokens: list[int] = []
            pos: list[int] = []
            t0 = 0
            for s, toks in batch:
                n0 = self.kv.length[s]
                if not toks:
                    raise ValueError(f"sequence slot {s}: no tokens to compute")
                if n0 + len(toks) > self.n_ctx:
                    raise ValueError(f"sequence slot {s}: {n0} + {len(toks)} tokens exceed the context of {self.n_ctx}")
                spans.append((s, t0, t0 + len(toks), n0))
                tokens.extend(toks)
                pos.extend(range(n0, n0 + len(toks)))
                t0 += len(toks)
            # CpuPath or TorchPath: each takes and returns its own array type (numpy / torch)
            path: Any = self.path
            arch = self.arch
            st = Step(path.positions(pos), spans, self._rope, self.route, np.asarray(tokens, dtype=np.int64))
            if self.offload is not None and len(tokens) >= self.offload.min_batch_tokens:
                self.offload.start_step()  # the first MoE layer's slabs start moving during attention
            x = path.embed(np.asarray(tokens, dtype=np.int64))  # [T, H]
            for lw in self.layers:
                x = arch.block(path, lw, x, st)
            rows = [e - 1 for i, (_, _, e, _) in enumerate(spans) if want_logits is None or want_logits[i]]
            if rows:
                logits = path.logits_out(path.head(arch.final_norm(path, path.gather_rows(x, rows),
                                                                   self.output_norm)))  # [S', V]
            else:
                logits = torch.empty((0, self.output.n_rows), dtype=torch.float32)
            for s, a, e, n0 in spans:
                self.kv.length[s] = n0 + (e - a)
            return logits

    def route(self, lw: LayerWeights, h) -> tuple[np.ndarray, np.ndarray]:
        """Router (arch.base.Routing, after llama.cpp's build_moe_ffn) by the model's Routing: ids int32 [T, K] and
        weights float32 [T, K]."""
        assert self.routing is not None  # route runs only for MoE layers, which have a routing rule
        return self.path.route(lw, h, self.routing)
