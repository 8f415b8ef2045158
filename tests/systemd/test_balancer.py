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
    for line in ("bind *:8000", "balance leastconn", "option httpchk GET /health", "http-check expect status 200",
                 "option redispatch 1", "retries 3", "retry-on conn-failure empty-response 503", "timeout server 900s", "timeout client 900s",
                 "stats socket /run/haproxy/admin.sock mode 660 level admin", "bind 127.0.0.1:8404",
                 "default-server check inter 2s downinter 5s fastinter 1s fall 2 rise 2"):
        assert line in cfg, line
    assert "Authorization" not in cfg and "hash-type" not in cfg
    haproxy_check(tmp_path, cfg)


@needs_ansible
def test_config_hashes_on_a_header_and_forwards_a_key(tmp_path):
    cfg = render(tmp_path, {"moe_balancer_hash_header": "X-Session-Id", "moe_balancer_backend_api_key": "s3cret",
                            "moe_balancer_server_maxconn": 6, "moe_balancer_slowstart_s": 30,
                            "moe_balancer_stats_http_bind": ""})
    assert "balance hdr(X-Session-Id)" in cfg and "hash-type consistent" in cfg
    assert "balance leastconn" not in cfg
    assert 'http-request set-header Authorization "Bearer s3cret"' in cfg
    assert 'http-check send hdr Authorization "Bearer s3cret"' in cfg
    assert "slowstart 30s maxconn 6" in cfg
    assert "listen stats" not in cfg
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
