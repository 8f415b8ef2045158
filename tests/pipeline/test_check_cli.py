"""`moe-service check` as an operator runs it (a subprocess): the demo model is ready (0), a
GGUF cut by one byte is a bad model file (3), a host whose memory cannot hold the plan is
refused by preflight (4), each with the numbers in the output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from moe_service.demo_model import build_demo_model
from tests.conftest import REPO
from tests.support.numa_fixtures import write_sysfs
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("check") / "demo.gguf")


def check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}
    clean["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "moe_service.cli", "check", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**clean, **(env or {})})


def test_demo_model_is_ready(demo):
    r = check("--model", str(demo))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "architecture: llama, 30 layers" in out and "experts: 8 per layer, top-8" in out
    assert "tensors: 302" in out and "types: Q4_1 210" in out and "model files: OK" in out
    assert "policy expert_shard" in out and "fits: yes" in out
    for name in ("memory.host", "pin", "engine.device", "cpu_flags", "catalog"):
        assert f" {name} " in out, name
    assert "needed_bytes=" in out and "available_bytes=" in out
    assert "FAIL" not in out and out.rstrip().endswith("check: ready to start")
    j = check("--model", str(demo), "--json")
    assert j.returncode == 0
    doc = json.loads(j.stdout)
    assert doc["ready"] and doc["exit_code"] == 0 and doc["plan"]["fits"] and doc["preflight"]["ok"]


def test_gguf_cut_by_one_byte_is_a_bad_model_file(demo, tmp_path):
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(demo, cut)
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 1)
    r = check("--model", str(cut))
    assert r.returncode == 3, r.stdout + r.stderr
    (problem,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("problem:")]
    assert str(cut) in problem and "truncated" in problem and "tensor output_norm.weight" in problem
    assert "plan:" not in r.stdout and r.stdout.rstrip().endswith("check: 1 problem(s)")


def test_plan_larger_than_memory_is_refused_with_both_numbers(demo, tmp_path):
    root = write_sysfs(tmp_path / "host", [[0, 1]], [0.05])  # 51 MiB MemAvailable for a ~94 MiB model
    r = check("--model", str(demo), env={"MOE_SERVICE__NUMA__SYSFS_ROOT": str(root)})
    assert r.returncode == 4, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    host = next(ln for ln in lines if "FAIL" in ln and "memory.host" in ln)
    need = os.path.getsize(demo)  # the arena: every tensor, 2 MiB aligned: a little more than the file's data
    assert "the plan needs 0.1 GiB" in host and "MemAvailable is 0.0 GiB (53686272 bytes)" in host
    numbers = lines[lines.index(host) + 1]
    needed = int(numbers.split("needed_bytes=")[1].split()[0])
    assert need - 2**20 < needed < need + 2**21 and "available_bytes=53686272" in numbers
    assert any("FAIL" in ln and "memory.node0" in ln and "reserve" in ln for ln in lines)
    # the KV cache (engine/kv.py) cannot sit beside the weights on that node either
    assert any("FAIL" in ln and "kv_cache" in ln and "cannot hold the KV cache" in ln for ln in lines)
    assert r.stdout.rstrip().endswith("check: 3 problem(s)")
