"""Prefill expert offload: big batches stream each MoE layer's expert slabs to the GPU.

Decode and small batches compute routed experts on the CPU nodes that hold them (the bytes
read per token are few; moving them over PCIe would cost more). A prefill batch of T >=
``engine.offload_min_batch_tokens`` tokens (2048 by default) reads every expert of every layer
many times over, so copying the layer's slabs once to the GPU and computing there wins:
PCIe at ~50 GB/s (pinned) moves a Qwen3-30B-A3B layer (128 x 3 x 768 x 2048 Q4_K, ~340 MB)
in ~7 ms, far less than the CPU needs for 2048 tokens x 8 experts.

Shapes: T tokens, H hidden, K experts per token, E experts, I expert width, G experts in one
dequantization group.

::

    per MoE layer l (buffers b = l % 2, two of them):
      copy     side stream: slabs of layer l, arena (pinned, in place) -> staging[b]   uint8, H2D
               issued while layer l-1 computes (prefetch), or right after routing when only
               the selected experts are copied; waits until layer l-2 released staging[b]
      route    (the model, on the device) ids [T, K] int32, weights [T, K] float32
      group    pairs (token, slot) sorted by expert: tok [T*K], x_sorted = x[tok] [T*K, H]
      experts  compute stream, after the copy's event; G experts at a time:
               dequantize (torch_quant) gate/up/down [G, I, H] / [G, H, I] -> compute dtype
               per expert e: y = act(x_e Wg^T + bg, x_e Wu^T + bu) Wd^T + bd  [n_e, H]
               (act and biases: the architecture's, carried by the ExpertSet: SiLU*up, or
               gpt-oss' clamped SwiGLU with per-expert biases)
      combine  out.index_add_(0, tok, y_sorted * w_sorted)                    [T, H] float32
      release  record "staging[b] free" on the compute stream

On the CPU device (tests, hosts without a GPU) the same code runs with synchronous copies and
no streams: the staging, grouping and arithmetic are exercised exactly.

Numerics: float32 compute matches a float32 reference to rounding (tests); bfloat16 (the
default on CUDA: tensor-core GEMMs) rounds weights and activations to 8 significant bits, so
a layer's output differs from the float32 one by about 0.5% relative (L2), below the
difference between the CPU kernels (8-bit quantized activations, as llama.cpp) and float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_service.engine import torch_quant
from moe_service.log import get_logger
from moe_service.sizes import GiB

log = get_logger(__name__)

KINDS = ("gate", "up", "down", "gate_up")
ACT_SILU = 0  # moe.ACT_SILU
ACT_SWIGLU_OAI = 1  # moe.ACT_SWIGLU_OAI
ACT_SWIGLU_CLAMP = 2  # moe.ACT_SWIGLU_CLAMP (deepseek4)


def expert_act(act: tuple, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The architecture's expert activation with torch ops, as moe.act_value: silu(g) * u, or
    gpt-oss' clamped SwiGLU min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, +-limit) + 1).
    ``act``: (kind, alpha, limit)."""
    kind, alpha, limit = act
    if kind == ACT_SILU:
        return torch.nn.functional.silu(g) * u
    x = g.clamp(max=limit)
    if kind == ACT_SWIGLU_CLAMP:
        return torch.nn.functional.silu(x) * u.clamp(min=-limit, max=limit)
    return x * torch.sigmoid(alpha * x) * (u.clamp(min=-limit, max=limit) + 1.0)


def _kind_shape(kind: str, n_embd: int, n_ff_exp: int) -> tuple[int, int]:
    """(rows, cols) of one expert's matrix of this kind: gate/up [I, H], down [H, I],
    gate_up [2I, H] (gate rows first)."""
    if kind == "down":
        return n_embd, n_ff_exp
    if kind == "gate_up":
        return 2 * n_ff_exp, n_embd
    return n_ff_exp, n_embd


@dataclass(frozen=True)
class _KindPlan:
    """Where one kind's slabs go in a staging buffer: expert e at ``base + e * slab_bytes``."""

    kind: str
    ggml_type: int
    rows: int
    cols: int
    slab_bytes: int
    base: int


@dataclass(frozen=True)
class _LayerPlan:
    layer: int
    n_expert: int
    kinds: tuple[_KindPlan, ...]
    src: dict  # kind -> int64 [E] arena offset of each expert's primary slab
    nbytes: int
    act: tuple = (ACT_SILU, 1.702, 7.0)  # the architecture's activation: (kind, alpha, limit)
    biases: dict | None = None  # kind -> float32 tensor [E, rows] on the device (gpt-oss expert biases)


@dataclass
class OffloadStats:
    """Counters since construction: layers computed, bytes copied H2D, copy calls."""

    layers: int = 0
    copied_bytes: int = 0
    copy_calls: int = 0
    prefetched_layers: int = 0
    ready_layers: int = 0  # layers whose slabs were already in staging when their compute began


class ExpertOffload:
    """Computes MoE layers of big batches on ``device`` from slabs streamed out of the arena.

    ``arena``: the uint8 numpy array the experts live in (pinned by the pin stage for fast,
    asynchronous copies; pageable works, slower and synchronous). ``expert_sets``: the model's
    ExpertSet per MoE layer, in layer order (moe_service.engine.model.ExpertSet).
    ``device``: torch device ("cuda:0"; "cpu" runs the same logic without streams).
    ``min_batch_tokens``: batches this big or bigger are offloaded (Model._ffn checks).
    ``compute_dtype``: dtype of dequantized weights and GEMMs (default bfloat16 on CUDA,
    float32 elsewhere). ``only_selected``: copy only the experts the batch routes to (no
    cross-layer prefetch then: the selection is known only after routing). ``prefetch``: copy
    layer l+1 while layer l computes. ``group_bytes``: most bytes of dequantized weights alive
    at once. Staging memory: two buffers of the largest layer's expert bytes, allocated on
    first use (:meth:`reserve` allocates them at once).
    """

    def __init__(
        self,
        arena: np.ndarray,
        expert_sets: list,
        device: str | torch.device,
        *,
        min_batch_tokens: int = 2048,
        compute_dtype: torch.dtype | None = None,
        only_selected: bool = False,
        prefetch: bool = True,
        group_bytes: int = GiB,
        pins=None,
    ):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.min_batch_tokens = int(min_batch_tokens)
        self.compute_dtype = compute_dtype or (torch.bfloat16 if self.cuda else torch.float32)
        self.only_selected = only_selected
        self.prefetch = prefetch and not only_selected
        self.group_bytes = int(group_bytes)
        self.arena = arena
        self.host = torch.from_numpy(arena)  # no copy: a CPU tensor over the placed memory
        self.plans = [self._plan(es) for es in expert_sets]
        self.index = {p.layer: i for i, p in enumerate(self.plans)}
        self.buffer_bytes = max((p.nbytes for p in self.plans), default=0)
        self.staging: list[torch.Tensor | None] = [None, None]
        self.tags: list[tuple | None] = [None, None]  # (plan index, experts copied or None = all)
        self.stats = OffloadStats()
        self.pins = pins
        self._warned_pageable = False
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            self.released = [torch.cuda.Event(), torch.cuda.Event()]

    @classmethod
    def for_model(cls, model, **kwargs) -> ExpertOffload:
        """The offload for a moe_service.engine.model.Model: its arena, its MoE layers, its
        device. kwargs as the constructor's."""
        sets = [lw.experts for lw in model.layers if lw.experts is not None]
        return cls(model.weights.arena, sets, model.device, **kwargs)

    # -- planning ----------------------------------------------------------------------------

    def _plan(self, es) -> _LayerPlan:
        kinds, base = [], 0
        src = {}
        for kind in KINDS:
            if kind not in es.copies:
                continue
            rows, cols = _kind_shape(kind, es.n_embd, es.n_ff_exp)
            slab = torch_quant.nbytes_of(es.types[kind], (rows, cols))
            kinds.append(_KindPlan(kind, int(es.types[kind]), rows, cols, slab, base))
            offsets = np.asarray(es.copies[kind][0])
            src[kind] = offsets[:, 0].astype(np.int64)
            if (src[kind] < 0).any():
                raise ValueError(f"layer {es.layer}: an expert of kind {kind} has no primary copy")
            base += es.n_expert * slab
        if not ({"gate", "up", "down"} <= {k.kind for k in kinds} or {"gate_up", "down"} <= {k.kind for k in kinds}):
            raise ValueError(f"layer {es.layer}: expert kinds {sorted(es.copies)} lack gate/up/down")
        act = (int(getattr(es, "act", ACT_SILU)), float(getattr(es, "alpha", 1.702)), float(getattr(es, "limit", 7.0)))
        biases = {}
        for kind, off in (getattr(es, "biases", None) or {}).items():
            rows = {"down": es.n_embd, "gate_up": 2 * es.n_ff_exp}.get(kind, es.n_ff_exp)
            n = es.n_expert * rows
            raw = self.arena[int(off): int(off) + 4 * n].view(np.float32).reshape(es.n_expert, rows)
            biases[kind] = torch.from_numpy(raw.copy()).to(self.device)
        return _LayerPlan(es.layer, es.n_expert, tuple(kinds), src, base, act, biases or None)

    def reserve(self) -> int:
        """Allocate both staging buffers now; returns their bytes together."""
        for b in (0, 1):
            self._buffer(b)
        return 2 * self.buffer_bytes

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self.staging[b]
        if buf is None:
            buf = self.staging[b] = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        return buf

    # -- copying -----------------------------------------------------------------------------

    def _runs(self, plan: _LayerPlan, experts: np.ndarray) -> list[tuple[int, int, int]]:
        """(staging offset, arena offset, bytes) copies for ``experts`` (sorted ids) of every
        kind, neighbours merged when their slabs are adjacent in the arena."""
        runs: list[tuple[int, int, int]] = []
        for k in plan.kinds:
            src = plan.src[k.kind]
            run = None
            for e in experts:
                dst, s = k.base + int(e) * k.slab_bytes, int(src[e])
                if run is not None and run[0] + run[2] == dst and run[1] + run[2] == s:
                    run[2] += k.slab_bytes
                else:
                    if run is not None:
                        runs.append((run[0], run[1], run[2]))
                    run = [dst, s, k.slab_bytes]
            if run is not None:
                runs.append((run[0], run[1], run[2]))
        return runs

    def _issue_copy(self, i: int, b: int, experts: np.ndarray | None) -> None:
        """Copy layer ``i``'s slabs (``experts`` ids, None = all) into staging buffer ``b``."""
        plan = self.plans[i]
        ids = np.arange(plan.n_expert) if experts is None else experts
        runs = self._runs(plan, ids)
        dst = self._buffer(b)
        if self.pins is not None and not self._warned_pageable:
            if not all(self.pins.covers(s, n) for _, s, n in runs):
                self._warned_pageable = True
                log.warning("offload_pageable_source", layer=plan.layer,
                            detail="expert slabs outside the pinned regions: copies are synchronous and slower")
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.released[b])
                for d, s, n in runs:
                    dst[d : d + n].copy_(self.host[s : s + n], non_blocking=True)
                self.copied[b].record(self.copy_stream)
        else:
            for d, s, n in runs:
                dst[d : d + n].copy_(self.host[s : s + n])
        self.tags[b] = (i, None if experts is None else frozenset(int(e) for e in experts))
        self.stats.copy_calls += len(runs)
        self.stats.copied_bytes += sum(n for _, _, n in runs)

    def _has(self, b: int, i: int, experts: np.ndarray) -> bool:
        tag = self.tags[b]
        if tag is None or tag[0] != i:
            return False
        return tag[1] is None or set(int(e) for e in experts) <= tag[1]

    def forget(self) -> None:
        """Treat both staging buffers as empty: every layer is copied again (benchmarks that
        must not profit from a model short enough to stay staged between prompts)."""
        self.tags = [None, None]

    def start_step(self) -> None:
        """Begin copying the first MoE layer of a big batch now (before its attention runs)."""
        if self.plans and self.prefetch and not self._has(0, 0, np.arange(0)):
            self._issue_copy(0, 0, None)
            self.stats.prefetched_layers += 1

    # -- computing ---------------------------------------------------------------------------

    def moe(self, es, h: torch.Tensor, ids: np.ndarray, weights: np.ndarray) -> torch.Tensor:
        """The routed experts' output for one layer: float32 [T, H] on ``device``.

        ``es``: that layer's ExpertSet; ``h``: the normed hidden states [T, H] on ``device``;
        ``ids``: int32 [T, K] expert ids; ``weights``: float32 [T, K] (as Model.route).
        """
        i = self.index[es.layer]
        T, H = h.shape
        assert ids.shape == weights.shape and ids.shape[0] == T, (ids.shape, weights.shape, h.shape)
        plan = self.plans[i]
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T*K]
        counts = np.bincount(flat, minlength=plan.n_expert)
        selected = np.nonzero(counts)[0]
        b = i % 2
        if self._has(b, i, selected):
            self.stats.ready_layers += 1  # prefetched, or still there from an earlier step
        else:
            self._issue_copy(i, b, selected if self.only_selected else None)
        if self.prefetch and i + 1 < len(self.plans) and not self._has(1 - b, i + 1, np.arange(0)):
            self._issue_copy(i + 1, 1 - b, None)  # overlaps this layer's compute
            self.stats.prefetched_layers += 1
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[b])
        out = self._compute(plan, self._buffer(b), h, flat, np.asarray(weights, dtype=np.float32).reshape(-1),
                            counts, selected, ids.shape[1])
        if self.cuda:
            self.released[b].record(torch.cuda.current_stream(self.device))
        self.stats.layers += 1
        return out

    def _dequant(self, k: _KindPlan, buf: torch.Tensor, group: np.ndarray) -> torch.Tensor:
        """[G, rows, cols] compute dtype for the experts in ``group`` (sorted ids)."""
        view = buf[k.base :].narrow(0, 0, (int(group[-1]) + 1) * k.slab_bytes).view(-1, k.slab_bytes)
        if len(group) == int(group[-1]) - int(group[0]) + 1:
            raw = view[int(group[0]) :]  # a contiguous range of experts: no gather
        else:
            raw = view.index_select(0, torch.as_tensor(group, dtype=torch.long, device=buf.device))
        return torch_quant.dequantize(raw.contiguous(), k.ggml_type, (len(group), k.rows, k.cols), self.compute_dtype)

    def _compute(self, plan: _LayerPlan, buf, h, flat, w_flat, counts, selected, K) -> torch.Tensor:
        T, H = h.shape
        dev = self.device
        order = np.argsort(flat, kind="stable")  # pairs grouped by expert
        starts = np.concatenate([[0], np.cumsum(counts)])
        tok = torch.from_numpy((order // K).astype(np.int64)).to(dev)  # [T*K] token of each pair
        w_sorted = torch.from_numpy(np.ascontiguousarray(w_flat[order])).to(dev)  # [T*K]
        x_sorted = h.index_select(0, tok).to(self.compute_dtype)  # [T*K, H]
        y_sorted = torch.empty(flat.shape[0], H, dtype=self.compute_dtype, device=dev)
        kinds = {k.kind: k for k in plan.kinds}
        per_expert = sum(k.rows * k.cols for k in plan.kinds) * torch.tensor([], dtype=self.compute_dtype).element_size()
        g_max = max(1, self.group_bytes // max(per_expert, 1))
        for g0 in range(0, len(selected), g_max):
            group = selected[g0 : g0 + g_max]
            mats = {name: self._dequant(k, buf, group) for name, k in kinds.items()}
            for j, e in enumerate(group):
                a, z = int(starts[e]), int(starts[e + 1])
                xe = x_sorted[a:z]  # [n_e, H]
                b = plan.biases
                if "gate_up" in mats:
                    gu = xe @ mats["gate_up"][j].T  # [n_e, 2I]
                    if b and "gate_up" in b:
                        gu = gu + b["gate_up"][e].to(gu.dtype)
                    g, u = gu.chunk(2, dim=-1)
                else:
                    g = xe @ mats["gate"][j].T  # [n_e, I]
                    u = xe @ mats["up"][j].T
                    if b and "gate" in b:
                        g = g + b["gate"][e].to(g.dtype)
                    if b and "up" in b:
                        u = u + b["up"][e].to(u.dtype)
                y = expert_act(plan.act, g, u) @ mats["down"][j].T  # [n_e, H]
                if b and "down" in b:
                    y = y + b["down"][e].to(y.dtype)
                y_sorted[a:z] = y
        out = torch.zeros(T, H, dtype=torch.float32, device=dev)
        out.index_add_(0, tok, y_sorted.float() * w_sorted[:, None])
        return out
