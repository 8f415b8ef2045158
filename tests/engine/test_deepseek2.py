"""deepseek2 (DeepSeek V3/R1, Kimi K2) against llama.cpp's goldens, the float64 reference,
and across the two dense paths.

Fixtures (tests/fixtures/golden, tools/make_golden.py --only deepseek2): synthetic 3-layer
models (1 dense + 2 MoE layers) in the split MLA form (V3/R1 routing: sigmoid, selection
bias, 4 groups of 4 with 2 used, top-4, normalised x2.5, one shared expert, YaRN x40), the
legacy ``attn_kv_b`` form, and the V2-Lite form (no q_lora, softmax, no groups, 2 shared
experts, mscale 0.707), each with Q4_K and Q8_0 experts.

Tolerances (measured, see the report in docs and the README of the fixtures):

- logits: max |diff| <= DS2[0], mean <= DS2[1] against llama.cpp (``TIE`` when our prefill
  meets a routing near-tie: a selection margin below ROUTE_TIE lets either engine pick the
  other expert);
- greedy chains: identical, except that a chain may part where llama.cpp's own top-1/top-2
  gap is below the logit max tolerance (a coin toss for either engine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_service.engine.arch.base import GATING_SIGMOID
from moe_service.engine.model import Model
from moe_service.engine.ops import CpuOps
from moe_service.gguf_model import GGUFModel
from moe_service.weights import WeightStore
from tests.engine import ds2_reference
from tests.fixtures.golden import golden_model, golden_model_names, model_file

DS2 = (1.0, 0.2)  # max, mean |logit difference| vs llama.cpp
TIE = (4.0, 1.0)
ROUTE_TIE = 2e-3  # selection-score margin (k-th vs (k+1)-th, or the last kept group) below which engines may differ

NAMES = [n for n in golden_model_names() if golden_model(n).source.get("arch") == "deepseek2"]


@pytest.fixture(scope="module")
def ops():
    torch.set_num_threads(1)
    o = CpuOps(threads=0)
    yield o
    o.close()


def _selection_margin(model, lw, h) -> float:
    """Smallest margin of the routing decision of any token: between the k-th and (k+1)-th
    selection score among kept experts, and between the last kept and first dropped group."""
    hp = model.arch.hp
    logits = model.path.router_logits(lw, h).astype(np.float64)
    if hp.gating == GATING_SIGMOID:
        p = 1 / (1 + np.exp(-logits))
    else:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    bias = lw.router_bias
    sel = p + (np.asarray(bias, dtype=np.float64) if bias is not None else 0.0)
    T, E = sel.shape
    margins = []
    if hp.n_group > 1:
        g = sel.reshape(T, hp.n_group, E // hp.n_group)
        gs = -np.sort(-np.sort(g, -1)[..., -2:].sum(-1), -1)
        margins.append(float((gs[:, hp.n_group_used - 1] - gs[:, hp.n_group_used]).min()))
        keep = np.argsort(-np.sort(g, -1)[..., -2:].sum(-1), -1)[:, : hp.n_group_used]
        drop = np.ones((T, hp.n_group), bool)
        np.put_along_axis(drop, keep, False, 1)
        sel = np.where(drop[:, :, None], -np.inf, g).reshape(T, E)
    s = -np.sort(-sel, -1)
    k = model.routing.k
    margins.append(float((s[:, k - 1] - s[:, k]).min()))
    return min(margins)


def _run(g, path, ops, dense="quant"):
    cat = GGUFModel.open(path)
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=len(g.prompt_ids) + 64, dense=dense)
    margins = [np.inf]
    route = model.route

    def recording_route(lw, h):
        margins.append(_selection_margin(model, lw, h))
        return route(lw, h)

    model.route = recording_route
    s = model.kv.alloc()
    logits = model.step([(s, g.prompt_ids)])[0].numpy()
    model.route = route
    chain = [int(np.argmax(logits))]
    while len(chain) < len(g.greedy_ids):
        chain.append(int(np.argmax(model.step([(s, [chain[-1]])])[0].numpy())))
    return logits, chain, min(margins)


@pytest.mark.parametrize("name", NAMES)
def test_deepseek2_logits_and_greedy_chain_match_llama_cpp(name, ops, tmp_path_factory):
    g = golden_model(name)
    path = model_file(g, tmp_path_factory.mktemp(name))
    logits, chain, margin = _run(g, path, ops)
    tol_max, tol_mean = DS2 if margin >= ROUTE_TIE else TIE
    diff = np.abs(logits - g.logits)
    assert np.isfinite(logits).all()
    assert diff.max() <= tol_max and diff.mean() <= tol_mean, (
        f"{name}: max {diff.max():.3f} mean {diff.mean():.3f} (routing margin {margin:.2g})")
    i = next((i for i, (a, b) in enumerate(zip(chain, g.greedy_ids, strict=True)) if a != b), None)
    if i is not None:
        assert g.greedy_gaps[i] < DS2[0], (
            f"{name}: greedy chain parts from llama.cpp's at step {i} ({chain[i]} vs {g.greedy_ids[i]}) "
            f"where llama.cpp's top-1/top-2 gap is {g.greedy_gaps[i]:.3f} (>= {DS2[0]})")


@pytest.mark.parametrize("preset", ["tiny-deepseek2", "tiny-deepseek2-legacy", "tiny-deepseek2-lite"])
def test_deepseek2_paths_agree_with_float64(preset, ops, tmp_path):
    """The CPU path (8-bit activations as ggml) and the torch path (float activations) against
    a float64 reference that expands K and V per head (no absorption)."""
    from moe_service.synth_deepseek2 import write_deepseek2

    path = write_deepseek2(tmp_path / f"{preset}.gguf", preset, expert_type="Q8_0", seed=11, n_layer=2)
    cat = GGUFModel.open(path)
    ws = WeightStore.load_simple(cat)
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, 8000, 17)]
    out = {}
    for dense in ("quant", "torch"):
        model = Model(cat, ws, ops, n_seq=1, n_ctx=64, dense=dense)
        s = model.kv.alloc()
        out[dense] = model.step([(s, prompt[:-1])])[0].numpy()
        out[dense + "_decode"] = model.step([(s, prompt[-1:])])[0].numpy()
    ref = ds2_reference.forward(cat, ws, model.arch, prompt)
    for dense, (tmax, tmean) in (("torch", (0.15, 0.03)), ("quant", (1.2, 0.25))):
        for key, row in ((dense, -2), (dense + "_decode", -1)):
            d = np.abs(out[key] - ref[row])
            assert d.max() < tmax and d.mean() < tmean, (key, d.max(), d.mean())
