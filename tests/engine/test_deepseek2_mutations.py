"""Every numeric deepseek2 hyperparameter of a small model mutated (x0, x2, x64, +1): the file
is either refused before loading with a problem naming the file (exit 3 in ``check`` and
``serve``), or it runs and gives finite logits. Never a crash, never a kernel outside its
buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_service.engine import arch as archs
from moe_service.engine.model import Model
from moe_service.engine.ops import CpuOps
from moe_service.errors import ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.synth_deepseek2 import model_metadata, resolve_preset, write_deepseek2
from moe_service.weights import WeightStore
from tests.smollm2 import needs_smollm2

pytestmark = needs_smollm2

PRESET = resolve_preset("tiny-deepseek2", n_layer=2, expert_type="Q8_0")
NUMERIC = [k for k, (v, t) in model_metadata(PRESET, 0).items()
           if k.startswith("deepseek2.") and t in ("UINT32", "FLOAT32")]


@pytest.fixture(scope="module")
def ops():
    torch.set_num_threads(1)
    o = CpuOps(threads=1)
    yield o
    o.close()


def _mutations():
    base = model_metadata(PRESET, 0)
    for key in NUMERIC:
        v, t = base[key]
        for how in ("x0", "x2", "x64", "+1"):
            nv = {"x0": 0, "x2": 2, "x64": 64}.get(how)
            new = (v * nv if nv is not None else v + 1)
            yield key, how, (int(new) if t == "UINT32" else float(new))


def test_every_numeric_key_is_covered():
    assert len(NUMERIC) >= 25, NUMERIC  # the preset writes the V3 key set


@pytest.mark.parametrize("key,how,value", list(_mutations()), ids=lambda v: str(v))
def test_mutated_header_is_refused_or_runs(key, how, value, ops, tmp_path):
    path = write_deepseek2(tmp_path / "m.gguf", PRESET, metadata_overrides={key: value})
    try:
        cat = GGUFModel.open(path)
    except ModelFileError as exc:
        assert str(path) in str(exc)
        return
    problems = archs.check_model(cat)
    if problems:
        assert all(str(path) in p.message for p in problems), problems
        with pytest.raises(ModelFileError):
            Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=32)
        return
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=32)
    s = model.kv.alloc()
    logits = model.step([(s, [1, 2, 3, 4, 5])])[0].numpy()
    logits2 = model.step([(s, [int(np.argmax(logits))])])[0].numpy()
    assert np.isfinite(logits).all() and np.isfinite(logits2).all(), (key, how, value)


def test_nextn_blocks_are_not_part_of_the_trunk(tmp_path):
    """deepseek2.nextn_predict_layers: the last blocks are multi-token-prediction heads
    (llama.cpp's n_layer() excludes them); the decode trunk is block_count minus them."""
    path = write_deepseek2(tmp_path / "mtp.gguf", PRESET, metadata_overrides={"deepseek2.nextn_predict_layers": 1})
    cat = GGUFModel.open(path)
    assert archs.check_model(cat) == []
    assert archs.for_model(cat).hp.n_layer == PRESET.n_layer - 1


def test_query_temperature_scaling_is_refused_naming_the_key(tmp_path):
    path = write_deepseek2(tmp_path / "t.gguf", PRESET, metadata_overrides={"deepseek2.attention.temperature_scale": 0.1})
    (p,) = archs.check_model(GGUFModel.open(path))
    assert str(path) in p.message and "deepseek2.attention.temperature_scale" in p.message
