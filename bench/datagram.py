"""A bound AF_UNIX datagram socket that records what is sent to it: systemd's notify socket (and
journald's) as the tests see it. Used by the ``notify_socket`` fixture (tests/conftest.py), the
log and notify tests, and the service harness (bench/service_proc.py: bench serve and the e2e tests)."""

from __future__ import annotations

import socket
import threading
import time


class DatagramSink:
    """A bound AF_UNIX datagram socket that collects every message sent to it, with arrival times."""

    def __init__(self, address: str | bytes):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data))

    def texts(self) -> list[str]:
        return [m.decode("latin-1") for _, m in self.messages]

    def wait_for(self, needle: str, timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if any(needle in t for t in self.texts()):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
