"""The forward pass: fused vs reference MoE path, batching, the two dense paths, errors."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from moe_service.engine.model import Model
from moe_service.engine.ops import CpuOps
from moe_service.errors import ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.synth import write_synthetic
from moe_service.weights import WeightStore


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Mixtral-style model (Q4_K experts) and a qwen3moe one (Q8_0 experts)."""
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for preset, et in (("tiny-llama", "Q4_K"), ("tiny-qwen3moe", "Q8_0")):
        cat = GGUFModel.open(write_synthetic(d / f"{preset}.gguf", preset, expert_type=et, seed=3))
        out[preset] = (cat, WeightStore.load_simple(cat))
    return out


@pytest.fixture(scope="module")
def ops_pair():
    torch.set_num_threads(1)
    fused, ref = CpuOps(threads=0, fused_moe=True), CpuOps(threads=1, fused_moe=False)
    yield fused, ref
    fused.close()
    ref.close()


def _prompt(n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(n).integers(1, vocab, n)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3moe"])
@pytest.mark.parametrize("n_tok", [1, 3, 64])
def test_fused_and_reference_moe_give_the_same_logits(tiny, ops_pair, preset, n_tok):
    """engine.fused_moe = false (the per-expert reference path) and the fused step compute the
    same function: same quantized activations, only float32 summation order differs."""
    cat, ws = tiny[preset]
    prompt = _prompt(n_tok, cat.params.n_vocab)
    logits = []
    for ops in ops_pair:
        model = Model(cat, ws, ops, n_seq=1, n_ctx=128)
        s = model.kv.alloc()
        logits.append(model.step([(s, prompt)])[0].numpy())
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-3, rtol=0)


def test_a_batched_step_equals_each_sequence_alone(tiny, ops_pair):
    """Continuous batching: a prefill chunk of one sequence and a decode token of another in
    one step give each the logits it gets alone (attention is per sequence)."""
    cat, ws = tiny["tiny-llama"]
    model = Model(cat, ws, ops_pair[0], n_seq=2, n_ctx=128)
    a, b = _prompt(5, cat.params.n_vocab), _prompt(9, cat.params.n_vocab)
    s0 = model.kv.alloc()
    model.step([(s0, a)])
    alone_decode = model.step([(s0, [7])])[0].numpy()
    model.kv.free(s0)
    s1 = model.kv.alloc()
    alone_prefill = model.step([(s1, b)])[0].numpy()
    model.kv.free(s1)

    sa, sb = model.kv.alloc(), model.kv.alloc()
    model.step([(sa, a)])
    both = model.step([(sa, [7]), (sb, b)]).numpy()
    np.testing.assert_allclose(both[0], alone_decode, atol=2e-3, rtol=0)
    np.testing.assert_allclose(both[1], alone_prefill, atol=2e-3, rtol=0)
    assert model.kv.length[sa] == 6 and model.kv.length[sb] == 9


@pytest.mark.parametrize("dense", ["quant", "torch"])
def test_want_logits_keeps_only_the_flagged_rows(tiny, ops_pair, dense):
    """want_logits: a prompt chunk that is not the last gets no row (none flagged: [0, V] and
    the cache still advances); the flagged rows are the values they get with every row."""
    cat, ws = tiny["tiny-llama"]
    model = Model(cat, ws, ops_pair[0], n_seq=2, n_ctx=128, dense=dense)
    a, b = _prompt(5, cat.params.n_vocab), _prompt(9, cat.params.n_vocab)
    sa, sb = model.kv.alloc(), model.kv.alloc()
    none = model.step([(sa, a[:3])], want_logits=[False])
    assert tuple(none.shape) == (0, cat.params.n_vocab) and model.kv.length[sa] == 3
    model.step([(sa, a[3:])], want_logits=[False])
    model.step([(sb, b[:4])])
    every = model.step([(sa, [7]), (sb, b[4:])]).numpy()
    model.kv.length[sa], model.kv.length[sb] = 5, 4  # the same step again, one row wanted
    only_b = model.step([(sa, [7]), (sb, b[4:])], want_logits=[False, True]).numpy()
    assert only_b.shape == (1, cat.params.n_vocab)
    if dense == "quant":  # our kernels: a row's result never depends on the others
        assert np.array_equal(only_b[0], every[1])
    else:  # torch's matmul of 1 row and of 2 rows may round differently
        np.testing.assert_allclose(only_b[0], every[1], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="want_logits has 1 flags for 2 batch entries"):
        model.step([(sa, [7]), (sb, [8])], want_logits=[True])


def test_cpu_path_and_torch_path_agree(tiny, ops_pair):
    """dense = "torch" (dequantized matrices, torch glue: the GPU path, here on the CPU device)
    agrees with the CPU path within the activation-quantization difference."""
    cat, ws = tiny["tiny-qwen3moe"]
    prompt = _prompt(12, cat.params.n_vocab)
    out = []
    for dense in ("quant", "torch"):
        model = Model(cat, ws, ops_pair[0], n_seq=1, n_ctx=64, dense=dense)
        s = model.kv.alloc()
        out.append(model.step([(s, prompt)])[0].numpy())
    diff = np.abs(out[0] - out[1])
    assert diff.mean() < 0.1 and diff.max() < 0.6, (diff.mean(), diff.max())


def test_context_overflow_names_the_slot(tiny, ops_pair):
    cat, ws = tiny["tiny-llama"]
    model = Model(cat, ws, ops_pair[0], n_seq=1, n_ctx=8)
    s = model.kv.alloc()
    with pytest.raises(ValueError, match=f"sequence slot {s}: 0 \\+ 9 tokens exceed the context of 8"):
        model.step([(s, list(range(1, 10)))])


def test_unsupported_architecture_is_named(tiny, ops_pair):
    cat, ws = tiny["tiny-llama"]
    other = copy.copy(cat)
    other.params = dataclasses.replace(cat.params, arch="falcon")
    with pytest.raises(ModelFileError, match="architecture 'falcon' is not supported"):
        Model(other, ws, ops_pair[0], n_seq=1, n_ctx=8)
