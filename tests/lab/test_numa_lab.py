"""Boot the NUMA lab VM once (4 nodes, SNC-like distances) and run tests/numa inside it.

One VM, one pytest session: results come back as a junit file through $LAB_OUT. Skipped with
the reason when the VM cannot run here (see tests/lab/conftest.py).
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.lab.vm import run_in_vm
from tests.numa.models import ensure_models

REPO = Path(__file__).resolve().parents[2]
# two "sockets" of two sub-NUMA clusters each: 12 inside a socket, 21 across
SNC_DISTANCES = [[10, 12, 21, 21], [12, 10, 21, 21], [21, 21, 10, 12], [21, 21, 12, 10]]


@pytest.mark.lab
@pytest.mark.slow
def test_numa_suite_in_vm():
    ensure_models()  # written here on the host: the VM reads them over 9p
    t0 = time.monotonic()
    rc, output, out_dir = run_in_vm(
        f"{sys.executable} -m pytest tests/numa -q -rA --color=no -p no:cacheprovider --junitxml=$LAB_OUT/numa.xml",
        nodes=4, mem_gib=6, distances=SNC_DISTANCES, cwd=REPO, timeout_s=1200,
        env={"PYTHONPATH": str(REPO), "LAB_NODES": "4", "LAB_DISTANCES": json.dumps(SNC_DISTANCES)},
    )
    wall_s = time.monotonic() - t0
    print(output[-6000:])
    print(f"lab VM wall time {wall_s:.0f} s (emulated: not a speed figure); files in {out_dir}")
    junit = out_dir / "numa.xml"
    assert junit.exists(), f"the VM wrote no junit report (exit {rc}); console: {out_dir}/.console\n{output[-3000:]}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [f"{c.get('name')}: {(c.find('failure') if c.find('failure') is not None else c.find('error')).get('message', '')[:300]}"
              for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    assert rc == 0 and failures == 0 and errors == 0, "lab tests failed:\n" + "\n".join(failed) + "\n" + output[-3000:]
    assert tests >= 7 and skipped == 0, f"{tests} lab tests ran, {skipped} skipped"
