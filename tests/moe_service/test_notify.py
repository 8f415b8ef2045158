"""sd_notify against real AF_UNIX datagram sockets bound by the test."""

from __future__ import annotations

import os
import time
import uuid

from bench.datagram import DatagramSink
from moe_service.notify import Liveness, Notifier, TimeoutExtender, Watchdog, watchdog_interval_s


def test_path_socket_receives_exactly_the_messages(notify_socket):
    n = Notifier()
    n.status("fastload 45% 6.1/13.5 GiB 3.2 GB/s")
    n.extend_timeout(30)
    n.ready()
    n.stopping()
    assert notify_socket.wait_for("STOPPING=1")
    assert notify_socket.texts() == [
        "STATUS=fastload 45% 6.1/13.5 GiB 3.2 GB/s",
        "EXTEND_TIMEOUT_USEC=30000000",
        "READY=1",
        "STOPPING=1",
    ]


def test_abstract_socket(monkeypatch):
    name = f"moe-test-{uuid.uuid4().hex}"
    sink = DatagramSink("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        n = Notifier()
        n.ready("serving")
        assert sink.wait_for("READY=1")
        assert sink.texts() == ["READY=1\nSTATUS=serving"]
    finally:
        sink.close()


def test_no_socket_is_a_silent_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    n.ready()
    n.status("x")
    n.watchdog()  # nothing raised, nothing sent anywhere


def test_status_is_sent_as_ascii(notify_socket):
    Notifier().status("fastload 50% \u2192 3 GB/s")
    assert notify_socket.wait_for("STATUS=")
    assert notify_socket.texts() == ["STATUS=fastload 50% ? 3 GB/s"]


def test_failed_start_sends_errno_and_status(notify_socket):
    Notifier().failed(12, "fastload failed: out of memory")
    assert notify_socket.wait_for("ERRNO=12")
    assert notify_socket.texts() == ["STATUS=fastload failed: out of memory\nERRNO=12"]


def test_extender_spaces_messages_below_the_extension(notify_socket):
    n = Notifier()
    with TimeoutExtender(n, after_s=0.2, interval_s=0.5, extend_s=1.0):
        time.sleep(1.6)
    times = [t for t, m in notify_socket.messages if m.startswith(b"EXTEND_TIMEOUT_USEC=1000000")]
    assert len(times) >= 3
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 1.0


def test_watchdog_interval_respects_watchdog_pid(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 0.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 0.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None


def test_watchdog_pings_while_alive_and_stops_when_stalled(notify_socket, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    live = Liveness()
    wd = Watchdog(Notifier(), live).start()
    assert wd.interval_s == 0.5
    t_end = time.monotonic() + 2.2
    while time.monotonic() < t_end:  # the engine loop beating
        live.beat()
        time.sleep(0.05)
    live.freeze()  # stall
    stalled_at = time.monotonic()
    time.sleep(1.6)
    wd.stop()
    pings = [t for t, m in notify_socket.messages if m == b"WATCHDOG=1"]
    alive = [t for t in pings if t <= stalled_at + 0.01]
    assert len(alive) >= 4
    gaps = [b - a for a, b in zip(alive, alive[1:], strict=False)]
    assert max(gaps) <= 0.5, gaps  # at most half of WATCHDOG_USEC apart
    late = [t for t in pings if t > stalled_at + 0.5]  # one ping may still cover beats just before the stall
    assert late == []


def test_extender_stops_once_ready(notify_socket):
    """The serve stage runs until shutdown inside its stage: after READY=1 no more
    EXTEND_TIMEOUT_USEC, which systemd would also apply to the watchdog timer."""
    n = Notifier()
    with TimeoutExtender(n, after_s=0.0, interval_s=0.2, extend_s=1.0):
        time.sleep(0.5)
        n.ready()
        ready_at = time.monotonic()
        time.sleep(0.8)
    late = [t for t, m in notify_socket.messages if m.startswith(b"EXTEND_TIMEOUT_USEC=") and t > ready_at + 0.05]
    assert late == []
    assert any(m.startswith(b"EXTEND_TIMEOUT_USEC=") for _, m in notify_socket.messages)
