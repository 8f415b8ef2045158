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
placed memory (CPU worker pool, node-homed). Dense matrices (q/k/v/o, dense FFN, output head)
go through the quantized CPU kernels in place (``dense = "quant"``) or, on a GPU host, are
dequantized once to the torch device (``dense = "torch"``). Norms, RoPE, attention and the
router are small torch ops on the dense device.

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

from moe_service.engine import torch_quant
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
    """Everything one transformer block needs: dense QMats, small f32 vectors, experts."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.mats: dict[str, QMat] = {}
        self.vecs: dict[str, torch.Tensor] = {}
        self.dense: dict[str, torch.Tensor] = {}  # dequantized on the torch device (dense="torch")
        self.experts: ExpertSet | None = None
        self.router: torch.Tensor | None = None  # [E, H] float32
        self.router_bias: torch.Tensor | None = None  # [E] selection bias (exp_probs_b)


def _dequantize(weights, name: str) -> np.ndarray:
    """Float32 array in numpy shape (ne reversed) of a whole tensor (small tensors, GPU upload)."""
    from gguf.quants import dequantize

    t = weights.catalog.tensors[name]
    raw = weights.tensor(name)
    return np.ascontiguousarray(dequantize(raw, t.ggml_type).reshape(t.shape).astype(np.float32, copy=False))


# ---------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Float16 K and V per layer: [S_max, C, NKV, D], plus each sequence's length.

    Sequence slots are allocated with :meth:`alloc` and returned with :meth:`free`; a slot's
    rows beyond its length are garbage, never read.
    """

    def __init__(self, n_layer: int, n_seq: int, n_ctx: int, n_kv: int, head_dim: int, device: torch.device):
        shape = (n_seq, n_ctx, n_kv, head_dim)
        self.k = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(n_layer)]
        self.length = [0] * n_seq
        self.n_ctx = n_ctx
        self._free = list(range(n_seq - 1, -1, -1))
        self._lock = threading.Lock()

    def alloc(self) -> int:
        """A free sequence slot (empty). Raises RuntimeError when all are in use."""
        with self._lock:
            if not self._free:
                raise RuntimeError("no free sequence slot in the KV cache")
            s = self._free.pop()
        self.length[s] = 0
        return s

    def free(self, s: int) -> None:
        with self._lock:
            if s not in self._free:
                self._free.append(s)
        self.length[s] = 0

    @property
    def n_free(self) -> int:
        return len(self._free)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


# ---------------------------------------------------------------------------------------------
# The model


class Model:
    """A loaded model ready to compute: :meth:`step` runs one forward pass over a batch of
    sequences (prefill chunks and decode tokens mixed) and returns each one's last logits.

    ``catalog``: GGUFModel; ``weights``: WeightStore over the placed arena; ``ops``: the CPU
    kernel backend (moe_service.engine.ops.CpuOps) used for quantized matmuls and the fused
    MoE; ``device``: torch device of the dense part; ``dense``: "quant" (matmuls in place on
    the CPU) or "torch" (dense matrices dequantized to ``device``); ``n_seq``: sequence slots;
    ``n_ctx``: tokens per sequence. ``dense_dtype``: dtype of the dequantized dense matrices
    with ``dense = "torch"`` (float32 default: the same values as the CPU path's weights;
    bfloat16 halves the GPU memory at ~0.4% relative error per matmul). ``offload``: an
    moe_service.engine.offload.ExpertOffload; batches of at least its ``min_batch_tokens``
    tokens compute their routed experts through it (on the GPU) instead of ``ops.moe``.
    Choosing ``device``/``dense`` from the config: moe_service.engine.device.resolve_device.

    Raises ModelFileError naming the architecture or tensor when the file cannot be run.
    """

    def __init__(
        self, catalog, weights, ops, *, device: str = "cpu", dense: str = "quant", n_seq: int = 4, n_ctx: int = 4096,
        dense_dtype: torch.dtype = torch.float32, offload=None,
    ):
        p = catalog.params
        if p.arch not in ARCHS:
            raise ModelFileError(f"{catalog.shards[0].path}: architecture {p.arch!r} is not supported (supported: {', '.join(ARCHS)})")
        self.catalog, self.weights, self.ops, self.p = catalog, weights, ops, p
        self.arch = ARCHS[p.arch]
        self.device = torch.device(device)
        self.dense_mode = dense
        self.dense_dtype = dense_dtype
        self.offload = offload
        md = catalog.metadata
        self.n_ctx = min(n_ctx or p.n_ctx_train, p.n_ctx_train) if p.n_ctx_train else n_ctx
        self.rope_dim = p.rope_dim or p.head_dim
        self.expert_weights_scale = float(md.get(f"{p.arch}.expert_weights_scale", 1.0) or 1.0)
        self.layers = [self._load_layer(i) for i in range(p.n_layer)]
        self.tok_embd = self._qmat("token_embd.weight")
        self.output = self._qmat("output.weight") if "output.weight" in catalog.tensors else self.tok_embd
        self.output_norm = self._vec("output_norm.weight")
        if dense == "torch":
            self.output_dense = self._to_device(self.output.name)
        self.kv = KVCache(p.n_layer, n_seq, self.n_ctx, p.n_head_kv, p.head_dim, self.device)
        self._rope_cache = self._rope_tables()
        self._lock = threading.Lock()

    # -- loading --------------------------------------------------------------------------

    def _qmat(self, name: str) -> QMat:
        t = self.catalog.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.catalog.shards[0].path}: tensor {name!r} is missing")
        if len(t.shape) != 2:
            raise ModelFileError(f"{self.catalog.shards[0].path}: tensor {name!r} should be 2-D (shape {t.shape})")
        return QMat(name, self.weights.tensor_offset(name), t.ggml_type, t.shape[0], t.shape[1])

    def _vec(self, name: str) -> torch.Tensor:
        return torch.from_numpy(_dequantize(self.weights, name).reshape(-1)).to(self.device)

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
                lw.vecs[n] = self._vec(f"{pre}{n}.weight")
        if self.arch.qk_norm and not {"attn_q_norm", "attn_k_norm"} <= set(lw.vecs):
            raise ModelFileError(f"{self.catalog.shards[0].path}: layer {i} lacks attn_q_norm/attn_k_norm")
        if f"{pre}ffn_gate_inp.weight" in t:
            lw.router = self._to_device(f"{pre}ffn_gate_inp.weight", torch.float32)  # [E, H]
            if f"{pre}exp_probs_b.bias" in t:
                lw.router_bias = self._vec(f"{pre}exp_probs_b.bias")
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

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [C, rope_dim/2] float32 for positions 0..C-1 (theta_j = base^(-2j/rope_dim))."""
        half = self.rope_dim // 2
        inv = 1.0 / (self.p.rope_freq_base ** (torch.arange(0, half, dtype=torch.float64) * 2 / self.rope_dim))
        if "rope_freqs.weight" in self.catalog.tensors:  # llama3-style per-dimension factors
            inv = inv / torch.from_numpy(_dequantize(self.weights, "rope_freqs.weight").astype(np.float64))
        ang = torch.arange(self.n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
        return torch.cos(ang).float().to(self.device), torch.sin(ang).float().to(self.device)

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
            ids = np.asarray(tokens, dtype=np.int64)
            positions = torch.as_tensor(pos, dtype=torch.long, device=self.device)
            if self.offload is not None and len(tokens) >= self.offload.min_batch_tokens:
                self.offload.start_step()  # the first MoE layer's slabs start moving during attention
            x = torch.from_numpy(self.ops.get_rows(self.weights.arena, self.tok_embd, ids)).to(self.device)  # [T, H]
            for lw in self.layers:
                x = x + self._attention(lw, self._rmsnorm(x, lw.vecs["attn_norm"]), positions, spans)
                x = x + self._ffn(lw, self._rmsnorm(x, lw.vecs["ffn_norm"]))
            last = torch.as_tensor([e - 1 for _, _, e, _ in spans], device=self.device)
            h = self._rmsnorm(x[last], self.output_norm)  # [S, H]
            if self.dense_mode == "torch":
                logits = (h.to(self.dense_dtype) @ self.output_dense.T).float()
            else:
                (logits,) = self._matmul([self.output], h)
            for s, a, e, n0 in spans:
                self.kv.length[s] = n0 + (e - a)
            return logits.float().cpu()

    # -- pieces ------------------------------------------------------------------------------

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * w, over the last axis (as ggml_rms_norm then ggml_mul)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.p.rms_eps) * w

    def _matmul(self, mats: list[QMat], x: torch.Tensor, names: list[str] | None = None, lw: LayerWeights | None = None) -> list[torch.Tensor]:
        """x [T, n_cols] times each weight's transpose -> [T, n_rows] each (one dispatch)."""
        if self.dense_mode == "torch":
            xd = x.to(self.dense_dtype)
            return [(xd @ lw.dense[n].T).float() for n in names]
        xs = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        outs = self.ops.matmul(self.weights.arena, mats, xs)
        return [torch.from_numpy(o).to(self.device) for o in outs]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the first rope_dim dims of each head. x [T, heads, D]."""
        cos, sin = (c[positions][:, None, :] for c in self._rope_cache)  # [T, 1, R/2]
        r = self.rope_dim
        xr, rest = x[..., :r], x[..., r:]
        if self.arch.rope == "neox":
            a, b = xr[..., : r // 2], xr[..., r // 2 :]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def _attention(self, lw: LayerWeights, h: torch.Tensor, positions: torch.Tensor, spans) -> torch.Tensor:
        p = self.p
        T = h.shape[0]
        names = ["attn_q", "attn_k", "attn_v"]
        q, k, v = self._matmul([lw.mats[n] for n in names], h, names, lw)
        q = q.view(T, p.n_head, p.head_dim)  # [T, NH, D]
        k = k.view(T, p.n_head_kv, p.head_dim)  # [T, NKV, D]
        v = v.view(T, p.n_head_kv, p.head_dim_v)
        if self.arch.qk_norm:
            q = self._rmsnorm(q, lw.vecs["attn_q_norm"])
            k = self._rmsnorm(k, lw.vecs["attn_k_norm"])
        q = self._rope(q, positions)
        k = self._rope(k, positions)
        kc, vc = self.kv.k[lw.index], self.kv.v[lw.index]
        out = torch.empty(T, p.n_head, p.head_dim_v, dtype=torch.float32, device=self.device)
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
                qpos = torch.arange(n0, n0 + n, device=self.device)[:, None]
                kpos = torch.arange(0, n0 + n, device=self.device)[None, :]
                scores = scores.masked_fill(kpos > qpos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[a:e] = torch.einsum("htl,lhd->thd", probs, vals)
        (o,) = self._matmul([lw.mats["attn_output"]], out.view(T, -1), ["attn_output"], lw)
        return o

    def _ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        if lw.experts is None:
            names = ["ffn_gate", "ffn_up"]
            g, u = self._matmul([lw.mats[n] for n in names], h, names, lw)
            (y,) = self._matmul([lw.mats["ffn_down"]], torch.nn.functional.silu(g) * u, ["ffn_down"], lw)
            return y
        ids, w = self.route(lw, h)
        if self.offload is not None and h.shape[0] >= self.offload.min_batch_tokens:
            return self.offload.moe(lw.experts, h, ids, w)  # [T, H] float32 on the device
        xs = np.ascontiguousarray(h.detach().cpu().numpy(), dtype=np.float32)
        y = self.ops.moe(self.weights.arena, xs, ids, w, lw.experts)
        return torch.from_numpy(y).to(self.device)

    def route(self, lw: LayerWeights, h: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Router (REFERENCE.md "MoE routing"): ids int32 [T, K] and weights float32 [T, K]."""
        logits = h @ lw.router.T  # [T, E]
        probs = torch.softmax(logits, dim=-1) if self.arch.gating == "softmax" else torch.sigmoid(logits)
        select = probs + lw.router_bias if lw.router_bias is not None else probs
        _, ids = torch.topk(select, self.p.n_expert_used, dim=-1, sorted=True)
        w = probs.gather(-1, ids)
        if self.arch.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        if self.expert_weights_scale != 1.0:
            w = w * self.expert_weights_scale
        return (
            np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int32),
            np.ascontiguousarray(w.float().cpu().numpy(), dtype=np.float32),
        )
