"""deepseek2 prefill over a V3-sized latent cache (kv_lora_rank 512 + 64 rope dims = 576, 16
heads: the attention's five- and six-heads-per-key-read score kernel and six-heads P.V on
the widened tile) cut into steps at several points: each cut, a prefill continuing a non-empty
cache (a prefix-cache hit), and a step batching a continuation with a fresh prompt give the
logits of the one-shot prefill (the kernels' sums do not depend on where a step starts)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine.model import Model
from moe_service.gguf_model import GGUFModel
from moe_service.weights import WeightStore
from tests.support.smollm2 import needs_smollm2

PROMPT = [int(t) for t in np.random.default_rng(5).integers(1, 8000, 70)]


@pytest.fixture(scope="module")
def v3_latent(tmp_path_factory):
    from moe_service.synth_deepseek2 import write_deepseek2

    path = write_deepseek2(
        tmp_path_factory.mktemp("ds2") / "v3lat.gguf",
        "tiny-deepseek2",
        expert_type="Q8_0",
        seed=4,
        n_layer=2,
        n_head=16,
        kv_lora_rank=512,
        qk_rope=64,
    )
    cat = GGUFModel.open(path)
    return cat, WeightStore.load_simple(cat)


def _prefill(model: Model, slot: int, ids: list[int], cuts: list[int]) -> np.ndarray:
    """The last token's logits after prefilling ``ids`` in steps ending at each cut."""
    logits = None
    a = 0
    for e in [*cuts, len(ids)]:
        logits = model.step([(slot, ids[a:e])])[0].numpy()
        a = e
    assert logits is not None
    return logits


@needs_smollm2
@pytest.mark.parametrize("cuts", [[1], [16], [17, 33], [8, 16, 24, 32, 40, 48, 56, 64], [69]])
def test_cut_prefill_equals_one_shot(v3_latent, ops, cuts):
    cat, ws = v3_latent
    assert cat.params.head_dim == 576 and cat.params.n_head == 16
    model = Model(cat, ws, ops, n_seq=2, n_ctx=96)
    s0, s1 = model.kv.alloc(), model.kv.alloc()
    whole = _prefill(model, s0, PROMPT, [])
    cut = _prefill(model, s1, PROMPT, cuts)
    np.testing.assert_allclose(cut, whole, rtol=0, atol=1e-5)
    # and a decode step after each
    d0 = model.step([(s0, [77])])[0].numpy()
    d1 = model.step([(s1, [77])])[0].numpy()
    np.testing.assert_allclose(d1, d0, rtol=0, atol=1e-5)


@needs_smollm2
def test_continued_prefill_batched_with_a_fresh_prompt(v3_latent, ops):
    """A prefix-cache hit (the first 40 tokens already cached) continued in the same step as
    another sequence's whole prompt: each gets its one-shot logits."""
    cat, ws = v3_latent
    model = Model(cat, ws, ops, n_seq=3, n_ctx=96)
    ref = model.kv.alloc()
    whole = _prefill(model, ref, PROMPT, [])
    other_ids = PROMPT[::-1][:30]
    other_alone = _prefill(model, model.kv.alloc(), other_ids, [])
    model.kv.free(ref)
    hit = model.kv.alloc()
    model.step([(hit, PROMPT[:40])])
    other = model.kv.alloc()
    both = model.step([(hit, PROMPT[40:]), (other, other_ids)]).numpy()
    np.testing.assert_allclose(both[0], whole, rtol=0, atol=1e-5)
    np.testing.assert_allclose(both[1], other_alone, rtol=0, atol=1e-5)
