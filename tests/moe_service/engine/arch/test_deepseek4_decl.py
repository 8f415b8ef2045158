"""deepseek4 declarations (moe_service/engine/arch/deepseek4.py): the synthetic writer's files
agree with the architecture's tensor list; header/tensor disagreements are named (file, key,
tensor, shapes); the MTP block is declared and checked; ``moe-service check`` on a
V4-Flash-shaped file is ready and prints the per-node plan, and exits 3 on a header/tensor
disagreement; an architecture in CHECK_ONLY (declared, forward pass not built) is checked
and then refused naming it; the llama.cpp goldens are long and decisive enough."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moe_service.engine import arch as archs
from moe_service.engine.arch.deepseek4 import Deepseek4
from moe_service.errors import ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.synth_deepseek4 import resolve_preset, tensor_plan, write_deepseek4
from tests.conftest import REPO
from tests.support.numa_fixtures import write_sysfs
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2

GOLDEN = REPO / "tests" / "fixtures" / "golden"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_deepseek4(tmp_path_factory.mktemp("ds4") / "tiny.gguf", "tiny-deepseek4")


def test_synth_layout_is_the_architecture_s(tiny):
    cat = GGUFModel.open(tiny)
    assert archs.check_model(cat, runnable=False) == []
    a = Deepseek4(cat.metadata, tiny, tensor_ne={n: t.ne for n, t in cat.tensors.items()})
    hp = a.hp
    assert (hp.n_layer, hp.n_layer_all, hp.n_mtp) == (5, 6, 1)
    assert hp.compress_ratios[:5] == (0, 4, 128, 4, 128) and hp.hash_layers == 2
    declared = {s.name: s.ne for s in a.tensors()}
    written = {t.name: t.ne for t in tensor_plan(resolve_preset("tiny-deepseek4"))}
    assert written.keys() <= declared.keys()
    assert all(declared[n] == ne for n, ne in written.items())
    required = {s.name for s in a.tensors() if s.required}
    assert required <= written.keys()
    # hash layers route by token id (int32 table), the others carry the selection bias
    assert cat.tensors["blk.1.ffn_gate_tid2eid.weight"].type_name == "I32"
    assert "blk.2.exp_probs_b.bias" in cat.tensors and "blk.2.ffn_gate_tid2eid.weight" not in cat.tensors
    # ratio 4 layers have the indexer, ratio 128 the compressor only, ratio 0 neither
    assert "blk.1.indexer.proj.weight" in cat.tensors and "blk.2.indexer.proj.weight" not in cat.tensors
    assert "blk.2.attn_compressor_kv.weight" in cat.tensors and "blk.0.attn_compressor_kv.weight" not in cat.tensors
    assert a.kv_layers()[0].key_dim == 128 and len(a.kv_layers()) == 5
    # per token of context beyond the windows: 2 x (D/4 + Di/4) + 2 x D/128
    assert a.compressed_kv_values_per_token() == pytest.approx(2 * (128 / 4 + 64 / 4) + 2 * 128 / 128)


def test_a_consistent_file_is_runnable_and_a_check_only_architecture_is_refused(tiny, monkeypatch):
    cat = GGUFModel.open(tiny)
    assert archs.check_model(cat) == [] and "deepseek4" in archs.supported()
    # the CHECK_ONLY mechanism (an architecture declared before its forward pass exists)
    monkeypatch.delitem(archs.ARCHITECTURES, "deepseek4")
    monkeypatch.setitem(archs.CHECK_ONLY, "deepseek4", Deepseek4)
    (p,) = archs.check_model(cat)
    assert "deepseek4" in p.message and "does not run deepseek4 yet" in p.message and str(tiny) in p.message
    assert archs.check_model(cat, runnable=False) == []
    with pytest.raises(ModelFileError, match="does not run deepseek4 yet"):
        archs.validate(cat)


@pytest.mark.parametrize("key,value,needle", [
    ("deepseek4.attention.head_count", 4, "tensor blk.0.attn_q_b.weight has shape [128, 1024] but the header "
                                          "gives [128, 512]"),
    ("deepseek4.attention.key_length", 64, "deepseek4.attention.value_length = 128 differs from "
                                           "deepseek4.attention.key_length = 64"),
    ("deepseek4.attention.output_group_count", 4, "tensor blk.0.attn_output_a.weight has shape [512, 128]"),
    ("deepseek4.attention.indexer.key_length", 32, "tensor blk.1.indexer.attn_q_b.weight has shape"),
    ("deepseek4.hash_layer_count", 3, "tensor blk.2.ffn_gate_tid2eid.weight is missing"),
    ("deepseek4.attention.compress_ratios", [0, 128, 128, 4, 128, 0], "tensor blk.1.attn_compressor_kv.weight has "
                                                                      "shape [256, 256] but the header gives "
                                                                      "[256, 128]"),
    ("deepseek4.attention.compress_ratios", [0, 4, 128], "has 3 values but block_count is 6"),
    ("deepseek4.attention.compress_ratios", [0, 4, 64, 4, 128, 0], "compress_ratios[2] is 64, expected one of 0, 4, "
                                                                   "128"),
    ("deepseek4.expert_gating_func", 2, "deepseek4.expert_gating_func is 2"),
    ("deepseek4.hyper_connection.count", 2, "requires 4 streams"),
    ("deepseek4.expert_used_count", 3, "tensor blk.0.ffn_gate_tid2eid.weight has shape [4, 8192] but the header "
                                       "gives [3, 8192]"),
])
def test_header_disagreements_are_named(key, value, needle, tmp_path):
    path = write_deepseek4(tmp_path / "bad.gguf", "tiny-deepseek4", metadata_overrides={key: value})
    problems = archs.check_model(GGUFModel.open(path, strict=False))
    assert problems, key
    text = " | ".join(p.message for p in problems)
    assert needle in text and str(path) in text
    if "has shape" in needle:
        assert f"{key}=" in text


def test_mtp_block_is_declared_only_when_its_eh_proj_exists(tmp_path):
    path = write_deepseek4(tmp_path / "nomtp.gguf", "tiny-deepseek4", n_mtp=0,
                           metadata_overrides={"deepseek4.nextn_predict_layers": 1,
                                               "deepseek4.attention.compress_ratios": [0, 4, 128, 4, 128]})
    cat = GGUFModel.open(path)
    # llama.cpp probes blk.<trunk>.nextn.eh_proj; without it the blocks are all trunk (5 here)
    a = Deepseek4(cat.metadata, path, tensor_ne={n: t.ne for n, t in cat.tensors.items()})
    assert (a.hp.n_layer, a.hp.n_mtp) == (5, 0)
    assert archs.check_model(cat, runnable=False) == []


def _check(model, host) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}
    env.update(PYTHONPATH=str(REPO), MOE_SERVICE__NUMA__SYSFS_ROOT=str(host))
    return subprocess.run([sys.executable, "-m", "moe_service.cli", "check", "--model", str(model)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_check_on_a_v4_flash_shaped_file(tmp_path):
    host = write_sysfs(tmp_path / "host", [[0, 1]], [64.0])
    path = write_deepseek4(tmp_path / "v4f.gguf", "deepseek-v4-flash", sparse=True)
    r = _check(path, host)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "architecture: deepseek4, 4 layers, hidden 4096, heads 64/1 (head_dim 512)" in r.stdout
    assert "experts: 256 per layer, top-6, width 2048" in r.stdout
    assert "deepseek4 supported, hyperparameters and 116 tensors agree" in r.stdout
    assert "plan:" in r.stdout and "fits: yes" in r.stdout
    assert r.stdout.rstrip().endswith("check: ready to start")
    bad = write_deepseek4(tmp_path / "v4f-bad.gguf", "deepseek-v4-flash", sparse=True,
                          metadata_overrides={"deepseek4.attention.output_lora_rank": 512})
    r = _check(bad, host)
    assert r.returncode == 3, r.stdout + r.stderr
    assert ("tensor blk.0.attn_output_b.weight has shape [8192, 4096] but the header gives [4096, 4096]"
            in r.stdout), r.stdout
    assert "plan:" not in r.stdout


@pytest.mark.parametrize("args, hash_layers", [(["--ratios", "4,128"], 2), (["--ratios", "4,128", "--hash-layers", "1"], 1),
                                               ([], 3)])
def test_the_writer_cli_shortens_a_preset(tmp_path, args, hash_layers):
    from moe_service.synth_deepseek4 import main

    out = tmp_path / "v4f.gguf"
    assert main(["--preset", "deepseek-v4-flash", "--out", str(out), "--sparse", *args]) == 0
    meta = GGUFModel.open(out).metadata
    assert meta["deepseek4.hash_layer_count"] == hash_layers
    assert len(meta["deepseek4.attention.compress_ratios"]) == (2 if args else 4)


def test_goldens_cross_the_window_and_the_blocks_and_are_decisive():
    man = json.loads((GOLDEN / "deepseek4.json").read_text())
    (name, m), = man["models"].items()
    assert m["source"]["arch"] == "deepseek4" and man["versions"]["llama_cpp_python"] == "0.3.36"
    assert len(m["prompt_ids"]) >= 600 > 4 * 128
    assert len(m["greedy_ids"]) == 48 and min(m["greedy_top1_top2_gap"]) >= 2.0
    for f in ("logits_file", "final_logits_file"):
        lg = np.load(GOLDEN / m[f])
        assert lg.shape == (8192,) and np.isfinite(lg).all() and lg.std() > 1.0
