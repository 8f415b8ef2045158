"""A fleet behind HAProxy: rolling restarts through ansible/site.yml lose no request.

One boot of the systemd container lab (tests/lab/container.py: this machine's processes under
a real systemd as PID 1, private network, overlay root) runs tests/systemd/lab/fleet_checks.py:
site.yml with tests/systemd/lab/fleet-inventory.yml installs HAProxy's configuration (role
moe_balancer, port 8000) and two instances of moe-service@ on the demo model (8001, 8002);
the same playbook again changes nothing; four agent-like sessions (a shared system prompt and
~40 KB of tools, each conversation growing by an answer and a tool result per turn) run
through HAProxy's conversation affinity, then four more with leastconn for comparison; then
clients stream completions (and agent-sized chat requests) through HAProxy without pause while
the playbook rolls a configuration change over both instances (drain on HAProxy, restart,
/health 200, back in; each instance saves its prefix cache to disk as it stops and indexes it
at start); the affine sessions' next turn then measures the reuse after the restart against
the same turn with an empty cache; last, an operator restarts one instance by hand, without
the drain. The tests below read its report.json.

Why a container and not the QEMU VM: every service start imports torch and loads numba's
kernels, minutes per start under emulation, and the rollout starts the service four times;
here a warm start takes ~11 s. The unit files, systemd, HAProxy, the playbook and the service
are the real ones; only the kernel is shared with the host (nothing here is about NUMA).

Skips (with the reason) when the container lab cannot run here (not root, no
systemd-nspawn: `apt-get install -y systemd-container`) or HAProxy is not installed on the
host (`apt-get install -y haproxy`: the container has no network, and the role's package task
must find it installed). Environment knobs: FLEET_LAB_WORK_DIR (host folder for the model,
the wheelhouse and the reports), FLEET_LAB_TIMEOUT_S.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.lab.container import container_available, run_in_container
from tests.systemd import lab_harness

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# Not /tmp: the unit's PrivateTmp=yes would hide the model from the service.
LAB_WORK = Path(os.environ.get("FLEET_LAB_WORK_DIR", "/srv/moe-service-fleet-lab"))
SERVERS = ("lab:8001", "lab:8002")
ROLLING_TASKS = (
    "moe_service : Take the instance out of every balancer and wait for its requests to finish",
    "moe_service : Enable the instance and start it, or restart it when its configuration or code changed",
    "moe_service : Put the instance back into every balancer and wait until HAProxy sees it UP",
)


def unavailable_reason() -> str | None:
    if os.environ.get("NUMA_LAB") == "1":
        return "already inside a lab"
    ok, reason = container_available()
    if not ok:
        return reason
    if not shutil.which("haproxy"):
        return "HAProxy is not installed on this host (install: apt-get install -y haproxy; make lab-deps)"
    return None


def prepare(environ: dict[str, str]) -> dict[str, str]:
    """The demo model and the wheel under test, staged under LAB_WORK; the container's env."""
    (LAB_WORK / "models").mkdir(parents=True, exist_ok=True)
    LAB_WORK.chmod(0o755)
    (LAB_WORK / "models").chmod(0o755)
    model = LAB_WORK / "models/smollm2-135m-instruct-moe8.gguf"
    reason = lab_harness.build_demo_model(model, environ)
    if reason:
        pytest.fail(reason)
    wheelhouse = LAB_WORK / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    wheelhouse.mkdir()
    # Built from a copy: an in-tree build writes build/ and *.egg-info into the checkout, and
    # the VM lab (test_lab.py) builds its wheel from the checkout at the same moment.
    src = LAB_WORK / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheelhouse), str(src)], check=True, timeout=600, env=environ, capture_output=True)
    shutil.rmtree(src, ignore_errors=True)
    return {
        "LAB_REPO": str(lab_harness.checkout_for_units(LAB_WORK)),  # REPO, or a copy the units can see
        "LAB_ANSIBLE_PLAYBOOK": str(Path(sys.executable).parent / "ansible-playbook"),
        "LAB_SHARED_SITE_PACKAGES": sysconfig.get_paths()["purelib"],
        "LAB_MOE_WHEELHOUSE": str(wheelhouse),
        "LAB_DEMO_MODEL": str(model),
    }


def binds() -> list[Path]:
    """Folders the container must see that the overlay of / does not (other file systems)."""
    root_dev = Path("/").stat().st_dev
    wanted = {REPO, LAB_WORK, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    return sorted(p for p in wanted if p.exists() and p.stat().st_dev != root_dev)


def boot_fleet_lab(environ: dict[str, str]) -> dict:
    """Run fleet_checks.py in the container lab; its report (raises pytest's skip or fail)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    LAB_WORK.mkdir(parents=True, exist_ok=True)
    env = prepare(environ)
    out = LAB_WORK / f"out-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.monotonic()
    rc, output, _ = run_in_container("/usr/bin/python3 tests/systemd/lab/fleet_checks.py", out_dir=out, env=env,
                                     cwd=Path(env["LAB_REPO"]), binds=binds(), machine="moe-fleet-lab", base_env=environ,
                                     timeout_s=float(os.environ.get("FLEET_LAB_TIMEOUT_S", "2100")))
    return lab_harness.collect_report(out, rc, output, t0, "the fleet lab", "lab_rc")


_BACKGROUND = lab_harness.BackgroundLab("fleet-lab", boot_fleet_lab)


def start_in_background() -> Future:
    """Start :func:`boot_fleet_lab` in a daemon thread now (once per process); the fixture
    waits for it. tests/conftest.py calls this when collection selected this module."""
    return _BACKGROUND.start()


@pytest.fixture(scope="module")
def fleet() -> dict:
    report = start_in_background().result()
    print(f"fleet lab: {report['host_wall_s']} s wall; report: {report['out_dir']}/report.json")
    return report


def step(report: dict, name: str) -> dict:
    return lab_harness.report_step(report, name, "the fleet lab", "lab_rc")


def out_intervals(changes: list[dict], server: str) -> list[tuple[float, float | None]]:
    """(left, back) times of each period in which HAProxy did not count ``server`` as serving
    (a status other than UP, or an admin state such as drain). "UP 1/2" (UP, one health check
    failed: a slow /health on a loaded host) is still serving: HAProxy keeps sending it
    traffic until the check count runs out."""
    intervals: list[tuple[float, float | None]] = []
    start = None
    for c in changes:
        s = c["servers"].get(server)
        serving = s is not None and s["status"].startswith("UP") and s["admin_state"] == 0
        if not serving and start is None:
            start = c["t"]
        elif serving and start is not None:
            intervals.append((start, c["t"]))
            start = None
    if start is not None:
        intervals.append((start, None))
    return intervals


# --- provisioning -------------------------------------------------------------------------


def test_first_run_installs_the_fleet(fleet):
    env = step(fleet, "env")
    assert env["pid1"] == "systemd" and env["haproxy_installed_before"]
    run = step(fleet, "ansible_1")
    assert run["rc"] == 0 and run.get("failed") == 0, run["stdout_tail"][-3000:]
    # HAProxy came from the host: the role's package task found it installed.
    assert "moe_balancer : Install HAProxy from the distribution's package" not in run["changed_task_names"]
    assert "moe_balancer : Write the HAProxy configuration, checked by haproxy -c" in run["changed_task_names"]


def test_both_instances_serve_behind_haproxy(fleet):
    s = step(fleet, "serving")
    for name, props in s["units"].items():
        assert (props["ActiveState"], props["SubState"]) == ("active", "running"), (name, props)
    assert s["health"] == {"a": 200, "b": 200}
    assert s["health_via_haproxy"] == 200 and s["models_via_haproxy"] == 200
    assert {n: v["status"] for n, v in s["haproxy"].items()} == {srv: "UP" for srv in SERVERS}
    cfg = s["config"]
    for line in ("balance hdr(X-Moe-Affinity)", "hash-type consistent", "hash-balance-factor 175",
                 "tune.bufsize 131072", "option http-buffer-request", "http-response set-header X-Moe-Server %s",
                 "option httpchk GET /health", "http-check expect status 200",
                 "server lab:8001 127.0.0.1:8001", "server lab:8002 127.0.0.1:8002",
                 "stats socket /run/haproxy/admin.sock mode 660 level admin"):
        assert line in cfg, line


def test_second_run_changes_nothing(fleet):
    run = step(fleet, "ansible_2")
    assert run["rc"] == 0, run["stdout_tail"][-3000:]
    assert run.get("changed") == 0, f"not idempotent: {run['changed_task_names']}"


# --- agent sessions: affinity against leastconn ----------------------------------------------


def _table(recs: list[dict]) -> str:
    return "\n".join(f"  {r['session']} turn {r['turn']}: {r['server']} prompt {r['prompt_tokens']} cached "
                     f"{r['cached_tokens']} ttft {r['ttft_s']} s{' reused' if r['reused'] else ''}" for r in recs)


def test_affinity_keeps_each_session_on_the_instance_holding_its_prefix(fleet):
    """Target: >= 90% of the turns after the first reuse their prefix (cached_tokens >= the
    previous turn's prompt tokens minus one 64-token block), with bodies of agent size."""
    s = step(fleet, "sessions_affine")
    print(f"affine: {s['reused_later_turns']}/{s['later_turns']} later turns reused their prefix "
          f"({s['reuse_rate']}), {s['same_instance_turns']} on the previous turn's instance; turns per instance "
          f"{s['turns_per_server']}\n{_table(s['records'])}")
    assert s["bad"] == [], s["bad"]
    assert s["turns"] == 16 and s["later_turns"] == 12
    assert s["body_bytes"][0] > 40_000, s["body_bytes"]
    assert s["reuse_rate"] >= 0.9, _table(s["records"])
    assert s["same_instance_turns"] == s["later_turns"], _table(s["records"])
    # Every session stays on one instance, and the sessions use both (2 each: see pick_sessions);
    # the load stays within the balance factor (no instance over 1.75x the mean of 8 turns).
    assert all(len(v) == 1 for v in s["servers_per_session"].values()), s["servers_per_session"]
    assert sorted(s["turns_per_server"]) == sorted(SERVERS), s["turns_per_server"]
    assert max(s["turns_per_server"].values()) <= 1.75 * s["turns"] / len(SERVERS)
    # Both kinds of key were used: an X-Session-Id header and the first user message.
    assert {r["key"] for r in s["records"]} == {"header", "first_user_message"}


def test_leastconn_for_comparison(fleet):
    s = step(fleet, "sessions_leastconn")
    a = step(fleet, "sessions_affine")
    print(f"leastconn: {s['reused_later_turns']}/{s['later_turns']} later turns reused their prefix "
          f"({s['reuse_rate']}) against {a['reuse_rate']} with affinity; {s['same_instance_turns']} on the "
          f"previous turn's instance against {a['same_instance_turns']}; turns per instance "
          f"{s['turns_per_server']}\n{_table(s['records'])}")
    assert s["playbook"]["rc"] == 0, s["playbook"]["stdout_tail"][-3000:]
    assert s["restore"]["rc"] == 0, s["restore"]["stdout_tail"][-3000:]
    assert "balance leastconn" in s["config"] and "X-Moe-Affinity" not in s["config"]
    assert s["bad"] == [], s["bad"]
    assert s["turns"] == 16 and s["reuse_rate"] is not None


# --- the rolling restart ------------------------------------------------------------------


def test_rolling_restart_loses_no_request(fleet):
    s = step(fleet, "rolling")
    assert s["playbook"]["rc"] == 0, s["playbook"]["stdout_tail"][-3000:]
    assert s["bad"] == [], s["bad"]
    assert s["statuses"] == ["200"]
    # The clients really streamed across the rollout, not only before or after it.
    assert s["requests_during_playbook"] >= 4, (s["requests"], s["requests_during_playbook"])
    t0, t1 = s["window"]
    for server in SERVERS:
        (left, back), = out_intervals(s["stats_changes"], server)
        assert back is not None, f"{server} never came back"
        # the sampler saw it UP at `back`, and it was not yet UP at the sample before: the
        # playbook (which waits for UP) must have ended after that earlier sample
        back_after = next(c.get("after") or c["t"] for c in s["stats_changes"] if c["t"] == back)
        assert t0 <= left and back_after <= t1, (t0, left, back_after, back, t1)
        served_while_out = [r for r in s["records"] if left <= r["t0"] and r["t1"] <= back]
        assert served_while_out, f"no request completed while {server} was out"


def test_every_instance_restarted_once_after_a_drain(fleet):
    s = step(fleet, "rolling")
    for name in ("a", "b"):
        before, after = s["units_before"][name], s["units_after"][name]
        assert before["InvocationID"] != after["InvocationID"], name
        assert after["ActiveState"] == "active" and after["NRestarts"] == before["NRestarts"], (before, after)
    assert 'prompt = "The fleet lab, generation 2:"' in s["config_a"]
    # Per instance, in this order: drain, restart, back in; the drains and readies changed.
    log = (Path(fleet["out_dir"]) / s["playbook"]["log"]).read_text()
    names = [ln.split("[", 1)[1].rsplit("]", 1)[0] for ln in log.splitlines() if ln.startswith("TASK [")]
    for task in ROLLING_TASKS:
        assert task in s["playbook"]["changed_task_names"], (task, s["playbook"]["changed_task_names"])
    order = [n for n in names if n in ROLLING_TASKS]
    assert order == list(ROLLING_TASKS) * 2, order


def test_haproxy_saw_each_instance_out_and_back_one_at_a_time(fleet):
    s = step(fleet, "rolling")
    changes = s["stats_changes"]
    assert changes and not s["stats_errors"], s["stats_errors"]
    statuses = {srv: [c["servers"][srv]["status"] for c in changes if srv in c["servers"]] for srv in SERVERS}
    for srv in SERVERS:
        # taken out by the playbook: HAProxy's forced-drain admin bit (SRV_ADMF_FDRAIN, 0x08).
        # Its status reads "DRAIN", or "DRAIN 1/2" when the instance had nothing in flight and
        # restarted (its /health 503) before the sampler looked.
        assert any(c["servers"][srv]["admin_state"] & 0x08 for c in changes if srv in c["servers"]), \
            (srv, statuses[srv])
        assert any(st.startswith(("DOWN", "MAINT", "DRAIN")) for st in statuses[srv][1:]), (srv, statuses[srv])
        assert statuses[srv][-1] == "UP", (srv, statuses[srv])  # and back in
    (a_left, a_back), = out_intervals(changes, SERVERS[0])
    (b_left, b_back), = out_intervals(changes, SERVERS[1])
    assert a_back <= b_left, "both instances were out of HAProxy at the same time (below N-1 serving)"
    for c in changes:
        serving = [srv for srv, v in c["servers"].items() if v["status"].startswith("UP") and v["admin_state"] == 0]
        assert serving, f"no instance serving at {c}"
    assert any("lab:8001" in ln for ln in s["haproxy_log"]), s["haproxy_log"]


def test_agent_sized_requests_are_not_lost_in_restarts(fleet):
    """A client of 45 KB chat bodies ran through the rolling restart and the restart by hand:
    HAProxy buffered each whole (tune.bufsize 128 KiB), so its retries cover them too."""
    for name in ("rolling", "unmanaged"):
        s = step(fleet, name)
        agents = s["agent_requests"]
        t0, t1 = s["window"]
        assert any(r["t1"] >= t0 and r["t0"] <= t1 for r in agents), (name, agents)
        assert all(r["status"] == 200 and r["done"] for r in agents), (name, agents)
        assert min(r["body_bytes"] for r in agents) > 40_000


def test_first_turn_after_the_rolling_restart_reuses_its_prefix_from_disk(fleet):
    """Targets: after every instance restarted, each session's first turn reuses its prefix
    (saved to disk at the stop, indexed at start), with a TTFT >= 10x lower than the same turn
    with an empty cache (median over the sessions; each at least 5x)."""
    s = step(fleet, "sessions_after_restart")
    rows = s["rows"]
    print("after the rolling restart:\n" + "\n".join(
        f"  {r['session']} ({r['key']}): {r['server']} prompt {r['prompt_tokens']} cached {r['cached_tokens']} "
        f"ttft {r['ttft_s']} s; empty cache ttft {r['cold_ttft_s']} s (cached {r['cold_cached_tokens']}): "
        f"{r['ttft_ratio']}x" for r in rows) + f"\n  median {s['median_ttft_ratio']}x")
    assert len(rows) == 4 and all(r["ok"] for r in rows), rows
    for r in rows:
        assert r["server"] == r["server_before"], r  # consistent hashing: the same instance after its restart
        assert r["reused"], r
        assert r["cold_cached_tokens"] < 64 and abs(r["cold_prompt_tokens"] - r["prompt_tokens"]) <= 16, r
        assert r["ttft_ratio"] >= 5, r
    assert s["median_ttft_ratio"] >= 10, rows
    # The store: each instance saved at its stop and indexed at start; files 0600 of the service user.
    for events in s["store_events"].values():
        saved = [e for e in events if e.get("event") == "prefix_store_saved"]
        indexed = [e for e in events if e.get("event") == "prefix_store_indexed"]
        assert saved and saved[-1]["written"] + saved[-1]["already"] > 0 and saved[-1]["left_out"] == 0, events
        assert indexed and indexed[-1]["blocks"] > 0 and indexed[-1]["skipped"] == 0, events
        assert not [e for e in events if e.get("event") in ("prefix_store_save_failed", "prefix_store_off")], events
    for name, f in s["files"].items():
        assert f["blocks"] > 0 and len(f["namespaces"]) == 1, (name, f)
        assert f["modes"] == ["0o600"] and f["dir_modes"] == ["0o700"], (name, f)
        assert f["owners"] == [s["service_user"]], (name, f)


def test_restart_by_hand_loses_no_request_either(fleet):
    """Without the playbook's drain: the instance's own SIGTERM path (/health 503, listener
    closed, in-flight requests finished) with HAProxy's checks and retries (retry-on
    conn-failure empty-response, redispatch) still cut no stream and fail no request."""
    s = step(fleet, "unmanaged")
    assert s["restart_rc"] == 0, s["restart_stderr"]
    assert s["units_before"]["InvocationID"] != s["units_after"]["InvocationID"]
    assert s["requests_during_restart"] >= 2, s
    assert s["bad"] == [], s["bad"]
    statuses = [c["servers"][SERVERS[0]]["status"] for c in s["stats_changes"]]
    assert any(st.startswith("DOWN") for st in statuses) and statuses[-1] == "UP", statuses
