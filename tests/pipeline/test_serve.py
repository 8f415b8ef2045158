"""The serve stage in the real lifecycle, in a subprocess over a fake engine: READY=1 only once
/health answers, SIGTERM lets the in-flight request finish (STOPPING=1, exit 0), the grace
period bounds the drain, a busy port fails the stage."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
FAKES_MODULE = "tests.support.serving_fakes"


def start(env_extra: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}
    env.update({
        "PYTHONPATH": str(REPO),
        "MOE_SERVICE__PIPELINE__STAGES": '["warmup", "serve"]',
        "MOE_SERVICE__SERVE__PORT": "0",
        "MOE_SERVICE__LOG__TARGET": "json",
        "FAKE_STEP_DELAY_S": "0.01",
        **env_extra,
    })
    return subprocess.Popen([sys.executable, "-m", FAKES_MODULE], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def ready_url(sink, proc, timeout_s: float = 60) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for text in sink.texts():
            if "READY=1" in text:
                m = re.search(r"STATUS=serving \S+ on (http://\S+)", text)
                assert m, text
                return m.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"service exited {proc.returncode} before READY=1:\n{proc.stdout.read()}")
        time.sleep(0.01)
    raise AssertionError("no READY=1")


def stop(proc) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=10)
    return out


def stream_tokens(url: str, max_tokens: int, got_first: threading.Event, result: dict) -> None:
    body = {"prompt": "drain me", "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    got_first.set()
    except httpx.HTTPError as e:
        result["error"] = e
    result["events"] = events
    got_first.set()


def test_ready_after_health_and_sigterm_drains_the_request(notify_socket):
    proc = start({})
    try:
        url = ready_url(notify_socket, proc)
        # READY=1 is only sent after /health answered 200, so it answers 200 now
        assert httpx.get(f"{url}/health").status_code == 200
        statuses = [t for t in notify_socket.texts() if "STATUS=" in t]
        assert any("warmup" in t for t in statuses)
        got_first, result = threading.Event(), {}
        t = threading.Thread(target=stream_tokens, args=(url, 120, got_first, result))
        t.start()
        assert got_first.wait(20)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        events = result["events"]
        assert "error" not in result
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 120
        finals = [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"]]
        assert finals[-1] == "length"
        assert proc.wait(20) == 0
        assert notify_socket.wait_for("STOPPING=1", 5)
        ready_at = next(t for t, m in notify_socket.messages if b"READY=1" in m)
        stopping_at = next(t for t, m in notify_socket.messages if b"STOPPING=1" in m)
        assert stopping_at > ready_at
    finally:
        out = stop(proc)
    assert "serve_stopping" in out and "service_exit" in out


def test_grace_period_bounds_the_drain(notify_socket):
    proc = start({"MOE_SERVICE__SERVE__SHUTDOWN_GRACE_S": "0.5", "FAKE_STEP_DELAY_S": "0.02"})
    try:
        url = ready_url(notify_socket, proc)
        got_first, result = threading.Event(), {}
        t = threading.Thread(target=stream_tokens, args=(url, 2000, got_first, result))
        t.start()
        assert got_first.wait(20)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 10
        t.join(10)
        assert "[DONE]" not in result["events"]  # cut off, not completed
    finally:
        stop(proc)


def test_busy_port_fails_the_serve_stage(notify_socket):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    proc = start({"MOE_SERVICE__SERVE__PORT": str(port)})
    try:
        assert proc.wait(60) == 5
        out = proc.stdout.read()
        assert f"127.0.0.1:{port}" in out
        assert notify_socket.wait_for("ERRNO=", 5)
        assert not any("READY=1" in t for t in notify_socket.texts())
    finally:
        stop(proc)
        busy.close()


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_sigint_when_idle_exits_cleanly(notify_socket, sig):
    proc = start({})
    try:
        ready_url(notify_socket, proc)
        proc.send_signal(sig)
        assert proc.wait(20) == 0
    finally:
        stop(proc)
