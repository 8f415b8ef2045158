"""bench/gpu_check.py on this machine: it refuses to pretend without CUDA, and its dry run
(CPU tensors, a recording fake cudart) runs the H2D path through the pin stage's code."""

from __future__ import annotations

import json

from bench import gpu_check


def test_without_cuda_it_fails_loudly(capsys):
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "FAILED: no CUDA device" in err and "--device cpu" in err


def test_dry_run_h2d_through_the_pin_code(capsys):
    assert gpu_check.main(["--device", "cpu", "--only", "h2d", "--h2d-mib", "4", "--reps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] is True and out["ok"] is True
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["copy intact 4 MiB"]["status"] == "PASS"
    assert rows["fake cudart calls 4 MiB"]["status"] == "PASS"
    assert rows["pinned 4 MiB"]["detail"].startswith("DRY RUN, not a measurement.")
