"""deepseek4 on the engine against llama.cpp 0.3.36 over a grid of configurations (issue 25
step 0; tools/golden_deepseek4_grid.py, ``tools/make_golden.py --only deepseek4-grid``).

Fixture: tests/fixtures/golden/deepseek4-grid.json (per case: the synthetic file's preset
overrides, seed and sha256; per prompt: the ids, llama.cpp's greedy chain of N_CHAIN tokens,
its measured self-noise) and logits/deepseek4-grid.npz (llama.cpp's logits at the last prompt
position and after the chain). The files are regenerated here from their seeds.

The engine runs the prompt in chunks of CHUNK tokens (so the compressed-KV state crosses
steps, as llama.cpp's ubatches of 512 do), then the chain one token per step. Compared: the
log-probs of llama.cpp's top-5 tokens at both points (the measure of issue 25's held-out
test) and the whole logit row.

Tolerance: the log-probs of llama.cpp's top-5 within TOL_LP = 0.06 and every logit within
TOL_ABS = 0.12 (logit std ~4). Measured 2026-12-05 (shared 2-core host; CPU path): at most 0.014
and 0.034 over the fast cases, where llama.cpp's own difference between its default run and its
F32-KV / flash-attention runs (the manifest's ``noise_top5_lp``) is 0.004-0.018: ours is within
about 1x of llama.cpp's own rounding. The test also checks that this noise is below TOL_LP / 3,
so a golden cannot pass by being noisier than the bound. A wrong tie-break in the indexer's
top-k (one position choosing another zero-scored block) measured 0.10 / 0.31, beyond both
bounds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_service.engine.model import Model
from moe_service.gguf_model import GGUFModel
from moe_service.synth import sha256_file
from moe_service.synth_deepseek4 import write_deepseek4
from moe_service.weights import WeightStore
from tests.conftest import REPO
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2

GOLDEN = REPO / "tests" / "fixtures" / "golden"
MANIFEST = json.loads((GOLDEN / "deepseek4-grid.json").read_text())
TOL_LP = 0.06
TOL_ABS = 0.12
CHUNK = 256

CASES = [pytest.param(name, i, id=f"{name}-{p['n_tokens']}", marks=[pytest.mark.slow] if p["slow"] else [])
         for name, c in MANIFEST["cases"].items() for i, p in enumerate(c["prompts"])]


@pytest.fixture(scope="module")
def logits_npz():
    with np.load(GOLDEN / "logits" / "deepseek4-grid.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory):
    """name -> the case's file, written once per module from its overrides and seed."""
    made: dict = {}
    root = tmp_path_factory.mktemp("ds4grid")

    def get(name):
        if name not in made:
            c = MANIFEST["cases"][name]
            kw = {k: tuple(v) if isinstance(v, list) else v for k, v in c["overrides"].items()}
            path = write_deepseek4(root / f"{name}.gguf", MANIFEST["settings"]["base_preset"],
                                   expert_type=MANIFEST["settings"]["expert_type"], seed=c["seed"], **kw)
            assert sha256_file(path) == c["sha256"], f"{name}: the synthetic writer no longer writes the golden's file"
            made[name] = path
        return made[name]

    return get


def _log_probs(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.logaddexp.reduce(x)


def _top5_lp_diff(gold: np.ndarray, got: np.ndarray) -> float:
    a, b = _log_probs(gold), _log_probs(got)
    top = np.argsort(-a)[:5]
    return float(np.abs(a[top] - b[top]).max())


@pytest.mark.parametrize(("name", "i"), CASES)
def test_grid_case_matches_llama_cpp(name, i, grid_file, logits_npz, ops):
    p = MANIFEST["cases"][name]["prompts"][i]
    assert p["noise_top5_lp"] < TOL_LP / 3, (name, p["noise_top5_lp"])  # the golden is not noise-bound
    path = grid_file(name)
    cat = GGUFModel.open(path)
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=p["n_ctx"], dense="quant")
    s = model.kv.alloc()
    ids = p["prompt_ids"]
    for lo in range(0, len(ids), CHUNK):
        out = model.step([(s, ids[lo:lo + CHUNK])])
    first = out[0].numpy()
    for tok in p["chain_ids"]:
        final = model.step([(s, [tok])])[0].numpy()
    for got, which in ((first, "prompt"), (final, "final")):
        gold = logits_npz[f"{p['key']}/{which}"]
        lp = _top5_lp_diff(gold, got)
        d = float(np.abs(got - gold).max())
        assert lp < TOL_LP and d < TOL_ABS, (name, p["n_tokens"], which, lp, d)
    assert int(np.argmax(first)) == p["chain_ids"][0]
