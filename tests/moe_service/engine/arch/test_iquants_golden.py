"""Mixed i-quant files (UD-like recipes: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ4_NL experts, a layer at Q4_K, attention at Q8_0 / Q6_K) against llama.cpp's goldens.

Fixtures: tests/fixtures/golden/iquants.json (tools/make_golden.py --only iquants): a 4-layer
qwen3moe (tiny-qwen3moe-decisive) and a 3-layer deepseek2 (tiny-deepseek2: one dense layer,
two MoE layers, split MLA), each expert tensor of a layer in another format, a ~90-token
prompt, the seed of IQUANT_SEEDS with the most decisive 48-token greedy chain.

Compared as the other goldens of their architecture (test_golden.py's TINY bound for the
qwen3moe file, test_deepseek2.py's DS2 / DS2_TORCH for the deepseek2 file): last-prompt
logits (batched prefill), the 48-token greedy chain (identical, except at a step where
llama.cpp's own top-1 / top-2 gap is below the logit bound), and, when the chains agree, the
logits after the chain (the decode path). The i-quant kernels sum as ggml's AVX2 kernels do
(integer dot per sub-block, odd scales, 1/8 or 1/4 folded exactly into d; IQ1_M's delta as
8 g +- 1: float32 rounding apart from ggml's second accumulator).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine.model import Model
from moe_service.gguf_model import GGUFModel
from moe_service.weights import WeightStore
from tests.fixtures.golden import GOLDEN_DIR, arch_golden_model, load_arch_manifest, model_file

BOUNDS = {"qwen3moe": {"quant": (0.5, 0.1)}, "deepseek2": {"quant": (1.0, 0.2), "torch": (2.0, 0.4)}}
"""(max, mean) |logit difference| per architecture and dense path: the bounds of the other
goldens of the architecture (test_golden.TINY, test_deepseek2.DS2 / DS2_TORCH)."""

NAMES = list(load_arch_manifest("iquants")["models"]) if (GOLDEN_DIR / "iquants.json").exists() else []
CASES = [(n, dense) for n in NAMES for dense in BOUNDS[arch_golden_model("iquants", n).source["arch"]]]


def _run(g, path, ops, dense):
    cat = GGUFModel.open(path)
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=len(g.prompt_ids) + 64, dense=dense)
    s = model.kv.alloc()
    logits = model.step([(s, g.prompt_ids)])[0].numpy()
    chain = [int(np.argmax(logits))]
    while len(chain) < len(g.greedy_ids):
        chain.append(int(np.argmax(model.step([(s, [chain[-1]])])[0].numpy())))
    final = model.step([(s, [chain[-1]])])[0].numpy()
    return logits, chain, final


@pytest.mark.skipif(not NAMES, reason="tests/fixtures/golden/iquants.json not generated")
@pytest.mark.parametrize("name,dense", CASES)
def test_mixed_iquant_file_matches_llama_cpp(name, dense, ops, tmp_path_factory):
    g = arch_golden_model("iquants", name)
    path = model_file(g, tmp_path_factory.mktemp(name))
    types = {t.type_name for t in GGUFModel.open(path).tensors.values()}
    assert {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ4_NL"} & types, types
    logits, chain, final = _run(g, path, ops, dense)
    tol_max, tol_mean = BOUNDS[g.source["arch"]][dense]
    diff = np.abs(logits - g.logits)
    assert np.isfinite(logits).all()
    assert diff.max() <= tol_max and diff.mean() <= tol_mean, f"{name}: max {diff.max():.3f} mean {diff.mean():.3f}"
    i = next((i for i, (a, b) in enumerate(zip(chain, g.greedy_ids, strict=True)) if a != b), None)
    if i is None:
        ref = np.load(GOLDEN_DIR / load_arch_manifest("iquants")["models"][name]["final_logits_file"])
        d = np.abs(final - ref)
        assert d.max() <= tol_max and d.mean() <= tol_mean, f"{name}: after the chain: max {d.max():.3f} mean {d.mean():.3f}"
    else:
        assert g.greedy_gaps[i] < tol_max, (
            f"{name}: greedy chain parts from llama.cpp's at step {i} ({chain[i]} vs {g.greedy_ids[i]}) "
            f"where llama.cpp's top-1/top-2 gap is {g.greedy_gaps[i]:.3f} (>= {tol_max})")
