"""The `lab` marker: tests that boot the NUMA lab VM (tests/lab/vm.py).

They are skipped, with lab_available()'s reason (what is missing and the apt-get command),
when the VM cannot run here, and always inside the VM itself (no VM in a VM).
"""

from __future__ import annotations

import os

import pytest

from tests.lab.vm import lab_available


def pytest_collection_modifyitems(config, items):
    lab_items = [i for i in items if i.get_closest_marker("lab") is not None]
    if not lab_items:
        return
    if os.environ.get("NUMA_LAB") == "1":
        reason = "already inside the NUMA lab VM"
    else:
        ok, reason = lab_available()
        if ok:
            return
    for item in lab_items:
        item.add_marker(pytest.mark.skip(reason=reason))
