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
  sessions_affine     four agent-like sessions at once through HAProxy's conversation affinity
             (the default): a shared system prompt and ~40 KB of tools, each conversation
             growing by an answer and a tool result per turn; per turn the instance that
             served it (X-Moe-Server), prompt and cached tokens, TTFT
  sessions_leastconn  the balancer alone re-run with moe_balancer_affinity=false (leastconn),
             four new sessions the same way, for comparison
  rolling    clients stream completions through HAProxy without pause while the playbook
             runs with a changed configuration (-e moe_lab_generation=2): every request's
             status and completeness, HAProxy's server states sampled every 0.2 s, each
             unit's InvocationID before and after, HAProxy's own log lines; one more client
             sends agent-sized (45 KB) chat requests; the playbook also restores affinity
  sessions_after_restart  the affine sessions' next turn after every instance restarted: its
             instance, cached tokens and TTFT, against the same turn sent with an empty cache
             (a nonce before the system prompt, same length), one request at a time; the
             prefix store's files
             (mode, owner) and the units' prefix_store_saved / prefix_store_indexed log lines
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
import pwd
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
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


def sse_chunks(resp, rec: dict) -> Iterator[dict]:
    """The JSON chunks of an OpenAI SSE stream (``data:`` lines); ends at ``[DONE]``, setting
    rec["done"], or at an error chunk, setting rec["error"] to its error."""
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            rec["done"] = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            rec["error"] = chunk["error"]
            return
        yield chunk


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
            for chunk in sse_chunks(resp, rec):
                rec["chunks"] = int(rec["chunks"]) + 1
                reason = chunk["choices"][0].get("finish_reason")
                if reason:
                    rec["finish_reason"] = reason
        conn.close()
    except Exception as exc:  # a cut stream shows up here (connection reset, incomplete read)
        rec["exception"] = f"{type(exc).__name__}: {exc}"
    rec["t1"] = round(time.monotonic(), 3)
    return rec


# --- agent-like sessions --------------------------------------------------------------------

# What every session of one agent shares: a system prompt (~1,200 tokens of the demo model) and a
# tool list (~40 KB of JSON). tool_choice "none" keeps the tools out of the demo model's
# prompt (its prefill on a shared CI CPU runs at tens of tokens a second): HAProxy still
# buffers and hashes agent-sized bodies, the engine sees a prompt of agent shape.
AGENT_SYSTEM = ("You are a careful coding agent working in a large repository. Read files before you change "
                "them, keep changes small, run the tests after each change and report what you did. ") * 34
AGENT_TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool {i}: reads, searches or edits files of the repository. " * 14,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}}}}}
    for i in range(40)]
SESSION_TURNS = 4
N_SESSIONS = 4
BLOCK_TOKENS = 64
OPENINGS = [f"Task {k}: the test test_{w} in tests/test_{w}.py fails since the last merge; find out why and fix it."
            for k, w in enumerate(("parse", "render", "merge", "split", "index", "cache", "route", "stream", "plan",
                                   "lint", "quote", "sort", "fetch", "store", "build", "probe"))]


def chat_turn(messages: list[dict], headers: dict | None = None, port: int = FRONTEND[1], max_tokens: int = 4,
              tools: list | None = None) -> dict:
    """One streamed chat completion (stream_options.include_usage): status, the serving instance
    (HAProxy's X-Moe-Server), TTFT (to the first chunk after the role chunk), prompt and cached
    tokens, the answer's text, body bytes."""
    body = json.dumps({"messages": messages, "tools": AGENT_TOOLS if tools is None else tools, "tool_choice": "none",
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.monotonic()
    rec: dict = {"t0": round(t0, 3), "status": None, "server": None, "ttft_s": None, "prompt_tokens": None,
                 "cached_tokens": None, "text": "", "done": False, "body_bytes": len(body), "finish_reason": None}
    try:
        conn = http.client.HTTPConnection(FRONTEND[0], port, timeout=600)
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        rec["status"], rec["server"] = resp.status, resp.getheader("X-Moe-Server")
        if resp.status != 200:
            rec["body"] = resp.read()[:500].decode(errors="replace")
        else:
            n = 0
            for chunk in sse_chunks(resp, rec):
                n += 1
                if n == 2:
                    rec["ttft_s"] = round(time.monotonic() - t0, 3)
                if chunk.get("usage"):
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    rec["cached_tokens"] = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
                for choice in chunk.get("choices", []):
                    rec["text"] += choice.get("delta", {}).get("content") or ""
                    if choice.get("finish_reason"):
                        rec["finish_reason"] = choice["finish_reason"]
        conn.close()
    except Exception as exc:
        rec["exception"] = f"{type(exc).__name__}: {exc}"
    rec["t1"] = round(time.monotonic(), 3)
    return rec


class Session:
    """One agent conversation: the shared system prompt, its own opening, then per turn the
    model's answer and a tool result. ``key``: an X-Session-Id it sends (None: the balancer
    hashes its first user message)."""

    def __init__(self, name: str, opening: str, key: str | None = None):
        self.name, self.opening, self.key = name, opening, key
        self.messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": opening}]
        self.turns: list[dict] = []

    @property
    def headers(self) -> dict:
        return {"X-Session-Id": self.key} if self.key else {}

    def turn(self, phase: str) -> dict:
        rec = chat_turn(self.messages, self.headers)
        rec.update(session=self.name, turn=len(self.turns), phase=phase, key="header" if self.key else "first_user_message")
        prev = self.turns[-1] if self.turns else None
        rec["prev_prompt_tokens"] = prev["prompt_tokens"] if prev else None
        rec["reused"] = bool(prev and prev["prompt_tokens"] and rec["cached_tokens"] is not None
                             and rec["cached_tokens"] >= prev["prompt_tokens"] - BLOCK_TOKENS)
        self.turns.append(rec)
        n = len(self.turns)
        self.messages += [{"role": "assistant", "content": rec["text"] or "Looking."},
                          {"role": "user", "content": f"Tool result {n}: exit 1, {n} failed."}]
        return rec

    def cold_twin(self) -> list[dict]:
        """This session's current messages with a nonce before the system prompt: the same
        length, nothing cached anywhere (the empty-cache reference)."""
        return [{"role": "system", "content": f"[{self.name} cold] " + AGENT_SYSTEM},
                *self.messages[1:]]


def run_sessions(sessions: list[Session], turns: int, phase: str) -> list[dict]:
    """Every session runs ``turns`` turns, all sessions at once, each pausing 0.2-2 s before a
    turn (its tool running; seeded by its name): without the pauses the sessions run in
    lockstep and leastconn keeps each on one instance by accident."""
    def one(s: Session) -> None:
        rng = random.Random(s.name)
        for _ in range(turns):
            time.sleep(rng.uniform(0.2, 2.0))
            s.turn(phase)

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    return [r for s in sessions for r in s.turns if r["phase"] == phase]


def session_summary(recs: list[dict]) -> dict:
    later = [r for r in recs if r["turn"] > 0 and r["prev_prompt_tokens"] is not None]
    by_server: dict[str, int] = {}
    for r in recs:
        by_server[str(r["server"])] = by_server.get(str(r["server"]), 0) + 1
    servers_per_session: dict[str, list] = {}
    for r in recs:
        servers_per_session.setdefault(r["session"], [])
        if r["server"] not in servers_per_session[r["session"]]:
            servers_per_session[r["session"]].append(r["server"])
    prev_server = {(r["session"], r["turn"]): r["server"] for r in recs}
    same = [r for r in later if prev_server.get((r["session"], r["turn"] - 1)) == r["server"]]
    return {
        "turns": len(recs),
        "later_turns": len(later),
        # The turn reached the instance that served the previous one (there its whole
        # conversation is cached, not only the system prompt every session shares).
        "same_instance_turns": len(same),
        "reused_later_turns": sum(r["reused"] for r in later),
        "reuse_rate": round(sum(r["reused"] for r in later) / len(later), 3) if later else None,
        "turns_per_server": by_server,
        "servers_per_session": servers_per_session,
        "bad": [r for r in recs if r["status"] != 200 or not r["done"] or r.get("exception") or r.get("error")],
        "body_bytes": [min(r["body_bytes"] for r in recs), max(r["body_bytes"] for r in recs)] if recs else None,
    }


AFFINE: list[Session] = []


def pick_sessions(n: int) -> tuple[list[Session], list[dict]]:
    """``n`` sessions, half on each instance: candidates alternate between an X-Session-Id and
    the first user message as their key; a one-token probe with the same key (through HAProxy,
    nothing else in flight) tells where the hash puts each, and they are taken in order until
    each instance has n/2. (With four sessions a hash puts all of them on one instance 1 time
    in 8, and the balance factor then moves turns away: that is what the factor is for, not
    what this check measures.)"""
    chosen: list[Session] = []
    probes = []
    per: dict[str, int] = {}
    for k, opening in enumerate(OPENINGS):
        s = Session(f"s{k}", opening, key=f"lab-session-{k}" if k % 2 == 0 else None)
        r = chat_turn([{"role": "user", "content": opening}], s.headers, max_tokens=1, tools=[])
        probes.append({"session": s.name, "server": r["server"], "status": r["status"]})
        if r["status"] != 200 or r["server"] is None:
            continue
        if per.get(r["server"], 0) < n // 2:
            per[r["server"]] = per.get(r["server"], 0) + 1
            chosen.append(s)
        if len(chosen) == n:
            break
    return chosen, probes


@step("sessions_affine")
def sessions_affine() -> dict:
    sessions, probes = pick_sessions(N_SESSIONS)
    AFFINE[:] = sessions
    t0 = time.monotonic()
    recs = run_sessions(sessions, SESSION_TURNS, "affine")
    return {"config": Path("/etc/haproxy/haproxy.cfg").read_text(), "probes": probes,
            "seconds": round(time.monotonic() - t0, 1), "records": recs, **session_summary(recs)}


@step("sessions_leastconn")
def sessions_leastconn() -> dict:
    run = playbook("ansible-leastconn.log", ["--tags", "moe_balancer", "-e", json.dumps({"moe_balancer_affinity": False})])
    sessions = [Session(f"l{k}", "Leastconn " + OPENINGS[-1 - k], key=f"lab-lc-{k}" if k % 2 == 0 else None)
                for k in range(N_SESSIONS)]
    t0 = time.monotonic()
    recs = run_sessions(sessions, SESSION_TURNS, "leastconn")
    seconds = round(time.monotonic() - t0, 1)
    config = Path("/etc/haproxy/haproxy.cfg").read_text()
    # Back to the inventory's balancer now, while nothing streams: the rolling step's playbook
    # then changes only the service (a HAProxy reload under load made one health check fail
    # there, which that step counts as the instance leaving twice).
    restore = playbook("ansible-affine.log", ["--tags", "moe_balancer"])
    return {"playbook": run, "restore": restore, "config": config, "seconds": seconds, "records": recs,
            **session_summary(recs)}


def prefix_files(instance: str) -> dict:
    """The prefix store of an instance (serve.prefix_cache_dir = prefix under its
    CacheDirectory=): block files, their modes and owners, the namespace folders."""
    root = Path(f"/var/cache/moe-service/{instance}/prefix")
    blocks = sorted(root.glob("*/*.blk"))
    return {"namespaces": sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else [],
            "blocks": len(blocks), "bytes": sum(p.stat().st_size for p in blocks),
            "modes": sorted({oct(p.stat().st_mode & 0o777) for p in [*blocks, *root.glob("*/identity.json")]}),
            "dir_modes": sorted({oct(p.stat().st_mode & 0o777) for p in [root, *root.glob("*")] if p.is_dir()})
            if root.exists() else [],
            "owners": sorted({pwd.getpwuid(p.stat().st_uid).pw_name for p in blocks})}


def unit_events(unit: str, events: tuple[str, ...]) -> list[dict]:
    """The unit's journal entries whose EVENT field is one of ``events`` (moe_service.log sends
    one field per key): {"event": ..., key: value} with lower-case keys, numbers as int."""
    out = sh(["journalctl", "-u", unit, "-o", "json", "--no-pager"], timeout_s=120)["stdout"]
    found = []
    for line in out.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("EVENT") not in events:
            continue
        rec = {"event": entry["EVENT"]}
        for k, v in entry.items():
            if k.startswith("_") or k in ("EVENT", "MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER") or not k.isupper():
                continue
            rec[k.lower()] = int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v
        found.append(rec)
    return found


@step("sessions_after_restart")
def sessions_after_restart() -> dict:
    if not AFFINE:
        raise RuntimeError("sessions_affine did not leave sessions to continue")
    before = {s.name: s.turns[-1]["server"] for s in AFFINE}
    # One at a time, first every session's next turn, then its empty-cache twin: TTFT alone,
    # not shared with another prefill on the same instance.
    results: dict[str, dict] = {}
    for s in AFFINE:
        results[s.name] = s.turn("after_restart")
    cold: dict[str, dict] = {}
    for s in AFFINE:
        server = results[s.name]["server"] or before[s.name]
        # The turn just sent, again, with a nonce before the system prompt, to the same instance.
        cold[s.name] = chat_turn(s.cold_twin()[:-2], s.headers, port=int(str(server).rsplit(":", 1)[1]))
    rows = []
    for s in AFFINE:
        w, c = results[s.name], cold[s.name]
        rows.append({"session": s.name, "key": w["key"], "server_before": before[s.name], "server": w["server"],
                     "prompt_tokens": w["prompt_tokens"], "prev_prompt_tokens": w["prev_prompt_tokens"],
                     "cached_tokens": w["cached_tokens"], "reused": w["reused"], "ttft_s": w["ttft_s"],
                     "cold_prompt_tokens": c["prompt_tokens"], "cold_cached_tokens": c["cached_tokens"],
                     "cold_ttft_s": c["ttft_s"],
                     "ttft_ratio": round(c["ttft_s"] / w["ttft_s"], 2) if c["ttft_s"] and w["ttft_s"] else None,
                     "ok": w["status"] == 200 and w["done"] and c["status"] == 200 and c["done"]})
    ratios = sorted(r["ttft_ratio"] for r in rows if r["ttft_ratio"])
    return {
        "rows": rows,
        "median_ttft_ratio": ratios[len(ratios) // 2] if ratios else None,
        "warm": list(results.values()),
        "cold": list(cold.values()),
        "files": {name: prefix_files(name) for name in INSTANCES},
        "service_user": unit_props(UNITS["a"]).get("User") or sh(["systemctl", "show", UNITS["a"], "-p", "User",
                                                                   "--value"])["stdout"].strip(),
        "store_events": {name: unit_events(unit, ("prefix_store_saved", "prefix_store_indexed", "prefix_store_skipped",
                                                   "prefix_store_save_failed", "prefix_store_off"))
                         for name, unit in UNITS.items()},
    }


def agent_once(k: int) -> dict:
    """One agent-sized chat request (the ~45 KB body of a session's turn: tools, system prompt,
    a short conversation) through HAProxy."""
    rec = chat_turn([{"role": "system", "content": AGENT_SYSTEM},
                     {"role": "user", "content": f"Agent client, request {k}: list the failing tests."}],
                    max_tokens=8)
    rec["kind"] = "agent"
    return rec


class Clients:
    """N threads streaming completions through HAProxy back to back until stopped."""

    def __init__(self, n: int, agent: bool = True):
        self.stop = threading.Event()
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i, self.completion), daemon=True) for i in range(n)]
        if agent:  # and one client of agent-sized bodies (HAProxy buffers and can retry them)
            self.threads.append(threading.Thread(target=self.run, args=(n, self.agent), daemon=True))

    @staticmethod
    def completion(i: int, k: int) -> dict:
        return stream_once(f"Client {i}, request {k}: once upon a time", 16 + 8 * (k % 3))

    @staticmethod
    def agent(i: int, k: int) -> dict:
        return agent_once(k)

    def run(self, i: int, request: Callable[[int, int], dict]) -> None:
        """Client ``i`` sends ``request(i, k)`` for k = 0, 1, ... until stopped, keeping each record."""
        k = 0
        while not self.stop.is_set():
            rec = request(i, k)
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


def failed(recs: list[dict]) -> list[dict]:
    """The clients' requests that did not end well: not 200, no [DONE], an exception or an
    error chunk, or no finish_reason."""
    return [r for r in recs if r["status"] != 200 or not r["done"] or r.get("exception") or r.get("error")
            or not r["finish_reason"]]


def agent_requests(recs: list[dict]) -> list[dict]:
    """The agent client's requests, in short."""
    return [{k: r.get(k) for k in ("t0", "t1", "status", "done", "body_bytes", "server")}
            for r in recs if r.get("kind") == "agent"]


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
        "bad": failed(recs)[:20],
        "records": recs[-400:],
        "agent_requests": agent_requests(recs),
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
        "bad": failed(recs)[:20],
        "stats_changes": sampler.changes,
        "agent_requests": agent_requests(recs),
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
        sessions_affine()
        sessions_leastconn()
        rolling()
        sessions_after_restart()
        unmanaged()
    report["finished"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
