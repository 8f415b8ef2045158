"""bench/layer_parts: the per-part timer's accounting on a tiny qwen3moe file (no timing
asserted: the parts' exclusive times add up to the layer's, the step's parts to the step,
and instrumenting is undone)."""

from __future__ import annotations

import pytest

from bench.ds4_parts import PartTimer
from bench.layer_parts import OUTSIDE, PARTS, StepTimer, format_table, instrument, profile
from moe_service.engine import attention
from moe_service.engine.arch import llama
from moe_service.engine.model import CpuPath, Model
from moe_service.synth.llama import write_synthetic
from tests.support.smollm2 import needs_smollm2


def test_instrument_restores_every_function():
    names = (
        "linear",
        "rmsnorm",
        "rmsnorm_heads",
        "rope",
        "qk_norm_rope_one",
        "add_rms_norm",
        "route",
        "moe",
        "glu_ffn",
        "embed",
        "head",
        "logits_out",
        "gather_rows",
    )
    before = (
        {n: CpuPath.__dict__[n] for n in names},
        attention.store,
        attention.attend,
        llama.Llama.__dict__["block"],
        Model.__dict__["step"],
    )
    timer = PartTimer([0])
    restore = instrument(timer, StepTimer(timer))
    assert CpuPath.__dict__["rmsnorm"] is not before[0]["rmsnorm"] and attention.attend is not before[2]
    restore()
    after = (
        {n: CpuPath.__dict__[n] for n in names},
        attention.store,
        attention.attend,
        llama.Llama.__dict__["block"],
        Model.__dict__["step"],
    )
    assert after == before


@needs_smollm2
@pytest.mark.parametrize(("prefill", "clock"), [(False, "wall"), (True, "wall"), (False, "cpu")])
def test_parts_add_up_to_the_layer_and_the_step(tmp_path, prefill, clock):
    path = write_synthetic(tmp_path / "t.gguf", "tiny-qwen3moe", seed=0)
    r = profile(path, threads=1, depth=24, n_decode=2, ubatch=16, prefill=prefill, clock=clock)
    assert r["arch"] == "qwen3moe" and r["n_layer"] == 2 and r["clock"] == clock
    table = r["parts_ms_per_layer"]
    assert set(table) == set(PARTS) and set(r["outside_ms"]) == set(OUTSIDE)
    assert sum(table.values()) == pytest.approx(r["layer_ms"], rel=1e-6)
    for part in ("attn proj", "rope", "kv write", "attention", "norms", "router", "experts"):
        assert table[part] > 0, part
    # a decode step fuses the q/k norms into rope's call (CpuPath.qk_norm_rope_one)
    assert (table["qk norm"] > 0) == prefill
    assert table["dense ffn"] == 0.0  # every layer of the file is MoE
    assert r["outside_ms"]["head"] > 0 and r["outside_ms"]["embed"] > 0
    # nothing counted twice: the step's remainder is not negative, and the layers and the parts
    # outside them fit in the timed loop (which also holds the argmax between decode steps)
    assert r["outside_ms"]["step glue"] >= 0
    whole = r["layer_ms"] * r["n_layer"] + sum(r["outside_ms"].values())
    assert whole <= r["step_ms"] * (1 + 1e-9)
    assert "layer total" in format_table(r)


def test_cpu_clock_needs_one_thread(tmp_path):
    with pytest.raises(SystemExit, match="--threads 1"):
        profile(tmp_path / "never-opened.gguf", threads=2, depth=8, n_decode=1, clock="cpu")


@needs_smollm2
@pytest.mark.parametrize("prefill", [False, True])
def test_deepseek2_parts_add_up(tmp_path, prefill):
    """A deepseek2 (MLA) file: its per-head matmuls are 'mla heads', its shared experts 'shared
    expert', its leading dense layer 'dense ffn'; the parts still add up to the layer."""
    from moe_service.synth_deepseek2 import write_deepseek2

    path = write_deepseek2(tmp_path / "d.gguf", "tiny-deepseek2", expert_type="Q8_0", seed=3, n_layer=2)
    r = profile(path, threads=1, depth=20, n_decode=2, ubatch=8, prefill=prefill, clock="cpu")
    assert r["arch"] == "deepseek2" and r["n_layer"] == 2
    table = r["parts_ms_per_layer"]
    assert set(table) == set(PARTS)
    assert sum(table.values()) == pytest.approx(r["layer_ms"], rel=1e-6)
    for part in (
        "attn proj",
        "mla heads",
        "rope",
        "kv write",
        "attention",
        "norms",
        "router",
        "experts",
        "dense ffn",
        "shared expert",
    ):
        assert table[part] > 0, part
    assert table["qk norm"] == 0.0
    assert "layer total" in format_table(r)
