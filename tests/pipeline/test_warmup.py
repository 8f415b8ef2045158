"""Warmup pieces that run without the kernels: the expert touch covers every expert of every
MoE layer and refuses a non-finite result."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from moe_service.engine.model import ExpertSet
from moe_service.errors import StageError
from pipeline.warmup import touch_experts


class RecordingOps:
    def __init__(self, poison_layer: int | None = None):
        self.calls = []
        self.poison_layer = poison_layer

    def moe(self, arena, x, ids, w, experts):
        self.calls.append((experts.layer, x.shape, ids.copy(), w.copy()))
        y = np.zeros_like(x)
        if experts.layer == self.poison_layer:
            y[0, 0] = np.nan
        return y


def fake_model(n_expert: int, k: int, hidden: int = 16, n_layer: int = 3, dense_layers=(1,), ops=None):
    layers = []
    for i in range(n_layer):
        ex = None if i in dense_layers else ExpertSet(i, n_expert, hidden, 8, {}, {})
        layers.append(SimpleNamespace(index=i, experts=ex))
    return SimpleNamespace(layers=layers, p=SimpleNamespace(n_expert_used=k), ops=ops or RecordingOps(),
                           weights=SimpleNamespace(arena=np.zeros(1, dtype=np.uint8)))


@pytest.mark.parametrize("n_expert,k", [(8, 8), (256, 8), (10, 4), (128, 8), (3, 2)])
def test_touch_runs_every_expert_of_every_moe_layer(n_expert, k):
    model = fake_model(n_expert, k)
    out = touch_experts(model)
    assert out == {"layers": 2, "experts": 2 * n_expert}
    assert [c[0] for c in model.ops.calls] == [0, 2]  # the dense layer is skipped
    for _, x_shape, ids, w in model.ops.calls:
        t = -(-n_expert // k)
        assert x_shape == (t, 16) and ids.shape == (t, k) and ids.dtype == np.int32
        assert set(ids.ravel().tolist()) == set(range(n_expert))
        assert all(len(set(row)) == len(row) for row in ids.tolist())  # no expert twice in a token
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)


def test_touch_refuses_non_finite_output():
    model = fake_model(8, 2, ops=RecordingOps(poison_layer=2))
    with pytest.raises(StageError, match="layer 2"):
        touch_experts(model)
