"""Run `moe-service serve` as a subprocess the way systemd would: our own NOTIFY_SOCKET, a TOML
config in a temp dir, the demo model in a temp cache dir, port 0 (the URL comes from the
READY=1 STATUS line). Shared by bench/serve.py and the e2e tests (tests/e2e)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.datagram import DatagramSink

REPO = Path(__file__).resolve().parents[1]


def default_numba_cache_dir() -> str:
    """The user's kernel cache (shared across test sessions so kernels compile once)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    from moe_service.paths import cache_dir

    return str(cache_dir() / "numba")


def build_demo_model(cache_root: Path) -> Path:
    """Build the demo model under ``cache_root/moe-service/models`` (XDG_CACHE_HOME layout)."""
    from moe_service.demo_model import build_demo_model as build
    from moe_service.paths import DEMO_MODEL_FILENAME

    return build(out=cache_root / "moe-service" / "models" / DEMO_MODEL_FILENAME)


@dataclass
class ServiceProc:
    """A running `moe-service serve`: ``url``, ``proc``, the notify ``sink``, timings."""

    proc: subprocess.Popen
    sink: object
    workdir: Path
    log_path: Path
    url: str = ""
    t_spawn: float = 0.0
    t_ready: float = 0.0
    health_at_ready: int = 0  # /health status asked right after READY=1 arrived

    @property
    def ready_s(self) -> float:
        return self.t_ready - self.t_spawn

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
        self.sink.close()


def write_config(path: Path, **serve_overrides) -> Path:
    """A TOML config: the defaults, port 0, and ``serve_overrides`` in [serve]."""
    lines = ["[serve]", "host = \"127.0.0.1\"", "port = 0"]
    for k, v in serve_overrides.items():
        lines.append(f"{k} = {v!r}" if not isinstance(v, bool) else f"{k} = {str(v).lower()}")
    path.write_text("\n".join(lines) + "\n")
    return path


def start_service(model_path: Path, cache_root: Path, *, numba_cache_dir: str, extra_env: dict | None = None,
                  config: dict | None = None, timeout_s: float = 600, poll_health: bool = True) -> ServiceProc:
    """Spawn `python -m moe_service.cli serve --config X --model M` and wait for READY=1.

    The URL comes from READY=1's STATUS line (port 0); /health is asked at once and its status
    kept in ``health_at_ready``. Raises AssertionError with the service log when the process
    exits or times out first.
    """
    workdir = Path(tempfile.mkdtemp(prefix="moe-e2e-"))
    notify_path = str(workdir / "notify.sock")
    sink = DatagramSink(notify_path)
    cfg = write_config(workdir / "config.toml", **(config or {}))
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}
    env.pop("WATCHDOG_USEC", None)  # only a test that asks for a watchdog gets one (extra_env)
    env.pop("WATCHDOG_PID", None)
    env.update({
        "NOTIFY_SOCKET": notify_path,
        "XDG_CACHE_HOME": str(cache_root),
        "NUMBA_CACHE_DIR": numba_cache_dir,
        "MOE_SERVICE__LOG__TARGET": "json",
        "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p),
        **(extra_env or {}),
    })
    log_path = workdir / "service.log"
    log_file = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
    t_spawn = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "moe_service.cli", "serve", "--config", str(cfg),
                             "--model", str(model_path)], cwd=REPO, env=env, stdout=log_file,
                            stderr=subprocess.STDOUT)
    sp = ServiceProc(proc, sink, workdir, log_path, t_spawn=t_spawn)
    end = t_spawn + timeout_s
    while time.monotonic() < end:
        for t, msg in list(sink.messages):
            text = msg.decode("latin-1")
            if "READY=1" in text:
                m = re.search(r"STATUS=serving \S+ on (http://\S+)", text)
                assert m, f"READY=1 without the serving STATUS: {text!r}"
                sp.url, sp.t_ready = m.group(1), t
                if poll_health:
                    sp.health_at_ready = httpx.get(f"{sp.url}/health", timeout=10).status_code
                return sp
        if proc.poll() is not None:
            sink.close()
            raise AssertionError(f"moe-service exited {proc.returncode} before READY=1:\n{sp.log_text()[-6000:]}")
        time.sleep(0.02)
    proc.kill()
    sink.close()
    raise AssertionError(f"no READY=1 within {timeout_s} s:\n{sp.log_text()[-6000:]}")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # surfaced by the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
