"""The whole Model on a small synthetic MoE GGUF, on the CPU device: the dense "torch" path
(dense matrices dequantized by torch_quant on the device) against the "quant" path, and a big
batch through the expert offload against the same batch through the CPU experts, each with
the reference ops below and with the CPU kernels (moe_service.engine.ops.CpuOps).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_service import gguf_model
from moe_service.engine import torch_quant
from moe_service.engine.model import Model
from moe_service.engine.offload import ExpertOffload
from moe_service.engine.ops import CpuOps
from moe_service.numa import Topology
from moe_service.synth import write_synthetic
from moe_service.weights import WeightStore


class ReferenceOps:
    """The CPU ops contract Model uses (get_rows, matmul, moe), computed the plain way: weights
    dequantized with torch_quant (bit-identical to gguf-py), float32 matmuls, no activation
    quantization. A reference, not the product's kernels."""

    def __init__(self):
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _w(self, arena, offset, ggml_type, rows, cols) -> np.ndarray:
        key = (id(arena), offset)  # weights never change: dequantize each matrix once
        if key not in self._cache:
            n = torch_quant.nbytes_of(ggml_type, (rows, cols))
            raw = torch.from_numpy(arena[offset : offset + n].copy())
            self._cache[key] = torch_quant.dequantize(raw, ggml_type, (rows, cols)).numpy()
        return self._cache[key]

    def get_rows(self, arena, m, ids):
        return self._w(arena, m.offset, m.ggml_type, m.n_rows, m.n_cols)[ids]

    def matmul(self, arena, mats, xs):
        return [xs @ self._w(arena, m.offset, m.ggml_type, m.n_rows, m.n_cols).T for m in mats]

    def moe(self, arena, xs, ids, w, es):
        H, n_ff = es.n_embd, es.n_ff_exp
        out = np.zeros_like(xs)
        for e in np.unique(ids):
            mat = {kind: self._w(arena, int(es.copies[kind][0][e, 0]), es.types[kind], *shape)
                   for kind, shape in (("gate", (n_ff, H)), ("up", (n_ff, H)), ("down", (H, n_ff)))}
            t, k = np.nonzero(ids == e)
            g, u = xs[t] @ mat["gate"].T, xs[t] @ mat["up"].T
            np.add.at(out, t, w[t, k][:, None] * ((g / (1 + np.exp(-g)) * u) @ mat["down"].T))
        return out


def _cpu_kernels():
    """The CPU kernel backend as the engine stage builds it (moe_service.engine.ops.CpuOps)."""
    return CpuOps(Topology.read(), threads=0, fused_moe=True)


def _ops_choices():
    yield pytest.param(ReferenceOps, id="reference-ops")
    yield pytest.param(_cpu_kernels, id="cpu-kernels")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("synth") / "synth.gguf", "tiny-qwen3moe", expert_type="Q4_K")
    catalog = gguf_model.GGUFModel.open(path)
    return catalog, WeightStore.load_simple(catalog)


def rel_l2(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("ops_cls", list(_ops_choices()))
def test_dense_torch_path_gives_the_quant_paths_logits(synth, ops_cls):
    catalog, weights = synth
    ops = ops_cls()
    quant = Model(catalog, weights, ops, device="cpu", dense="quant", n_seq=1, n_ctx=64)
    dense = Model(catalog, weights, ops, device="cpu", dense="torch", n_seq=1, n_ctx=64)
    prompt = [5, 17, 42, 99, 3, 250, 7, 800]
    a = quant.step([(quant.kv.alloc(), prompt)])
    b = dense.step([(dense.kv.alloc(), prompt)])
    assert torch.isfinite(a).all() and a.shape == (1, catalog.params.n_vocab)
    # the reference ops compute the same float32 products as the torch path, summed in another
    # order; the float16 KV cache turns those last-bit differences into ~1e-4. The CPU kernels
    # quantize activations to 8 bits first (as llama.cpp), hence their wider tolerance.
    tol = 1e-3 if ops_cls is ReferenceOps else 3e-2
    assert rel_l2(b, a) < tol
    assert int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("ops_cls", list(_ops_choices()))
def test_big_batch_through_the_offload_matches_the_cpu_experts(synth, ops_cls):
    catalog, weights = synth
    ops = ops_cls()
    model = Model(catalog, weights, ops, device="cpu", dense="torch", n_seq=1, n_ctx=64)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, catalog.params.n_vocab, 40)]
    s = model.kv.alloc()
    ref = model.step([(s, prompt)])
    model.kv.free(s)
    model.offload = ExpertOffload.for_model(model, min_batch_tokens=32)
    s = model.kv.alloc()
    got = model.step([(s, prompt)])
    assert model.offload.stats.layers == 2 and model.offload.stats.prefetched_layers == 2
    tol = 1e-3 if ops_cls is ReferenceOps else 3e-2
    assert rel_l2(got, ref) < tol
    # a decode step (1 token) stays on the CPU experts
    model.step([(s, [3])])
    assert model.offload.stats.layers == 2
