"""Dense qwen2 (Q/K/V biases) and qwen3 (q/k norms) against llama.cpp (tests/fixtures/golden/
qwen-dense.json, tools/make_golden.py --only qwen-dense; no llama.cpp needed here).

The synthetic presets (moe_service.synth tiny-qwen2, tiny-qwen3) use the decisive scales
(synth._DECISIVE): every greedy step of llama.cpp's 48-token chain leads by at least
``min_gap_required`` = 2.0 logits (measured minima: 7.03 for qwen2 at seed 1, 12.78 for qwen3
at seed 0), 4x and more the logit tolerance, so the chains must be identical token for token
with no allowance. Tolerances (max, mean |difference|), the same as test_golden.py's TINY
for the 2-layer synthetic models: last prompt token (batched prefill) and, after the chain
was decoded token by token, the last chain token's logits (48 decode steps of KV cache).
Measured (max / mean): qwen2 CPU path 0.14 / 0.026 (prompt), 0.16 / 0.031 (after the
chain); torch path (dense = "torch": float32 dequantized matrices, no 8-bit activation
quantization) 0.20 / 0.036, 0.19 / 0.038; qwen3 CPU 0.19 / 0.041, 0.14 / 0.029; torch
0.20 / 0.039, 0.21 / 0.041. Both paths are held to TINY.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_service.engine.model import Model
from moe_service.gguf_model import GGUFModel
from moe_service.weights import WeightStore
from tests.fixtures.golden import GOLDEN_DIR, GoldenModel, model_file

TINY = (0.5, 0.1)
MANIFEST = json.loads((GOLDEN_DIR / "qwen-dense.json").read_text())
NAMES = sorted(MANIFEST["models"])


def _golden(name: str) -> tuple[GoldenModel, np.ndarray]:
    m = MANIFEST["models"][name]
    g = GoldenModel(name=name, source=m["source"], sha256=m["sha256"], file_bytes=m["file_bytes"],
                    prompt_text=m["prompt_text"], prompt_ids=list(m["prompt_ids"]),
                    logits=np.load(GOLDEN_DIR / m["logits_file"]), greedy_ids=list(m["greedy_ids"]),
                    greedy_gaps=list(m["greedy_top1_top2_gap"]), self_deviation=m["llama_cpp_self_deviation"],
                    logits_stats=m["logits_stats"])
    return g, np.load(GOLDEN_DIR / m["after_chain_logits_file"])


@pytest.mark.parametrize("dense", ["quant", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_dense_qwen_matches_llama_cpp(name, dense, ops, tmp_path_factory):
    g, after = _golden(name)
    assert min(g.greedy_gaps) >= MANIFEST["settings"]["min_gap_required"]
    cat = GGUFModel.open(model_file(g, tmp_path_factory.mktemp(name)))
    assert cat.params.arch == g.source["preset"].split("-")[1] and cat.params.n_expert == 0
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=len(g.prompt_ids) + 64, dense=dense)
    s = model.kv.alloc()
    logits = model.step([(s, g.prompt_ids)])[0].numpy()
    chain = [int(np.argmax(logits))]
    while True:
        last = model.step([(s, [chain[-1]])])[0].numpy()
        if len(chain) == len(g.greedy_ids):
            break
        chain.append(int(np.argmax(last)))
    tol_max, tol_mean = TINY
    for what, ours, ref in (("prompt", logits, g.logits), ("after the chain", last, after)):
        diff = np.abs(ours - ref)
        assert np.isfinite(ours).all()
        assert diff.max() <= tol_max and diff.mean() <= tol_mean, (
            f"{name} {dense} {what}: max {diff.max():.3f} mean {diff.mean():.3f}")
    assert chain == g.greedy_ids
