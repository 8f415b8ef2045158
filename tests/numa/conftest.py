"""Tests that run inside the NUMA lab VM (NUMA_LAB=1), booted once by tests/lab/test_numa_lab.py.

Outside the VM every test here is skipped with the reason. Inside, the session records the
kernel's initial numa_balancing (the VM starts at 1, a real kernel default) and then sets it
to 0, as the Ansible role does on production hosts. Nothing here compiles numba kernels
(emulated CPUs make JIT take minutes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moe_service.numa import Topology
from tests.numa.models import ensure_models

IN_LAB = os.environ.get("NUMA_LAB") == "1"
SKIP_REASON = ("runs inside the NUMA lab VM: tests/lab/test_numa_lab.py boots it "
               "(or: python tests/lab/vm.py --nodes 4 --mem-gib 6 -- python -m pytest tests/numa)")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if IN_LAB:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def initial_topology() -> Topology:
    """The VM's topology as booted (numa_balancing still at its default)."""
    return Topology.read()


@pytest.fixture(scope="session")
def topology(initial_topology) -> Topology:
    """The VM's topology after kernel.numa_balancing was set to 0; at least two nodes."""
    assert initial_topology.n_nodes >= 2, f"the lab VM has {initial_topology.n_nodes} node(s), expected several"
    Path("/proc/sys/kernel/numa_balancing").write_text("0\n")
    return Topology.read()


@pytest.fixture(scope="session")
def models() -> dict[str, Path]:
    """The synthetic MoE files (written on the host by the outer test; see tests/numa/models.py)."""
    return ensure_models()
