"""Every numeric hyperparameter of a small model of each architecture, mutated (x0, x2, x64,
+1, -1): the file is either refused cleanly (the catalog's or the architecture's check names
the file and the key or tensor; ``moe-service check`` exits 3 with that sentence) or it
runs to finite logits. Never a crash: the runs happen in a subprocess
(tests/support/arch_mutation_runner.py), and it must exit 0 having reported every case.

Which mutations run: those no check refuses (up to RUNS_PER_KEY per architecture and key;
``general.*`` and ``tokenizer.*`` values go through the tokenizer only), e.g. a different rope.freq_base or epsilon
(another valid model), one layer fewer (the last layer's tensors are then unused), a
context_length of 0 (the configured context is used), fewer experts per token, special
token ids out of the vocabulary (the tokenizer ignores them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from moe_service.engine.arch import check_model, supported
from moe_service.engine.tokenizer import Tokenizer
from moe_service.gguf_model import GGUFModel
from moe_service.synth import write_synthetic
from tests.conftest import REPO
from tests.support.arch_mutation_runner import patch, scalar_fields, set_metadata

ARCH_PRESETS = {"llama": "tiny-llama", "qwen3moe": "tiny-qwen3moe", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3",
                "deepseek2": "tiny-deepseek2", "deepseek4": "tiny-deepseek4"}
MUTATIONS = {"x0": lambda v: 0 * v, "x64": lambda v: 64 * v, "-1": lambda v: v - 1, "x2": lambda v: 2 * v,
             "+1": lambda v: v + 1}
RUNS_PER_KEY = 3  # engine runs per (architecture, key) among the accepted mutations, in MUTATIONS' order


def _mutations(path):
    for key, (offset, dtype, value) in scalar_fields(str(path)).items():
        for what, fn in MUTATIONS.items():
            new = fn(value)
            if np.dtype(dtype).kind in "iu":
                info = np.iinfo(dtype)
                if not info.min <= new <= info.max:
                    continue  # not representable in the key's type: no file can say it
            if new == value:
                continue
            yield key, what, offset, dtype, value, new


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mutations")
    from moe_service.synth_deepseek2 import write_deepseek2
    from moe_service.synth_deepseek4 import write_deepseek4

    writers = {"deepseek2": write_deepseek2, "deepseek4": write_deepseek4}
    return {arch: writers.get(arch, write_synthetic)(d / f"{arch}.gguf", preset, seed=5)
            for arch, preset in ARCH_PRESETS.items()}


def _problems(path) -> list[str]:
    """What ``moe-service check`` refuses the file for (catalog, then the architecture)."""
    cat = GGUFModel.open(path, strict=False)
    probs = cat.problems()
    if not probs:
        probs = check_model(cat)
    return [p.message for p in probs]


def test_every_numeric_hyperparameter_mutation_is_refused_cleanly_or_runs(models, tmp_path):
    to_run, refused = [], {}
    for arch, path in models.items():
        assert _problems(path) == [], f"{arch}: the unmutated model must pass"
        for key, what, offset, dtype, old, new in _mutations(path):
            patch(str(path), offset, dtype, new)
            try:
                probs = _problems(path)
            finally:
                patch(str(path), offset, dtype, old)
            if probs:
                # a clean refusal names the file and what is wrong (the key, or the tensor whose
                # shape the key no longer matches)
                assert any(str(path) in p for p in probs), (arch, key, what, probs)
                refused[(arch, key, what)] = probs[0]
            elif key.startswith(("general.", "tokenizer.")):  # not hyperparameters: the tokenizer must take it
                patch(str(path), offset, dtype, new)
                try:
                    Tokenizer.from_gguf(GGUFModel.open(path).metadata, source=str(path))
                finally:
                    patch(str(path), offset, dtype, old)
            elif sum(c["what"].startswith(f"{arch} {key} ") for c in to_run) < RUNS_PER_KEY:
                to_run.append({"path": str(path), "offset": offset, "dtype": dtype, "value": new, "old": old,
                               "what": f"{arch} {key} {what}"})
    to_run += [{"path": str(p), "offset": None, "what": f"{a} unmutated"} for a, p in models.items()]
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(to_run))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "tests.support.arch_mutation_runner", str(cases)], capture_output=True,
                       text=True, timeout=600, cwd=REPO, env=env)
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    started = [ln for ln in r.stdout.splitlines() if ln.startswith("start ")]
    crashed = to_run[len(lines)]["what"] if len(lines) < len(to_run) else None
    assert r.returncode == 0 and len(lines) == len(to_run), (
        f"runner exit {r.returncode} after {len(started)} started / {len(lines)} reported; crashed on {crashed}: "
        f"{r.stderr[-2000:]}")
    for case, res in zip(to_run, lines, strict=True):
        if res["outcome"] == "refused":  # Model's own check: the same clean error, exit 3
            assert res["exit_code"] == 3 and case["path"] in res["message"], (case, res)
        else:
            assert res["finite"], case
    # The mutations that must be refused are refused (a sample that pins the checks down).
    for arch in models:
        for key, what in (("block_count", "+1"), ("embedding_length", "x2"), ("attention.head_count", "x0"),
                          ("attention.head_count_kv", "x64"), ("rope.dimension_count", "-1")):
            assert (arch, f"{arch}.{key}", what) in refused, (arch, key, what)
    assert ("qwen3moe", "qwen3moe.expert_feed_forward_length", "x2") in refused
    assert ("llama", "llama.expert_count", "x2") in refused
    assert ("qwen2", "qwen2.feed_forward_length", "+1") in refused
    ran = {c["what"] for c in to_run}
    assert "llama llama.rope.freq_base x64" in ran and "qwen3moe qwen3moe.expert_used_count -1" in ran


def test_check_cli_names_key_and_tensor_and_lists_supported_architectures(models, tmp_path):
    """``moe-service check`` exits 3 with the sentence an operator needs: the file, the
    tensor, its shape against the header's, and the keys; or the unsupported architecture
    with the supported list. ``moe-service serve`` refuses the same file with exit 3."""
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(models["qwen3moe"], bad)
    set_metadata(str(bad), "qwen3moe.expert_feed_forward_length", 512)
    r = _check(bad)
    assert r.returncode == 3, r.stdout + r.stderr
    problem = next(ln for ln in r.stdout.splitlines() if "problem:" in ln)
    assert str(bad) in problem and "tensor blk.0.ffn_gate_exps.weight has shape [256, 256, 16]" in problem
    assert "header gives [256, 512, 16]" in problem and "qwen3moe.expert_feed_forward_length=512" in problem

    r = _cli("serve", bad)  # the start refuses it in prepare, before any allocation
    assert r.returncode == 3, r.stdout + r.stderr
    assert '"stage": "prepare"' in r.stderr and "tensor blk.0.ffn_gate_exps.weight has shape" in r.stderr

    other = tmp_path / "other.gguf"
    shutil.copyfile(models["llama"], other)
    _set_arch(other, "bloom")
    r = _check(other)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"architecture 'bloom' is not supported (supported: {', '.join(supported())}" in r.stdout


def _set_arch(path, name: str) -> None:
    """general.architecture = ``name`` in place (same length as the old value)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r+")
    f = reader.fields["general.architecture"]
    part = f.parts[f.data[0]]
    assert len(part) == len(name)
    part[:] = list(name.encode())
    reader.data.flush()


def _check(path) -> subprocess.CompletedProcess:
    return _cli("check", path)


def _cli(command: str, path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}
    clean["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "moe_service.cli", command, "--model", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=clean)
