"""systemd notifications (sd_notify) on the ``sdnotify`` package.

- :class:`Notifier`: READY=1, STATUS=, EXTEND_TIMEOUT_USEC=, WATCHDOG=1, STOPPING=1, ERRNO=.
  Without NOTIFY_SOCKET every call is a silent no-op; path sockets and abstract (``@``)
  sockets both work (sdnotify replaces the ``@`` with a NUL byte).
- :class:`TimeoutExtender`: while a long stage runs and reports progress, sends
  EXTEND_TIMEOUT_USEC periodically so a slow load is not killed by TimeoutStartSec; a stage
  without progress for its stall limit gets no more extensions, so a hung one still is.
- :class:`Liveness` + :class:`Watchdog`: WATCHDOG=1 at half of WATCHDOG_USEC, only while the
  engine loop keeps advancing its liveness counter and every health check passes (steps
  complete, the worker pool lives, the HTTP event loop runs): a stuck or failing engine stops
  the pings and systemd restarts the service. Only when WATCHDOG_PID is unset or ours.

STATUS text is sent as ASCII (sdnotify encodes with latin-1): other characters become ``?``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import sdnotify

from moe_service.log import get_logger

log = get_logger(__name__)


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode("ascii").replace("\n", " ")


class Notifier:
    """Sends sd_notify messages to $NOTIFY_SOCKET (read when constructed).

    Thread-safe. ``sent`` keeps the messages sent (for logs and tests); ``enabled`` tells
    whether a socket is there.
    """

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = sdnotify.SystemdNotifier() if self.enabled else None
        self._lock = threading.Lock()
        self.sent: list[str] = []
        self.is_ready = False

    def send(self, *lines: str) -> None:
        """Send one datagram made of ``KEY=value`` lines."""
        msg = "\n".join(_ascii(line) for line in lines)
        with self._lock:
            self.sent.append(msg)
            if self._n is not None:
                self._n.notify(msg)

    def ready(self, status: str | None = None) -> None:
        """READY=1 (and STATUS= when given): the service is serving."""
        self.is_ready = True
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        """STATUS=<text>: shown by `systemctl status`."""
        self.send(f"STATUS={text}")

    def extend_timeout(self, seconds: float) -> None:
        """EXTEND_TIMEOUT_USEC=<n>: the next message must come within ``seconds``."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def watchdog(self) -> None:
        """WATCHDOG=1: one keep-alive ping."""
        self.send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> None:
        """STOPPING=1: shutdown has begun."""
        self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def failed(self, err_no: int, status: str) -> None:
        """ERRNO=<n> and STATUS=<text> for a failed start."""
        self.send(f"STATUS={status}", f"ERRNO={int(err_no)}")


def watchdog_interval_s() -> float | None:
    """Half of WATCHDOG_USEC in seconds when the watchdog is meant for this process, else None.

    systemd sets WATCHDOG_USEC (and WATCHDOG_PID) when the unit has WatchdogSec=; a WATCHDOG_PID
    naming another process (e.g. our parent's) means the pings are not ours to send.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("watchdog_usec_invalid", value=usec)
        return None
    return value / 2 / 1_000_000 if value > 0 else None


class Liveness:
    """A counter the engine loop advances each time it makes progress (or idles healthily),
    plus health checks: callables returning None while their part works, else the reason
    it does not (the batch loop's :meth:`~moe_service.engine.batch.BatchLoop.health`, the
    HTTP event loop's heartbeat). The watchdog pings only while the counter advances and
    every check passes: liveness means work completes, not that a thread is still looping."""

    def __init__(self) -> None:
        self._count = 0
        self._frozen = False
        self._checks: dict[str, Callable[[], str | None]] = {}

    def add_check(self, name: str, check: Callable[[], str | None]) -> None:
        """Register ``check() -> str | None`` under ``name`` (replaces one of the same name)."""
        self._checks[name] = check

    def remove_check(self, name: str) -> None:
        self._checks.pop(name, None)

    def problem(self) -> str | None:
        """The first failing check's reason as ``name: reason``, else None. A check that raises
        counts as failing (its exception is the reason)."""
        for name, check in list(self._checks.items()):
            try:
                reason = check()
            except Exception as e:  # noqa: BLE001 - a broken check must not keep the pings going
                reason = f"health check raised {type(e).__name__}: {e}"
            if reason:
                return f"{name}: {reason}"
        return None

    def beat(self) -> None:
        if not self._frozen:
            self._count += 1

    def freeze(self) -> None:
        """Stop advancing for good: the test hook for a stalled engine."""
        self._frozen = True

    @property
    def count(self) -> int:
        return self._count


PING_MARGIN = 0.8
"""Pings go out at 80% of the half-interval, so scheduling delays on a loaded host still keep
consecutive pings within half of WATCHDOG_USEC."""


class Watchdog:
    """Pings WATCHDOG=1 while ``liveness`` advanced since the last ping, so that consecutive
    pings are at most ``interval_s`` apart (they are scheduled every ``PING_MARGIN *
    interval_s``).

    ``interval_s`` defaults to :func:`watchdog_interval_s` (half of WATCHDOG_USEC); when that is
    None the watchdog does nothing. Runs in a daemon thread; ``stop()`` ends it.
    """

    def __init__(self, notifier: Notifier, liveness: Liveness, interval_s: float | None = None):
        self.notifier = notifier
        self.liveness = liveness
        self.interval_s = interval_s if interval_s is not None else watchdog_interval_s()
        self.period_s = self.interval_s * PING_MARGIN if self.interval_s is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0

    def start(self) -> Watchdog:
        if self.interval_s is None:
            return self
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        log.info("watchdog_started", interval_s=round(self.interval_s, 3))
        return self

    def _run(self) -> None:
        period_s = self.period_s
        assert period_s is not None  # start() runs this thread only with an interval
        last = self.liveness.count
        self.notifier.watchdog()  # the service just became ready: first ping now
        self.pings += 1
        stalled_logged = False
        next_t = time.monotonic() + period_s
        while not self._stop.wait(max(0.0, next_t - time.monotonic())):
            next_t += period_s
            if next_t < time.monotonic():  # we were descheduled past a slot: do not burst
                next_t = time.monotonic() + period_s
            now_count = self.liveness.count
            problem = self.liveness.problem()
            if now_count != last and problem is None:
                last = now_count
                self.notifier.watchdog()
                self.pings += 1
                stalled_logged = False
            elif not stalled_logged:
                if problem is not None:
                    log.error("watchdog_unhealthy", reason=problem, interval_s=self.interval_s)
                else:
                    log.error("watchdog_engine_stalled", liveness=now_count, interval_s=self.interval_s)
                stalled_logged = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


TEST_STALL_ENV = "MOE_SERVICE_TEST_STALL_AFTER_S"
"""Test hook: after this many seconds of being ready, the liveness signal stops advancing, so
the watchdog stops pinging and systemd restarts the service (tests/systemd, tests/e2e)."""


def start_watchdog(notifier: Notifier, liveness: Liveness) -> Watchdog:
    """Start WATCHDOG=1 pings driven by ``liveness`` (no-op without WATCHDOG_USEC), and arm
    the stall test hook (:data:`TEST_STALL_ENV`) when its environment variable is set."""
    wd = Watchdog(notifier, liveness).start()
    stall_after = os.environ.get(TEST_STALL_ENV)
    if stall_after:
        log.warning("test_stall_armed", after_s=float(stall_after))
        t = threading.Timer(float(stall_after), liveness.freeze)
        t.daemon = True
        t.start()
    return wd


class TimeoutExtender:
    """Context manager: while its body runs longer than ``after_s``, send
    EXTEND_TIMEOUT_USEC=<extend_s> every ``interval_s`` (``extend_s`` > ``interval_s``, so each
    extension outlasts the gap to the next one), but only while the work progresses:
    ``progress()`` returns a marker (bytes loaded, a phase name...) that changes when it does;
    once it has not changed for ``stall_limit_s`` (None: no limit), the extensions stop and
    systemd's start timeout runs out (a stage hung on a dead disk or a stuck driver call is
    killed instead of staying "activating" forever). ``stalled`` tells it happened.

    Only while starting: once READY=1 has gone out (the serve stage runs until shutdown inside
    its stage) it stops, because systemd applies EXTEND_TIMEOUT_USEC to the watchdog timer as
    well and would never see a stalled engine.
    """

    def __init__(self, notifier: Notifier, after_s: float, interval_s: float, extend_s: float, *,
                 progress=None, stall_limit_s: float | None = None, name: str = "stage"):
        if extend_s <= interval_s:
            raise ValueError(f"extend_s ({extend_s}) must exceed interval_s ({interval_s})")
        self.notifier, self.after_s, self.interval_s, self.extend_s = notifier, after_s, interval_s, extend_s
        self.progress = progress
        self.stall_limit_s = stall_limit_s
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.stalled = False

    def __enter__(self) -> TimeoutExtender:
        if self.notifier.enabled:
            self._thread = threading.Thread(target=self._run, name="extend-timeout", daemon=True)
            self._thread.start()
        return self

    def _marker(self):
        try:
            return self.progress() if self.progress is not None else None
        except Exception as e:  # noqa: BLE001 - a broken marker counts as no progress
            return ("error", str(e))

    def _run(self) -> None:
        last, t_last = self._marker(), time.monotonic()
        if self._stop.wait(self.after_s):
            return
        while not self.notifier.is_ready:
            now, marker = time.monotonic(), self._marker()
            if marker != last:
                last, t_last = marker, now
            if self.stall_limit_s is not None and now - t_last > self.stall_limit_s:
                self.stalled = True
                log.error("stage_stalled", stage=self.name, seconds_without_progress=round(now - t_last, 1),
                          stall_limit_s=self.stall_limit_s,
                          effect="no more EXTEND_TIMEOUT_USEC: systemd's start timeout will stop the service")
                self.notifier.status(f"{self.name}: no progress for {now - t_last:.0f} s (stall limit "
                                     f"{self.stall_limit_s:g} s); not extending the start timeout")
                return
            self.notifier.extend_timeout(self.extend_s)
            self.sent += 1
            if self._stop.wait(self.interval_s):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
