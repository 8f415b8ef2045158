"""The host side of the two systemd labs: tests/systemd/test_lab.py (the numa-lab VM,
tests/lab/vm.py) and tests/systemd/test_fleet_lab.py (the systemd container,
tests/lab/container.py).

Each lab runs one check script inside (tests/systemd/lab/lab_checks.py, fleet_checks.py; their
shared part is tests/systemd/lab/lab_common.py) that writes report.json; the tests only read
that report. What both hosts do the same way lives here: running code against this checkout,
building the demo model where the lab sees it, booting the lab once in a background thread
(tests/conftest.py starts it when collection selected the module), reading the report, and
looking up one step of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# Where the units' sandbox hides a path from the service (units/moe-service.service):
# PrivateTmp=yes gives it its own /tmp and /var/tmp, ProtectHome=yes empties /home, /root and
# /run/user. A lab that runs files of this checkout under the unit must not take them from there.
UNIT_HIDDEN_ROOTS = ("/tmp", "/var/tmp", "/home", "/root", "/run/user")

_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                      ".ruff_cache", ".mypy_cache")


def unit_hidden_root(path: Path) -> str | None:
    """The root of UNIT_HIDDEN_ROOTS that ``path`` lies under, else None."""
    resolved = path.resolve()
    for root in UNIT_HIDDEN_ROOTS:
        if resolved == Path(root) or Path(root) in resolved.parents:
            return root
    return None


def checkout_for_units(work: Path) -> Path:
    """This checkout where the service's units can read it: REPO itself, or, when REPO lies
    under a path the units hide (:data:`UNIT_HIDDEN_ROOTS`: a clone under /var/tmp or /root),
    a copy of its files (no .git, venv or caches) at ``work``/checkout, made afresh. The labs
    run their check scripts, and the units their probes, from what this returns."""
    root = unit_hidden_root(REPO)
    if root is None:
        return REPO
    dest = work / "checkout"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(REPO, dest, ignore=_COPY_IGNORE)
    print(f"lab: this checkout ({REPO}) is under {root}, which the units hide from the service "
          f"(PrivateTmp/ProtectHome); the lab runs from a copy at {dest}", file=sys.stderr)
    return dest


def this_checkout(code: str, environ: dict[str, str] | None, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run Python ``code`` against this checkout's packages (an editable install of another
    checkout in the venv must not answer for it) in ``environ`` (None: os.environ)."""
    prelude = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import moe_service; "
               f"assert moe_service.__file__.startswith({str(REPO)!r}), moe_service.__file__\n")
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True,
                          env=environ, timeout=timeout_s)


def build_demo_model(model: Path, environ: dict[str, str] | None) -> str | None:
    """Build the embedded demo model at ``model``, readable by the service user (0644).
    None when built, else why it cannot be built (the last line of the error)."""
    res = this_checkout("from pathlib import Path; from moe_service.demo_model import build_demo_model; "
                        f"build_demo_model(out=Path({str(model)!r}))", environ)
    if res.returncode != 0:
        return "the demo model cannot be built: " + (res.stderr.strip().splitlines() or ["?"])[-1]
    model.chmod(0o644)
    return None


class BackgroundLab:
    """``boot(environ)`` run once per process in a daemon thread, started by :meth:`start`;
    the future gives its report, or the pytest outcome (skip, fail) it raised.

    ``environ`` is a snapshot of os.environ taken at the start: the other tests monkeypatch
    os.environ while the lab runs beside them."""

    def __init__(self, thread_name: str, boot: Callable[[dict[str, str]], dict]):
        self.thread_name = thread_name
        self.boot = boot
        self._future: Future | None = None
        self._lock = threading.Lock()

    def start(self) -> Future:
        with self._lock:
            if self._future is None:
                fut: Future = Future()
                environ = dict(os.environ)

                def run() -> None:
                    if not fut.set_running_or_notify_cancel():
                        return
                    try:
                        fut.set_result(self.boot(environ))
                    except BaseException as e:  # pytest's Skipped/Failed outcomes travel to the fixture too
                        fut.set_exception(e)

                threading.Thread(target=run, name=self.thread_name, daemon=True).start()
                self._future = fut
            return self._future


def collect_report(out: Path, rc: int, output: str, t0: float, lab: str, rc_key: str) -> dict:
    """The report.json the check script left in ``out`` (the lab's out folder), with the
    host's wall time since ``t0`` (host_wall_s), out_dir and the lab's exit status under
    ``rc_key``. The script's output goes to out/lab.log. Fails the test naming ``lab`` ("the
    lab VM") with the output's tail (and the kernel console's, for the VM) when there is no
    report."""
    (out / "lab.log").write_text(output)
    report_path = out / "report.json"
    if not report_path.exists():
        console = out / ".console"
        tail = console.read_text(errors="replace")[-3000:] if console.exists() else ""
        pytest.fail(f"{lab} wrote no report (exit {rc}): {output[-3000:]}\n{tail}")
    report = json.loads(report_path.read_text())
    report["host_wall_s"] = round(time.monotonic() - t0, 1)
    report["out_dir"] = str(out)
    report[rc_key] = rc
    return report


def report_step(report: dict, name: str, lab: str, rc_key: str) -> dict:
    """Step ``name`` of the report; fails the test when the lab did not reach it or it raised."""
    s = report["steps"].get(name)
    if s is None:
        pytest.fail(f"{lab} did not reach step {name!r} (exit {report[rc_key]}, steps done: {report['order']}; "
                    f"see {report['out_dir']})")
    assert "error" not in s, f"step {name} raised: {s['error']}\n{s.get('traceback', '')}"
    return s
