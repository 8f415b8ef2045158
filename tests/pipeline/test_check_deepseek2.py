"""`moe-service check` on deepseek2 files at real layer shapes (DeepSeek-V3, Kimi K2), written
sparse (header and tensor table real, data zero blocks: nothing is loaded by check): ready on
a consistent file, exit 3 naming key and tensors when the header disagrees with the tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_service.synth_deepseek2 import write_deepseek2
from tests.conftest import REPO
from tests.support.numa_fixtures import write_sysfs
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2


def check(model, host) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}
    env.update(PYTHONPATH=str(REPO), MOE_SERVICE__NUMA__SYSFS_ROOT=str(host))
    return subprocess.run([sys.executable, "-m", "moe_service.cli", "check", "--model", str(model)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A one-node host with room for a 10 GB plan, whatever machine runs the test."""
    return write_sysfs(tmp_path_factory.mktemp("host"), [[0, 1]], [64.0])


@pytest.mark.parametrize("preset,layers,what", [
    ("deepseek-v3", 4, "deepseek2, 4 layers, hidden 7168, heads 128/1 (head_dim 576), vocab 129280"),
    ("kimi-k2", 2, "deepseek2, 2 layers, hidden 7168, heads 64/1 (head_dim 576), vocab 163840"),
])
def test_real_shaped_deepseek2_file_is_ready(preset, layers, what, host, tmp_path):
    path = write_deepseek2(tmp_path / f"{preset}.gguf", preset, n_layer=layers, sparse=True)
    r = check(path, host)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"architecture: {what}" in r.stdout
    assert "deepseek2: hyperparameters and tensors agree" in r.stdout
    assert r.stdout.rstrip().endswith("check: ready to start")


@pytest.mark.parametrize("key,value,tensor,expected,found", [
    ("deepseek2.attention.kv_lora_rank", 511, "blk.0.attn_kv_a_norm.weight", "[511]", "[512]"),
    ("deepseek2.expert_feed_forward_length", 2049, "blk.3.ffn_down_exps.weight", "[2049, 7168, 256]",
     "[2048, 7168, 256]"),
    ("deepseek2.rope.dimension_count", 66, "blk.0.attn_kv_a_mqa.weight", "[7168, 578]", "[7168, 576]"),
    ("deepseek2.attention.head_count", 64, "blk.0.attn_q_b.weight", "[1536, 12288]", "[1536, 24576]"),
])
def test_header_disagreeing_with_tensors_exits_3_naming_key_and_tensor(key, value, tensor, expected, found, host,
                                                                        tmp_path):
    path = write_deepseek2(tmp_path / "v3-bad.gguf", "deepseek-v3", n_layer=4, sparse=True,
                           metadata_overrides={key: value})
    r = check(path, host)
    assert r.returncode == 3, r.stdout + r.stderr
    problems = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("problem:")]
    line = next(ln for ln in problems if f"tensor {tensor} " in ln)
    assert str(path) in line and f"{key}={value}" in line
    assert f"has shape {found} but the header gives {expected}" in line


def test_odd_rope_dims_are_refused_naming_the_key(host, tmp_path):
    path = write_deepseek2(tmp_path / "v3-odd.gguf", "deepseek-v3", n_layer=4, sparse=True,
                           metadata_overrides={"deepseek2.rope.dimension_count": 65})
    r = check(path, host)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "deepseek2.rope.dimension_count = 65 must be even" in r.stdout
