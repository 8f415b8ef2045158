"""Shared fixtures: a datagram socket standing in for systemd's notify socket
(bench.datagram.DatagramSink), and config helpers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from bench.datagram import DatagramSink

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def notify_socket(monkeypatch):
    """NOTIFY_SOCKET pointing at a real path socket owned by the test; yields the sink."""
    d = tempfile.mkdtemp(prefix="notify-")
    path = os.path.join(d, "notify.sock")
    sink = DatagramSink(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sink
    sink.close()
    os.unlink(path)
    os.rmdir(d)


@pytest.fixture
def clean_env(monkeypatch):
    """No MOE_SERVICE* variables from the caller's environment leak into a test."""
    for key in list(os.environ):
        if key.upper().startswith("MOE_SERVICE"):
            monkeypatch.delenv(key)
    return monkeypatch


def pytest_collection_finish(session):
    """Start the systemd lab VM (tests/systemd/test_lab.py) and the fleet container lab
    (tests/systemd/test_fleet_lab.py) in background threads as soon as collection selected
    their tests, so their minutes overlap the rest of the suite; their fixtures wait for the
    reports. Nothing starts for --collect-only, or when the
    lab's tests were deselected or are skipped (no VM here)."""
    if session.config.option.collectonly:
        return
    lab_files = {Path(__file__).resolve().parent / "systemd" / name for name in ("test_lab.py", "test_fleet_lab.py")}
    started = set()
    for item in session.items:
        module = getattr(item, "module", None)
        path = Path(str(item.path)).resolve()
        if (module is not None and path in lab_files and path not in started
                and hasattr(module, "start_in_background") and item.get_closest_marker("skip") is None):
            module.start_in_background()
            started.add(path)
