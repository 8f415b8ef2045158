"""Fleet checks inside the systemd container lab (tests/lab/container.py); writes $LAB_OUT/report.json.

Runs as root under systemd (PID 1), started by tests/systemd/test_fleet_lab.py, with the
system Python and the standard library only. Steps, each recorded as it finishes:

  env        systemd and HAProxy versions, PID 1
  ansible_1  ansible/site.yml (host roles skipped: /proc/sys and /sys are read-only here, the
             VM lab covers them) with tests/systemd/lab/fleet-inventory.yml: HAProxy from the
             role moe_balancer on :8000, moe-service@a (:8001) and moe-service@b (:8002) on
             the demo model, installed offline from the wheelhouse
  serving    both units active, /health 200 on each port and through HAProxy, HAProxy's view
  ansible_2  the same playbook again: must report changed=0
  rolling    clients stream completions through HAProxy without pause while the playbook
             runs with a changed configuration (-e moe_lab_generation=2): every request's
             status and completeness, HAProxy's server states sampled every 0.2 s, each
             unit's InvocationID before and after, HAProxy's own log lines
  unmanaged  the same clients while an operator restarts moe-service@a by hand (systemctl,
             no drain): the instance's SIGTERM path (/health 503, listener closed, in-flight
             requests finished) plus HAProxy's health checks and retries alone

Environment (set by the test): LAB_OUT, LAB_REPO, LAB_ANSIBLE_PLAYBOOK, LAB_MOE_WHEELHOUSE,
LAB_DEMO_MODEL, LAB_SHARED_SITE_PACKAGES, LAB_FLEET_CLIENTS (concurrent streams, default 2).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# lab_common sits next to this script (its folder is sys.path[0]): the report, the command
# runner, the service venv's preparation and ansible-playbook, shared with lab_checks.py.
from lab_common import (
    OUT,
    PLAYBOOK_BIN,
    REPO,
    ansible_playbook,
    prepare_service_venv,
    read,
    recorder,
    report,
    save,
    sh,
)

INVENTORY = REPO / "tests/systemd/lab/fleet-inventory.yml"
CTL = "/usr/local/sbin/moe-balancer-ctl"
BACKEND = "moe"
FRONTEND = ("127.0.0.1", 8000)
INSTANCES = {"a": 8001, "b": 8002}
UNITS = {name: f"moe-service@{name}.service" for name in INSTANCES}
SERVERS = {name: f"lab:{port}" for name, port in INSTANCES.items()}

step = recorder("fleet_checks")


def playbook(log_name: str, extra: list[str] | None = None, timeout_s: float = 1500) -> dict:
    argv = [PLAYBOOK_BIN, "-i", str(INVENTORY), str(REPO / "ansible/site.yml"), "--skip-tags", "host"] + (extra or [])
    return ansible_playbook(argv, log_name, timeout_s)


def ctl_status() -> dict:
    res = subprocess.run([CTL, "status", BACKEND], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"moe-balancer-ctl status: {res.stderr.strip()}")
    return json.loads(res.stdout)


def http_status(host: str, port: int, path: str) -> int | None:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", path)
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return None


def unit_props(unit: str) -> dict[str, str]:
    out = sh(["systemctl", "show", unit, "-p", "ActiveState,SubState,InvocationID,NRestarts,MainPID"])
    return dict(line.split("=", 1) for line in out["stdout"].splitlines() if "=" in line)


@step("env")
def env_step() -> dict:
    return {
        "pid1": read("/proc/1/comm"),
        "systemd": sh(["systemctl", "--version"])["stdout"].splitlines()[0],
        "haproxy": sh(["haproxy", "-v"])["stdout"].splitlines()[0],
        "haproxy_installed_before": Path("/usr/sbin/haproxy").exists(),
        "container": os.environ.get("container", ""),
    }


@step("ansible_1")
def ansible_1() -> dict:
    prep = prepare_service_venv()
    out = playbook("ansible-1.log")
    out["venv_prep"] = prep
    return out


@step("serving")
def serving() -> dict:
    return {
        "units": {name: unit_props(unit) for name, unit in UNITS.items()},
        "health": {name: http_status("127.0.0.1", port, "/health") for name, port in INSTANCES.items()},
        "health_via_haproxy": http_status(*FRONTEND, "/health"),
        "models_via_haproxy": http_status(*FRONTEND, "/v1/models"),
        "haproxy": ctl_status(),
        "haproxy_active": unit_props("haproxy.service").get("ActiveState"),
        "config": Path("/etc/haproxy/haproxy.cfg").read_text(),
    }


@step("ansible_2")
def ansible_2() -> dict:
    return playbook("ansible-2.log")


def stream_once(prompt: str, max_tokens: int) -> dict:
    """One streamed completion through HAProxy: status, chunks, [DONE] seen, finish reason."""
    t0 = time.monotonic()
    rec: dict[str, object] = {"t0": round(t0, 3), "status": None, "chunks": 0, "done": False, "finish_reason": None}
    try:
        conn = http.client.HTTPConnection(*FRONTEND, timeout=120)
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["body"] = resp.read()[:500].decode(errors="replace")
        else:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec["done"] = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = chunk["error"]
                    break
                rec["chunks"] = int(rec["chunks"]) + 1
                reason = chunk["choices"][0].get("finish_reason")
                if reason:
                    rec["finish_reason"] = reason
        conn.close()
    except Exception as exc:  # a cut stream shows up here (connection reset, incomplete read)
        rec["exception"] = f"{type(exc).__name__}: {exc}"
    rec["t1"] = round(time.monotonic(), 3)
    return rec


class Clients:
    """N threads streaming completions through HAProxy back to back until stopped."""

    def __init__(self, n: int):
        self.stop = threading.Event()
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]

    def run(self, i: int) -> None:
        k = 0
        while not self.stop.is_set():
            rec = stream_once(f"Client {i}, request {k}: once upon a time", 16 + 8 * (k % 3))
            rec["client"] = i
            with self.lock:
                self.records.append(rec)
            k += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


class StatsSampler:
    """HAProxy's server states (moe-balancer-ctl status) every 0.2 s, kept when they change."""

    def __init__(self):
        self.stop = threading.Event()
        self.changes: list[dict] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        last = None
        last_t = None  # when the previous sample was read: a change happened after it
        while not self.stop.is_set():
            try:
                now = {name: {k: s[k] for k in ("status", "admin_state", "sessions")} for name, s in ctl_status().items()}
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                now = None
            if now is not None:
                t = round(time.monotonic(), 3)
                shape = {n: (s["status"], s["admin_state"]) for n, s in now.items()}
                if shape != last:
                    self.changes.append({"t": t, "after": last_t, "servers": now})
                    last = shape
                last_t = t
            time.sleep(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=30)


@step("rolling")
def rolling() -> dict:
    before = {name: unit_props(unit) for name, unit in UNITS.items()}
    n_clients = int(os.environ.get("LAB_FLEET_CLIENTS", "2"))
    with StatsSampler() as sampler, Clients(n_clients) as clients:
        time.sleep(3)  # streams running through both instances before the rollout starts
        t_play0 = time.monotonic()
        run = playbook("ansible-rolling.log", ["-e", "moe_lab_generation=2"])
        t_play1 = time.monotonic()
        time.sleep(3)  # and after it
    after = {name: unit_props(unit) for name, unit in UNITS.items()}
    journal = sh(["journalctl", "-u", "haproxy.service", "-o", "short-monotonic", "--no-pager"])["stdout"]
    recs = clients.records
    return {
        "playbook": run,
        "window": [round(t_play0, 3), round(t_play1, 3)],
        "clients": n_clients,
        "requests": len(recs),
        "requests_during_playbook": sum(1 for r in recs if r["t1"] >= t_play0 and r["t0"] <= t_play1),
        "statuses": sorted({str(r["status"]) for r in recs}),
        "bad": [r for r in recs if r["status"] != 200 or not r["done"] or r.get("exception") or r.get("error")
                or not r["finish_reason"]][:20],
        "records": recs[-400:],
        "stats_changes": sampler.changes,
        "stats_errors": sampler.errors[:20],
        "units_before": before,
        "units_after": after,
        "config_a": Path("/etc/moe-service/a.toml").read_text(),
        "haproxy_log": [ln for ln in journal.splitlines() if "moe/" in ln or "Server" in ln][-60:],
    }


@step("unmanaged")
def unmanaged() -> dict:
    unit, server = UNITS["a"], SERVERS["a"]
    before = unit_props(unit)
    with StatsSampler() as sampler, Clients(int(os.environ.get("LAB_FLEET_CLIENTS", "2"))) as clients:
        time.sleep(3)
        t0 = time.monotonic()
        restart = sh(["systemctl", "restart", unit], timeout_s=900)
        t1 = time.monotonic()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and ctl_status()[server]["status"] != "UP":
            time.sleep(0.2)
        time.sleep(2)
    recs = clients.records
    return {
        "restart_rc": restart["rc"],
        "restart_stderr": restart["stderr"][-1500:],
        "window": [round(t0, 3), round(t1, 3)],
        "requests": len(recs),
        "requests_during_restart": sum(1 for r in recs if r["t1"] >= t0 and r["t0"] <= t1),
        "statuses": sorted({str(r["status"]) for r in recs}),
        "bad": [r for r in recs if r["status"] != 200 or not r["done"] or r.get("exception") or r.get("error")
                or not r["finish_reason"]][:20],
        "stats_changes": sampler.changes,
        "units_before": before,
        "units_after": unit_props(unit),
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    env_step()
    first = ansible_1()
    if first.get("rc") == 0:
        serving()
        ansible_2()
        rolling()
        unmanaged()
    report["finished"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
