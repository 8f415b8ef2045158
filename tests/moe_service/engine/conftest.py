"""Fixtures shared by the engine tests (a test module may define its own ``ops`` instead, e.g.
test_gpt_oss.py's two-thread pool)."""

from __future__ import annotations

import pytest
import torch

from moe_service.engine.ops import CpuOps


@pytest.fixture(scope="module")
def ops():
    """One CpuOps per test module: the calling thread computes alone (threads=0), torch on one
    thread, so results do not depend on the machine's core count."""
    torch.set_num_threads(1)
    o = CpuOps(threads=0)
    yield o
    o.close()
