"""The role moe_balancer on the build machine (the fleet lab runs it for real: test_fleet_lab.py).

- site.yml configures HAProxy before the service play, which goes in batches (`serial`);
- haproxy.cfg renders from an inventory: one server per instance of the backend group, named
  <host>:<port> (the name the moe_service role drains), instances of other backends left out,
  health checks on /health expecting 200, leastconn or consistent hashing on a header, the
  forwarded API key; `haproxy -c` accepts every variant (when HAProxy is installed);
- moe-balancer-ctl against a real HAProxy and two small HTTP servers: drain waits for the
  request in flight and no new request reaches the drained server, ready puts it back UP,
  unknown backends and servers are clear errors.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with ansible-core (pip install -e .[lint])")

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible/roles/moe_balancer"
CTL = ROLE / "files/moe-balancer-ctl"
PLAYBOOK_BIN = shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) or shutil.which(
    "ansible-playbook")
HAPROXY = shutil.which("haproxy")

needs_ansible = pytest.mark.skipif(PLAYBOOK_BIN is None, reason="ansible-core is not installed (pip install -e .[lint])")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (apt-get install -y haproxy)")

INVENTORY = {
    "moe_hosts": {"hosts": {
        "gpu-1.example": {"ansible_host": "10.0.0.11", "moe_service_instances": [
            {"name": "a", "config": {"serve": {"port": 8001}}},
            {"name": "b", "config": {"serve": {"port": 8002}}},
            {"name": "other-model", "balancer_backend": "", "config": {"serve": {"port": 8003}}},
        ]},
        "gpu-2.example": {"moe_balancer_backend_address": "fd00::12"},  # default instance, port 8000
    }},
    "moe_balancers": {"hosts": {"localhost": {"ansible_connection": "local"}}},
}

RENDER = """
- hosts: moe_balancers
  gather_facts: false
  vars_files:
    - {role}/defaults/main.yml
    - {role}/vars/main.yml
  tasks:
    - name: Render haproxy.cfg
      ansible.builtin.template:
        src: {role}/templates/haproxy.cfg.j2
        dest: "{out}"
        mode: "0644"
"""


def render(tmp_path: Path, extra: dict | None = None) -> str:
    inv = tmp_path / "inventory.yml"
    inv.write_text(yaml.safe_dump(INVENTORY))
    out = tmp_path / "haproxy.cfg"
    book = tmp_path / "render.yml"
    book.write_text(RENDER.format(role=ROLE, out=out))
    varsfile = tmp_path / "vars.json"
    varsfile.write_text(json.dumps(dict(extra or {}, ansible_python_interpreter=sys.executable)))
    res = subprocess.run([PLAYBOOK_BIN, "-i", str(inv), str(book), "-e", f"@{varsfile}"], capture_output=True,
                         text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1",
                                                      "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
                                                      "ANSIBLE_COLLECTIONS_PATH": "/nonexistent",
                                                      "HOME": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    return out.read_text()


def haproxy_check(tmp_path: Path, text: str) -> None:
    if HAPROXY is None:
        return
    cfg = tmp_path / "check.cfg"
    cfg.write_text(text)
    res = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_ansible
def test_config_has_one_server_per_instance_of_the_backend(tmp_path):
    cfg = render(tmp_path)
    servers = [ln.split() for ln in cfg.splitlines() if ln.strip().startswith("server ")]
    assert servers == [
        ["server", "gpu-1.example:8001", "10.0.0.11:8001"],
        ["server", "gpu-1.example:8002", "10.0.0.11:8002"],
        ["server", "gpu-2.example:8000", "[fd00::12]:8000"],
    ]
    for line in ("bind *:8000", "option httpchk GET /health", "http-check expect status 200",
                 "option redispatch 1", "retries 3", "retry-on conn-failure empty-response 503", "timeout server 900s", "timeout client 900s",
                 "stats socket /run/haproxy/admin.sock mode 660 level admin", "bind 127.0.0.1:8404",
                 "default-server check inter 2s downinter 5s fastinter 1s fall 2 rise 2"):
        assert line in cfg, line
    assert "Authorization" not in cfg and "http-response" not in cfg
    haproxy_check(tmp_path, cfg)


@needs_ansible
def test_config_is_conversation_affine_by_default(tmp_path):
    """Consistent hashing of the session key, bounded load, a buffer that holds agent bodies."""
    cfg = render(tmp_path)
    for line in ("tune.bufsize 131072", "option http-buffer-request", "http-request del-header X-Moe-Affinity",
                 "http-request set-var(txn.moe_affinity) req.hdr(X-Claude-Code-Session-Id) if !{ var(txn.moe_affinity) -m len gt 0 }",
                 "http-request set-var(txn.moe_affinity) req.body,json_query('$.prompt_cache_key') if",
                 "http-request set-var(txn.moe_affinity) req.body,json_query('$.metadata.user_id') if",
                 "acl moe_messages_sys req.body,json_query('$.messages[0].role') -m str system developer",
                 "http-request set-var(txn.moe_affinity) req.body,json_query('$.user') if",
                 "http-request set-header X-Moe-Affinity %[var(txn.moe_affinity),xxh64] if { var(txn.moe_affinity) -m len gt 0 }",
                 "balance hdr(X-Moe-Affinity)", "hash-type consistent", "hash-balance-factor 175"):
        assert line in cfg, line
    assert "balance leastconn" not in cfg
    # The order is the precedence: headers, body fields, the first user message, the fallback.
    order = [cfg.index(k) for k in ("req.hdr(X-Claude-Code-Session-Id)", "req.hdr(X-Session-Id)",
                                    "'$.prompt_cache_key'", "'$.messages[1].content'", "'$.input[0].content'",
                                    "'$.user'", "set-header X-Moe-Affinity")]
    assert order == sorted(order)
    haproxy_check(tmp_path, cfg)


@needs_ansible
def test_config_without_affinity_balances_leastconn_and_forwards_a_key(tmp_path):
    cfg = render(tmp_path, {"moe_balancer_affinity": False, "moe_balancer_backend_api_key": "s3cret",
                            "moe_balancer_server_maxconn": 6, "moe_balancer_slowstart_s": 30,
                            "moe_balancer_stats_http_bind": ""})
    assert "balance leastconn" in cfg
    assert "hash-type" not in cfg and "json_query" not in cfg and "http-buffer-request" not in cfg
    assert 'http-request set-header Authorization "Bearer s3cret"' in cfg
    assert 'http-check send hdr Authorization "Bearer s3cret"' in cfg
    assert "slowstart 30s maxconn 6" in cfg
    assert "listen stats" not in cfg
    haproxy_check(tmp_path, cfg)


@needs_ansible
def test_config_with_other_keys_and_no_balance_bound(tmp_path):
    cfg = render(tmp_path, {"moe_balancer_affinity_headers": ["X-Conversation"],
                            "moe_balancer_affinity_body_fields": ["$.conversation.id"],
                            "moe_balancer_affinity_first_user_message": False,
                            "moe_balancer_affinity_fallback_body_fields": [],
                            "moe_balancer_hash_balance_factor": 0, "moe_balancer_bufsize_bytes": 262144,
                            "moe_balancer_server_header": "X-Moe-Server"})
    assert "req.hdr(X-Conversation)" in cfg and "json_query('$.conversation.id')" in cfg
    assert "X-Claude-Code-Session-Id" not in cfg and "messages" not in cfg and "'$.user'" not in cfg
    assert "hash-balance-factor" not in cfg and "tune.bufsize 262144" in cfg
    assert "http-response set-header X-Moe-Server %s" in cfg
    haproxy_check(tmp_path, cfg)


def test_site_yml_rolls_the_service_in_batches_after_the_balancer():
    """site.yml: HAProxy is configured before any instance restarts, and the service play goes
    a batch of hosts at a time (default 1) and stops at the first failure."""
    plays = yaml.safe_load((REPO / "ansible/site.yml").read_text())
    by_role = {p["roles"][0]["role"]: i for i, p in enumerate(plays)}
    assert plays[by_role["moe_balancer"]]["hosts"] == "moe_balancers"
    assert by_role["moe_balancer"] < by_role["moe_service"]
    service = plays[by_role["moe_service"]]
    assert service["serial"] == "{{ moe_service_serial | default(1) }}"
    assert service["max_fail_percentage"] == 0
    # Only the service play restarts anything; the host roles never batch.
    assert "serial" not in plays[by_role["numa_host"]]


# --- moe-balancer-ctl against a real HAProxy ----------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    hits: dict[int, int] = {}

    def do_GET(self):
        port = self.server.server_address[1]
        if self.path.startswith("/slow"):
            type(self).hits[port] = type(self).hits.get(port, 0) + 1
            time.sleep(float(self.path.split("=", 1)[1]))
        elif self.path.startswith("/work"):
            type(self).hits[port] = type(self).hits.get(port, 0) + 1
        body = f"port {port}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # a health check that did not wait for the body

    def log_message(self, *args):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> None:
    """GET in a background thread; a request cut when the test's HAProxy stops is not an error."""
    try:
        urllib.request.urlopen(url, timeout=30).read()
    except OSError:
        pass


def ctl(sock: Path, *args: str) -> tuple[int, dict | None, str]:
    res = subprocess.run([sys.executable, str(CTL), "--socket", str(sock), *args], capture_output=True, text=True,
                         timeout=120)
    return res.returncode, json.loads(res.stdout) if res.stdout.strip() else None, res.stderr


@pytest.fixture
def haproxy(tmp_path):
    if HAPROXY is None:
        pytest.skip("HAProxy is not installed (apt-get install -y haproxy)")
    backends = []
    for _ in range(2):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        backends.append(srv)
    front = free_port()
    sock = tmp_path / "admin.sock"
    names = [f"lab:{b.server_address[1]}" for b in backends]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""global
    stats socket {sock} mode 600 level admin
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout check 5s
frontend f
    bind 127.0.0.1:{front}
    default_backend moe
backend moe
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
    default-server check inter 200ms fall 2 rise 2
""" + "".join(f"    server {n} 127.0.0.1:{b.server_address[1]}\n" for n, b in zip(names, backends, strict=True)))
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sock.exists():
                rc, status, _ = ctl(sock, "status", "moe")
                if rc == 0 and all(v["status"] == "UP" for v in status.values()):
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"HAProxy did not come up: {proc.stderr.read1().decode() if proc.poll() is not None else ''}")
        yield {"sock": sock, "front": front, "names": names, "ports": [b.server_address[1] for b in backends]}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for b in backends:
            b.shutdown()
            b.server_close()


def test_ctl_drain_waits_for_in_flight_requests_then_ready_puts_it_back(haproxy):
    sock, names, ports = haproxy["sock"], haproxy["names"], haproxy["ports"]
    front = f"http://127.0.0.1:{haproxy['front']}"
    # One slow request in flight; leastconn sends it to a server, which we then drain.
    slow = threading.Thread(target=get, args=(front + "/slow?s=2",), daemon=True)
    slow.start()
    deadline = time.monotonic() + 10
    busy = None
    while busy is None and time.monotonic() < deadline:
        _, status, _ = ctl(sock, "status", "moe")
        busy = next((n for n, v in status.items() if v["sessions"] > 0), None)
        time.sleep(0.05)
    assert busy is not None, status
    idle = next(n for n in names if n != busy)
    rc, drained, err = ctl(sock, "drain", "moe", busy, "--timeout-s", "30")
    assert rc == 0, err
    assert drained["changed"] and drained["status"] == "DRAIN" and drained["admin_state"] & 0x08
    assert drained["sessions"] == 0 and not drained["timed_out"]
    assert drained["waited_s"] >= 0.5  # it waited for the slow request
    slow.join(timeout=10)
    # While drained, every new request goes to the other server.
    busy_port = ports[names.index(busy)]
    before = _Handler.hits.get(busy_port, 0)
    for _ in range(6):
        assert urllib.request.urlopen(front + "/work", timeout=10).read() == f"port {ports[names.index(idle)]}".encode()
    assert _Handler.hits.get(busy_port, 0) == before
    # Draining again changes nothing; ready puts it back and waits until UP.
    assert ctl(sock, "drain", "moe", busy, "--timeout-s", "5")[1]["changed"] is False
    rc, readied, err = ctl(sock, "ready", "moe", busy, "--timeout-s", "30")
    assert rc == 0 and readied["changed"] and readied["status"] == "UP" and readied["admin_state"] == 0, err
    assert ctl(sock, "ready", "moe", busy)[1]["changed"] is False


def test_ctl_drain_gives_up_after_its_timeout(haproxy):
    sock, front = haproxy["sock"], f"http://127.0.0.1:{haproxy['front']}"
    for _ in range(2):  # one slow request on each server
        threading.Thread(target=get, args=(front + "/slow?s=4",), daemon=True).start()
        time.sleep(0.3)
    target = haproxy["names"][0]
    rc, drained, err = ctl(sock, "drain", "moe", target, "--timeout-s", "0.5")
    assert rc == 0 and drained["timed_out"] and drained["sessions"] == 1
    assert "still carries 1 request(s)" in err
    assert ctl(sock, "ready", "moe", target)[0] == 0


def test_ctl_errors_name_the_backend_or_server(haproxy, tmp_path):
    sock = haproxy["sock"]
    rc, _, err = ctl(sock, "drain", "moe", "lab:1")
    assert rc == 1 and "has no server 'lab:1'" in err and haproxy["names"][0] in err
    rc, _, err = ctl(sock, "status", "nope")
    assert rc == 1 and "no backend 'nope'" in err
    rc, _, err = ctl(tmp_path / "missing.sock", "status", "moe")
    assert rc == 1 and "missing.sock" in err


# --- conversation affinity through a real HAProxy with the role's configuration -----------


class _EchoHandler(http.server.BaseHTTPRequestHandler):
    """Answers a POST with its port, the X-Moe-Affinity header HAProxy set and the body's length;
    /slow?s=S sleeps first."""

    protocol_version = "HTTP/1.1"

    def _answer(self, body_len: int) -> None:
        if self.path.startswith("/slow"):
            time.sleep(float(self.path.split("=", 1)[1]))
        body = json.dumps({"port": self.server.server_address[1], "key": self.headers.get("X-Moe-Affinity"),
                           "body_bytes": body_len}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self._answer(len(self.rfile.read(int(self.headers.get("Content-Length", "0")))))

    def do_GET(self):
        self._answer(0)

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # HAProxy's health checks close their connections without a request


SYSTEM_PROMPT = ("You are a coding agent. Follow the repository's conventions, run the tests, explain each "
                 "change briefly. ") * 250  # ~24 KB, the same for every session
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does one thing well. " * 40,
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
         for i in range(20)]  # ~18 KB


def agent_body(task: str, turns: int, style: str = "openai") -> dict:
    """An agent's request after ``turns`` turns: the shared system prompt and tools, the task, then
    one tool call result and one answer per earlier turn (the body grows every turn)."""
    history: list[dict] = [{"role": "user", "content": task}]
    for t in range(turns):
        history += [{"role": "assistant", "content": f"Turn {t}: reading the file."},
                    {"role": "user", "content": f"Tool result {t}: " + "line of output\n" * 200}]
    if style == "anthropic":
        return {"model": "m", "system": SYSTEM_PROMPT, "tools": TOOLS,
                "messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in history]}
    return {"model": "m", "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *history], "tools": TOOLS}


@pytest.fixture(scope="module")
def affine_haproxy(tmp_path_factory):
    """HAProxy running the role's rendered configuration (affinity on, the defaults) in front of
    two echo servers; the global section's chroot/user/daemon lines dropped (a test process)."""
    if HAPROXY is None:
        pytest.skip("HAProxy is not installed (apt-get install -y haproxy)")
    if PLAYBOOK_BIN is None:
        pytest.skip("ansible-core is not installed (pip install -e .[lint])")
    tmp_path = tmp_path_factory.mktemp("affine")
    backends = []
    for _ in range(2):
        srv = _QuietServer(("127.0.0.1", 0), _EchoHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        backends.append(srv)
    front = free_port()
    sock = tmp_path / "admin.sock"
    cfg_text = render(tmp_path, {
        "moe_balancer_frontend_bind_address": "127.0.0.1", "moe_balancer_frontend_port": front,
        "moe_balancer_stats_socket": str(sock), "moe_balancer_stats_http_bind": "",
        "moe_balancer_backend_servers": [{"name": f"lab:{b.server_address[1]}", "address": "127.0.0.1",
                                          "port": b.server_address[1]} for b in backends]})
    cfg = tmp_path / "live.cfg"
    cfg.write_text("\n".join(ln for ln in cfg_text.splitlines()
                             if ln.split()[:1] not in (["chroot"], ["user"], ["group"], ["daemon"], ["log"])) + "\n")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sock.exists():
                rc, status, _ = ctl(sock, "status", "moe")
                if rc == 0 and all(v["status"] == "UP" for v in status.values()):
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"HAProxy did not come up: {proc.stderr.read1().decode() if proc.poll() is not None else ''}")
        yield f"http://127.0.0.1:{front}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for b in backends:
            b.shutdown()
            b.server_close()


def post(url: str, body: dict | bytes, headers: dict | None = None) -> dict:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    out = json.loads(urllib.request.urlopen(req, timeout=30).read())
    out["sent_bytes"] = len(data)
    return out


def test_agent_sessions_stay_on_one_instance_and_spread_by_first_user_message(affine_haproxy):
    """Eight sessions of one agent (same 42 KB system prompt and tools, their own task), five
    growing turns each (42 -> 56 KB): every turn of a session reaches the same instance with the
    same key, the sessions spread over both instances, and every body arrives whole."""
    url = affine_haproxy + "/v1/chat/completions"
    by_session = {}
    for s in range(8):
        seen = []
        for turn in range(5):
            r = post(url, agent_body(f"Session {s}: fix the failing test number {s * 7}.", turn))
            assert r["body_bytes"] == r["sent_bytes"] and r["key"]
            seen.append((r["port"], r["key"]))
        assert len(set(seen)) == 1, (s, seen)
        by_session[s] = seen[0]
        assert 40_000 < r["sent_bytes"] < 131072
    assert len({port for port, _ in by_session.values()}) == 2, by_session
    assert len({key for _, key in by_session.values()}) == 8


def test_session_keys_take_precedence_in_order(affine_haproxy):
    url = affine_haproxy + "/v1/chat/completions"
    a, b = agent_body("task A", 0), agent_body("task B", 2)
    # A session header wins over the body: two different conversations, one key.
    h = {"X-Claude-Code-Session-Id": "0b6f2a9e-session"}
    assert post(url, a, h)["key"] == post(url, b, h)["key"]
    # An empty header is no key: the next source (here the first user message) decides.
    assert post(url, a, {"X-Session-Id": ""})["key"] == post(url, a)["key"]
    # A body field: Codex's prompt_cache_key.
    r1 = post(url, dict(a, prompt_cache_key="conv-1"))
    assert r1["key"] == post(url, dict(b, prompt_cache_key="conv-1"))["key"] != post(url, a)["key"]
    # A client's own X-Moe-Affinity does not pick the instance: it is replaced.
    assert post(url, a, {"X-Moe-Affinity": "1"})["key"] == post(url, a)["key"]
    # Anthropic's shape (system at the top, content blocks): the first user text.
    k = {post(url, agent_body("task C", t, style="anthropic"))["key"] for t in range(3)}
    assert len(k) == 1 and k != {post(url, agent_body("task D", 0, style="anthropic"))["key"]}
    # A chat without a system message: messages[0] is the first user message.
    plain = [{"role": "user", "content": "hello there"}]
    assert post(url, {"messages": plain})["key"] == post(
        url, {"messages": plain + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]})["key"]
    # Nothing to hash: no key, round-robin.
    assert post(url, {"prompt": "once upon a time"})["key"] is None


def test_key_found_in_a_body_longer_than_the_buffer(affine_haproxy):
    """A 200 KB conversation: HAProxy buffers its first 128 KiB, the first user message is in
    them, and the whole body still reaches the instance."""
    url = affine_haproxy + "/v1/chat/completions"
    long = agent_body("a long session", 60)
    r = post(url, long)
    assert r["sent_bytes"] > 200_000 and r["body_bytes"] == r["sent_bytes"]
    assert r["key"] == post(url, agent_body("a long session", 0))["key"]


def test_balance_factor_bounds_one_hot_session(affine_haproxy):
    """Eight slow requests of one session at once: hash-balance-factor 175 lets its instance
    take at most 1.75x the average load in flight (3 or 7 of 8 with two servers: HAProxy
    rounds the slots per server down for the first, up for the second), the rest go to the
    other instance."""
    url = affine_haproxy + "/slow?s=1.5"
    body = agent_body("one hot session", 0)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: post(url, body), range(8)))
    ports = [r["port"] for r in results]
    assert len(set(ports)) == 2 and max(ports.count(p) for p in set(ports)) <= 7, ports
    assert len({r["key"] for r in results}) == 1
