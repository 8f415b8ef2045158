"""The forward pass, read top to bottom: llama (dense and Mixtral-style MoE) and qwen3moe.

Shapes: T tokens in this step (all sequences together), S sequences, H hidden (n_embd),
NH query heads, NKV kv heads, D head dim, E experts, K experts per token (top-k), I expert
width, F dense FFN width, V vocab, C context (cache) length.

::

    tokens [T] -> embed [T, H]
      per layer: rmsnorm -> q,k,v [T, NH*D | NKV*D] -> (q/k norm) -> rope -> KV cache
                 -> attention per sequence -> o [T, H] -> + residual
                 -> rmsnorm -> router [T, E] -> top-k ids/weights [T, K]
                 -> fused MoE (experts on the CPU nodes that hold them) [T, H] -> + residual
      -> rmsnorm -> output head, last token of each sequence -> logits [S, V]

Where each part runs: the routed experts always go through moe_service.engine.moe on the
placed memory (CPU worker pool, node-homed), except big prefills that a GPU offload takes.
The dense part follows one of two paths with the same flow (:class:`CpuPath`,
:class:`TorchPath`): on the CPU (``dense = "quant"``), activations are numpy float32, dense
matrices go through the quantized kernels in place and the glue (norms, RoPE, attention,
router) through the numba kernels of cpu_layers, one call per piece per layer; on a GPU
host (``dense = "torch"``), dense matrices are dequantized once to the torch device and the
glue runs as torch ops there.

Numerics follow llama.cpp on CPU: activations of quantized matmuls are quantized to the
weight's 8-bit partner format inside the kernels, the KV cache is float16, attention scores
and softmax are float32.

Adding an architecture: give it an entry in ARCHS (rope style, q/k norm, router rule) and, if
its layer differs (deepseek2's MLA and shared experts, gpt-oss sinks and biases), a layer
function next to :meth:`Model._attention` / :meth:`Model._ffn`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from moe_service.engine import attention, cpu_layers, kv, torch_quant
from moe_service.errors import ModelFileError
from moe_service.log import get_logger

log = get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# Architecture table


@dataclass(frozen=True)
class ArchSpec:
    """What differs between supported architectures, as data."""

    rope: str  # "norm": adjacent pairs (x[2i], x[2i+1]); "neox": halves (x[i], x[i + D/2])
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3moe)
    gating: str  # router probabilities: "softmax" or "sigmoid"
    norm_topk: bool  # renormalise the top-k weights to sum to 1


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(rope="norm", qk_norm=False, gating="softmax", norm_topk=True),
    "qwen3moe": ArchSpec(rope="neox", qk_norm=True, gating="softmax", norm_topk=True),
}


# ---------------------------------------------------------------------------------------------
# Weights as the engine sees them


@dataclass(frozen=True)
class QMat:
    """A 2-D weight read in place from the arena: ``n_rows`` output rows of ``n_cols`` inputs,
    GGML block type ``ggml_type``, starting at byte ``offset`` of the arena."""

    name: str
    offset: int
    ggml_type: int
    n_rows: int
    n_cols: int


@dataclass(frozen=True)
class ExpertSet:
    """The routed experts of one layer, for moe_service.engine.moe.

    ``gate``/``up``/``down``: (offsets int64 [E, C], nodes int32 [E, C]) slab copies in the
    arena (see WeightStore.expert_copies); ``gate_up`` instead of gate/up when the file fuses
    them (gate rows first). ``types``: ggml type per kind. I = ``n_ff_exp``.
    """

    layer: int
    n_expert: int
    n_embd: int
    n_ff_exp: int
    types: dict[str, int]
    copies: dict[str, tuple[np.ndarray, np.ndarray]]


class LayerWeights:
    """Everything one transformer block needs: dense QMats, small float32 vectors (numpy on
    the CPU path, torch on the device path), dequantized dense matrices (device path only),
    the router and the experts."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.mats: dict[str, QMat] = {}
        self.groups: dict[tuple[str, ...], tuple[QMat, ...]] = {}  # projection groups, one dispatch each
        self.vecs: dict = {}
        self.dense: dict[str, torch.Tensor] = {}  # dequantized on the torch device (dense="torch")
        self.experts: ExpertSet | None = None
        self.router = None  # [E, H] float32
        self.router_bias = None  # [E] selection bias (exp_probs_b), or None


def _dequantize(weights, name: str) -> np.ndarray:
    """Float32 array in numpy shape (ne reversed) of a whole tensor (small tensors, GPU upload)."""
    from gguf.quants import dequantize

    t = weights.catalog.tensors[name]
    raw = weights.tensor(name)
    return np.ascontiguousarray(dequantize(raw, t.ggml_type).reshape(t.shape).astype(np.float32, copy=False))


# ---------------------------------------------------------------------------------------------
# KV cache


# The KV cache lives in moe_service.engine.kv (planned memory, formats, rows for the prefix
# cache); the name stays importable from here.
KVCache = kv.KVCache


# ---------------------------------------------------------------------------------------------
# The two dense paths: same pieces, numpy + numba on the CPU, torch on a device


class CpuPath:
    """Dense part on the CPU: float32 numpy activations, quantized matmuls in place on the
    worker pool, glue from cpu_layers (numba, ggml rounding)."""

    def __init__(self, model: Model):
        self.m = model

    def vec(self, name: str) -> np.ndarray:
        return _dequantize(self.m.weights, name).reshape(-1)

    def matrix(self, name: str) -> np.ndarray:
        return _dequantize(self.m.weights, name)

    def rope_tables(self, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return cos, sin

    def kv_cache(self, layers, n_seq: int, n_ctx: int) -> KVCache:
        m = self.m
        return kv.KVCache.allocate(layers, n_seq, n_ctx, kv_type=m.kv_type, node=m.kv_node)

    def positions(self, pos: list[int]) -> np.ndarray:
        return np.asarray(pos, dtype=np.int64)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        m = self.m
        return m.ops.get_rows(m.weights.arena, m.tok_embd, ids)  # [T, H]

    def rmsnorm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        cpu_layers.rms_norm(x, w, np.float32(self.m.p.rms_eps), out)
        return out

    def linear(self, lw: LayerWeights, names: tuple[str, ...], x: np.ndarray) -> list[np.ndarray]:
        """x [T, n_cols] times each named weight's transpose, one pool dispatch. The QMat
        tuple per (layer, names) is kept so the pool finds its cached plan by identity."""
        mats = lw.groups.get(names)
        if mats is None:
            mats = lw.groups[names] = tuple(lw.mats[n] for n in names)
        return self.m.ops.matmul(self.m.weights.arena, mats, np.ascontiguousarray(x))

    def head(self, h: np.ndarray) -> np.ndarray:
        m = self.m
        (logits,) = m.ops.matmul(m.weights.arena, m.output_group, np.ascontiguousarray(h))
        return logits

    def attention(self, lw: LayerWeights, h: np.ndarray, positions: np.ndarray, spans) -> np.ndarray:
        m, p = self.m, self.m.p
        T = h.shape[0]
        q, k, v = self.linear(lw, ("attn_q", "attn_k", "attn_v"), h)
        q = np.ascontiguousarray(q).reshape(T, p.n_head, p.head_dim)  # [T, NH, D]
        k = np.ascontiguousarray(k).reshape(T, p.n_head_kv, p.head_dim)  # [T, NKV, D]
        v = np.ascontiguousarray(v).reshape(T, p.n_head_kv, p.head_dim_v)
        eps = np.float32(p.rms_eps)
        if m.arch.qk_norm:
            cpu_layers.rms_norm_heads(q, lw.vecs["attn_q_norm"], eps)
            cpu_layers.rms_norm_heads(k, lw.vecs["attn_k_norm"], eps)
        neox = m.arch.rope == "neox"
        cos, sin = m._rope_cache
        cpu_layers.rope(q, positions, cos, sin, m.rope_dim, neox)
        cpu_layers.rope(k, positions, cos, sin, m.rope_dim, neox)
        kc, vc = m.kv.k[lw.index], m.kv.v[lw.index]
        out = np.empty((T, p.n_head, p.head_dim_v), np.float32)
        scale = np.float32(1.0 / math.sqrt(p.head_dim))
        attention.store(kc, vc, k, v, spans)
        attention.attend(m.ops, q, kc, vc, spans, scale, out)
        (o,) = self.linear(lw, ("attn_output",), out.reshape(T, -1))
        return o

    def dense_ffn(self, lw: LayerWeights, h: np.ndarray) -> np.ndarray:
        g, u = self.linear(lw, ("ffn_gate", "ffn_up"), h)
        act = np.empty(g.shape, np.float32)
        cpu_layers.silu_mul(g, u, act)
        (y,) = self.linear(lw, ("ffn_down",), act)
        return y

    def router_logits(self, lw: LayerWeights, h: np.ndarray) -> np.ndarray:
        out = np.empty((h.shape[0], lw.router.shape[0]), np.float32)  # [T, E]
        cpu_layers.router_logits(h, lw.router, out)
        return out

    def route(self, lw: LayerWeights, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m = self.m
        logits = np.ascontiguousarray(self.router_logits(lw, h), dtype=np.float32)
        T, K = h.shape[0], m.p.n_expert_used
        ids = np.empty((T, K), np.int32)
        w = np.empty((T, K), np.float32)
        bias = lw.router_bias if lw.router_bias is not None else np.zeros(0, np.float32)
        cpu_layers.route(logits, K, 0 if m.arch.gating == "softmax" else 1, m.arch.norm_topk,
                         np.float32(m.expert_weights_scale), bias, lw.router_bias is not None, ids, w)
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

    def vec(self, name: str) -> torch.Tensor:
        return torch.from_numpy(_dequantize(self.m.weights, name).reshape(-1)).to(self.m.device)

    def matrix(self, name: str) -> torch.Tensor:
        return self.m._to_device(name, torch.float32)

    def rope_tables(self, cos: np.ndarray, sin: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(cos).to(self.m.device), torch.from_numpy(sin).to(self.m.device)

    def kv_cache(self, layers, n_seq: int, n_ctx: int) -> KVCache:
        dev = self.m.device
        if self.m.kv_type != "f16":
            raise ValueError(f"engine.kv_type = {self.m.kv_type} runs on the CPU path only (dense = 'quant')")
        k, v = [], []
        for ly in layers:
            kc = torch.zeros((n_seq, n_ctx, ly.n_head_kv, ly.key_dim), dtype=torch.float16, device=dev)
            k.append(kc)
            v.append(kc if ly.latent else torch.zeros((n_seq, n_ctx, ly.n_head_kv, ly.value_dim),
                                                      dtype=torch.float16, device=dev))
        return KVCache(n_seq, n_ctx, k, v, layers)

    def positions(self, pos: list[int]) -> torch.Tensor:
        return torch.as_tensor(pos, dtype=torch.long, device=self.m.device)

    def embed(self, ids: np.ndarray) -> torch.Tensor:
        m = self.m
        return torch.from_numpy(m.ops.get_rows(m.weights.arena, m.tok_embd, ids)).to(m.device)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """As cpu_layers.rms_norm: float64 sum of float32 squares, correctly rounded sqrt
        (torch's float32 sqrt is not)."""
        ss = (x * x).double().sum(-1, keepdim=True)
        mean = (ss / x.shape[-1]).float()
        var = mean + torch.tensor(self.m.p.rms_eps, dtype=torch.float32, device=x.device)
        scale = 1.0 / torch.sqrt(var.double()).float()
        return (x * scale) * w

    def linear(self, lw: LayerWeights, names: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        xd = x.to(self.m.dense_dtype)
        return [(xd @ lw.dense[n].T).float() for n in names]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return (h.to(self.m.dense_dtype) @ self.m.output_dense.T).float()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the first rope_dim dims of each head. x [T, heads, D]."""
        m = self.m
        cos, sin = (c[positions][:, None, :] for c in m._rope_cache)  # [T, 1, R/2]
        r = m.rope_dim
        xr, rest = x[..., :r], x[..., r:]
        if m.arch.rope == "neox":
            a, b = xr[..., : r // 2], xr[..., r // 2 :]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def attention(self, lw: LayerWeights, h: torch.Tensor, positions: torch.Tensor, spans) -> torch.Tensor:
        m, p = self.m, self.m.p
        T = h.shape[0]
        q, k, v = self.linear(lw, ("attn_q", "attn_k", "attn_v"), h)
        q = q.view(T, p.n_head, p.head_dim)  # [T, NH, D]
        k = k.view(T, p.n_head_kv, p.head_dim)  # [T, NKV, D]
        v = v.view(T, p.n_head_kv, p.head_dim_v)
        if m.arch.qk_norm:
            q = self.rmsnorm(q, lw.vecs["attn_q_norm"])
            k = self.rmsnorm(k, lw.vecs["attn_k_norm"])
        q, k = self._rope(q, positions), self._rope(k, positions)
        kc, vc = m.kv.k[lw.index], m.kv.v[lw.index]
        out = torch.empty(T, p.n_head, p.head_dim_v, dtype=torch.float32, device=m.device)
        group = p.n_head // p.n_head_kv
        scale = 1.0 / math.sqrt(p.head_dim)
        for s, a, e, n0 in spans:
            n = e - a
            kc[s, n0 : n0 + n] = k[a:e].to(torch.float16)
            vc[s, n0 : n0 + n] = v[a:e].to(torch.float16)
            keys = kc[s, : n0 + n].float().repeat_interleave(group, dim=1)  # [L, NH, D]
            vals = vc[s, : n0 + n].float().repeat_interleave(group, dim=1)
            qs = q[a:e].to(torch.float16).float()  # ggml computes K·Q with Q converted to f16
            scores = torch.einsum("thd,lhd->htl", qs, keys) * scale  # [NH, n, L]
            if n > 1:
                qpos = torch.arange(n0, n0 + n, device=m.device)[:, None]
                kpos = torch.arange(0, n0 + n, device=m.device)[None, :]
                scores = scores.masked_fill(kpos > qpos, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(torch.float16).float()  # ggml: KQ converted to f16 for V·KQ
            out[a:e] = torch.einsum("htl,lhd->thd", probs, vals)
        (o,) = self.linear(lw, ("attn_output",), out.view(T, -1))
        return o

    def dense_ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        g, u = self.linear(lw, ("ffn_gate", "ffn_up"), h)
        (y,) = self.linear(lw, ("ffn_down",), torch.nn.functional.silu(g) * u)
        return y

    def router_logits(self, lw: LayerWeights, h: torch.Tensor) -> np.ndarray:
        return (h @ lw.router.T).cpu().numpy()

    def route(self, lw: LayerWeights, h: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        m = self.m
        logits = h @ lw.router.T  # [T, E]
        probs = torch.softmax(logits, dim=-1) if m.arch.gating == "softmax" else torch.sigmoid(logits)
        select = probs + lw.router_bias if lw.router_bias is not None else probs
        _, ids = torch.topk(select, m.p.n_expert_used, dim=-1, sorted=True)
        w = probs.gather(-1, ids)
        if m.arch.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        if m.expert_weights_scale != 1.0:
            w = w * m.expert_weights_scale
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
    instead of ``ops.moe``. Choosing ``device``/``dense`` from the config:
    moe_service.engine.device.resolve_device.

    Raises ModelFileError naming the architecture or tensor when the file cannot be run;
    ValueError for ``dense = "quant"`` on a non-CPU device.
    """

    def __init__(
        self, catalog, weights, ops, *, device: str = "cpu", dense: str = "quant", n_seq: int = 4, n_ctx: int = 4096,
        dense_dtype: torch.dtype = torch.float32, offload=None, kv_type: str = "f16", kv_node: int | None = None,
    ):
        p = catalog.params
        if p.arch not in ARCHS:
            raise ModelFileError(f"{catalog.shards[0].path}: architecture {p.arch!r} is not supported (supported: {', '.join(ARCHS)})")
        self.catalog, self.weights, self.ops, self.p = catalog, weights, ops, p
        self.arch = ARCHS[p.arch]
        self.device = torch.device(device)
        if dense == "quant" and self.device.type != "cpu":
            raise ValueError(f"dense = 'quant' runs on the CPU (device {device!r} needs dense = 'torch')")
        self.dense_mode = dense
        self.dense_dtype = dense_dtype
        self.offload = offload
        self.path = CpuPath(self) if dense == "quant" else TorchPath(self)
        md = catalog.metadata
        self.n_ctx = min(n_ctx or p.n_ctx_train, p.n_ctx_train) if p.n_ctx_train else n_ctx
        self.rope_dim = p.rope_dim or p.head_dim
        self.expert_weights_scale = float(md.get(f"{p.arch}.expert_weights_scale", 1.0) or 1.0)
        self.layers = [self._load_layer(i) for i in range(p.n_layer)]
        self.tok_embd = self._qmat("token_embd.weight")
        self.output = self._qmat("output.weight") if "output.weight" in catalog.tensors else self.tok_embd
        self.output_group = (self.output,)
        self.output_norm = self.path.vec("output_norm.weight")
        if dense == "torch":
            self.output_dense = self._to_device(self.output.name)
        self.kv_type, self.kv_node = kv_type, kv_node
        self.kv = self.path.kv_cache(kv.layers_from_params(p), n_seq, self.n_ctx)
        self._rope_cache = self.path.rope_tables(*self._rope_tables())
        self._lock = threading.Lock()

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

    def _load_layer(self, i: int) -> LayerWeights:
        lw = LayerWeights(i)
        t = self.catalog.tensors
        pre = f"blk.{i}."
        names = ["attn_q", "attn_k", "attn_v", "attn_output"]
        dense_ffn = f"{pre}ffn_gate.weight" in t
        if dense_ffn:
            names += ["ffn_gate", "ffn_up", "ffn_down"]
        for n in names:
            lw.mats[n] = self._qmat(f"{pre}{n}.weight")
            if self.dense_mode == "torch":
                lw.dense[n] = self._to_device(f"{pre}{n}.weight")
        for n in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
            if f"{pre}{n}.weight" in t:
                lw.vecs[n] = self.path.vec(f"{pre}{n}.weight")
        if self.arch.qk_norm and not {"attn_q_norm", "attn_k_norm"} <= set(lw.vecs):
            raise ModelFileError(f"{self.catalog.shards[0].path}: layer {i} lacks attn_q_norm/attn_k_norm")
        if f"{pre}ffn_gate_inp.weight" in t:
            lw.router = self.path.matrix(f"{pre}ffn_gate_inp.weight")  # [E, H] float32
            if f"{pre}exp_probs_b.bias" in t:
                lw.router_bias = self.path.vec(f"{pre}exp_probs_b.bias")
            kinds = self.catalog.expert_layers.get(i)
            if not kinds:
                raise ModelFileError(f"{self.catalog.shards[0].path}: layer {i} has a router but no expert tensors")
            lw.experts = ExpertSet(
                layer=i,
                n_expert=self.p.n_expert,
                n_embd=self.p.n_embd,
                n_ff_exp=self.p.n_ff_exp,
                types={k: et.tensor.ggml_type for k, et in kinds.items()},
                copies={k: self.weights.expert_copies(i, k) for k in kinds},
            )
        elif not dense_ffn:
            raise ModelFileError(f"{self.catalog.shards[0].path}: layer {i} has neither a dense FFN nor experts")
        return lw

    def _rope_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [C, rope_dim/2] float32, rounded as ggml's rope cache: theta_scale =
        powf(base, -2/rope_dim); per position p, theta_0 = p and theta_{j+1} = theta_j *
        theta_scale in float32 (not p * base^(-2j/d) exactly); divided by the rope_freqs
        factor when the file has one (llama3); cos/sin correctly rounded to float32."""
        half = self.rope_dim // 2
        theta_scale = np.float32(np.float32(self.p.rope_freq_base) ** np.float32(-2.0 / self.rope_dim))
        theta = np.empty((self.n_ctx, half), dtype=np.float32)
        theta[:, 0] = np.arange(self.n_ctx, dtype=np.float32)
        for j in range(1, half):
            theta[:, j] = theta[:, j - 1] * theta_scale
        if "rope_freqs.weight" in self.catalog.tensors:
            theta = theta / _dequantize(self.weights, "rope_freqs.weight").reshape(1, -1)[:, :half]
        ang = theta.astype(np.float64)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    # -- the step ----------------------------------------------------------------------------

    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward pass. ``batch``: (sequence slot, new token ids) pairs, each sequence at
        most once; its tokens are appended at its current length. Returns float32 logits
        [S, V] on the CPU, row i for the last new token of ``batch[i]``.

        Raises ValueError naming the slot when a sequence would exceed the context.
        """
        with self._lock:
            spans, tokens, pos = [], [], []
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
            path = self.path
            positions = path.positions(pos)
            if self.offload is not None and len(tokens) >= self.offload.min_batch_tokens:
                self.offload.start_step()  # the first MoE layer's slabs start moving during attention
            x = path.embed(np.asarray(tokens, dtype=np.int64))  # [T, H]
            for lw in self.layers:
                x += path.attention(lw, path.rmsnorm(x, lw.vecs["attn_norm"]), positions, spans)
                x += self._ffn(lw, path.rmsnorm(x, lw.vecs["ffn_norm"]))
            last = path.gather_rows(x, [e - 1 for _, _, e, _ in spans])
            logits = path.head(path.rmsnorm(last, self.output_norm))  # [S, V]
            for s, a, e, n0 in spans:
                self.kv.length[s] = n0 + (e - a)
            return path.logits_out(logits)

    def _ffn(self, lw: LayerWeights, h):
        if lw.experts is None:
            return self.path.dense_ffn(lw, h)
        ids, w = self.route(lw, h)
        return self.path.moe(lw, h, ids, w)

    def route(self, lw: LayerWeights, h) -> tuple[np.ndarray, np.ndarray]:
        """Router (REFERENCE.md "MoE routing"): ids int32 [T, K] and weights float32 [T, K]."""
        return self.path.route(lw, h)
