"""Operator-side checks inside the numa-lab VM (systemd as PID 1); writes $LAB_OUT/report.json.

Runs as root inside `numa-lab --systemd --nodes 2`, started by tests/systemd/test_lab.py,
with the system Python and the standard library only. One boot does everything, in this
order (each step is recorded as it finishes, so a timeout still leaves the earlier steps):

  env            systemd version, NUMA nodes, the kernel's settings before Ansible
  ansible_1      ansible/site.yml applied to the VM itself (connection local)
  host_state     numa_balancing, THP enabled/defrag, per-node 2 MiB pools, boot files
  ansible_2      the same playbook again: must report changed=0
  boot_path      kernel defaults put back, systemd-sysctl and the tmpfiles boot pass rerun
                 (what a boot runs): the role's files alone restore every setting
  nvidia_skip    nvidia_prereqs took its skip path (no NVIDIA device in the VM)
  units_verify   systemd-analyze verify on both unit files
  units_security systemd-analyze security (exposure) on the loaded units
  syscall_probe  syscall_probe.py run under a copy of the unit: NUMA calls allowed, sandbox on
  moe_service_install  outside the full service phase (the default): ansible_1 and ansible_2
                 also ran the role's installation tasks (offline, from the wheelhouse);
                 the user, virtualenv, entry point and units they left
  lifecycle_start  in that phase, with LAB_MOE_LIFECYCLE_CONFIG (a load-only pipeline):
                 the installed unit started by hand, then the service_* steps without /health
  service_*      only when LAB_MOE_SERVICE_CONFIG is set too (the pipeline can serve): the
                 role starts it; active via READY=1, /health, journal fields, clean stop,
                 watchdog restart
  hugepages_shortfall  asking for more huge pages than a node has fails with a clear message

Environment (set by the test): LAB_OUT, LAB_REPO (repository root), LAB_ANSIBLE_PLAYBOOK,
LAB_MOE_WHEELHOUSE / LAB_MOE_SERVICE_CONFIG / LAB_MOE_HEALTH_URL (service phase),
LAB_MOE_SKIP_REASON (why there is no service phase), LAB_SHARED_SITE_PACKAGES,
LAB_STALL_AFTER_S, LAB_WATCHDOG_S, LAB_SERVICE_START_TIMEOUT_S.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import urllib.request
from pathlib import Path

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

UNIT = "moe-service.service"
NODE_SYSFS = Path("/sys/devices/system/node")
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage")
HUGEPAGES_2M_LAB = {0: 64, 1: 64}  # must match tests/systemd/lab/inventory.yml

PLAYBOOK_RUNS: list[str] = []
step = recorder("lab_checks")


def thp_selected(name: str) -> str:
    """The bracketed choice in /sys/kernel/mm/transparent_hugepage/<name>."""
    m = re.search(r"\[([^]]+)\]", read(THP_SYSFS / name))
    return m.group(1) if m else ""


def nodes() -> list[int]:
    return sorted(int(p.name[4:]) for p in NODE_SYSFS.glob("node[0-9]*"))


def hugepages_2m() -> dict[str, int]:
    return {
        str(n): int(read(NODE_SYSFS / f"node{n}/hugepages/hugepages-2048kB/nr_hugepages")) for n in nodes()
    }


def unit_show(unit: str, *props: str) -> dict[str, str]:
    out = sh(["systemctl", "show", unit, "-p", ",".join(props)], timeout_s=60)["stdout"]
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def service_phase() -> bool:
    """The whole moe_service role runs and the service is exercised."""
    return bool(os.environ.get("LAB_MOE_WHEELHOUSE") and os.environ.get("LAB_MOE_SERVICE_CONFIG"))


def install_phase() -> bool:
    """Only the role's installation tasks run (there is a wheel but the service cannot serve yet)."""
    return bool(os.environ.get("LAB_MOE_WHEELHOUSE")) and not service_phase()


# --- steps -----------------------------------------------------------------------------


@step("env")
def env_step() -> dict:
    return {
        "systemd": sh(["systemctl", "--version"])["stdout"].splitlines()[0],
        "pid1": read("/proc/1/comm"),
        "kernel": os.uname().release,
        "nodes": nodes(),
        "cpus": os.cpu_count(),
        "numa_balancing_before": read("/proc/sys/kernel/numa_balancing"),
        "thp_enabled_before": thp_selected("enabled"),
        "thp_defrag_before": thp_selected("defrag"),
        "hugepages_2m_before": hugepages_2m(),
        "service_phase": service_phase(),
        "service_skip_reason": os.environ.get("LAB_MOE_SKIP_REASON", ""),
    }


def run_playbook(extra: list[str] | None = None, timeout_s: float = 1800, playbook: str | None = None) -> dict:
    """ansible-playbook on the VM itself. Default playbook: ansible/site.yml in the service
    phase; with the moe_service tag skipped plus the role's installation tasks in the install
    phase (tests/systemd/lab/host-and-install.yml); site.yml's host roles alone otherwise."""
    if playbook is None:
        playbook = "tests/systemd/lab/host-and-install.yml" if install_phase() else "ansible/site.yml"
    argv = [PLAYBOOK_BIN, "-i", str(REPO / "tests/systemd/lab/inventory.yml"), str(REPO / playbook)]
    if not service_phase() and playbook != "tests/systemd/lab/install-only.yml":
        argv += ["--skip-tags", "moe_service"]
    argv += extra or []
    out = ansible_playbook(argv, f"ansible-{len(PLAYBOOK_RUNS) + 1}.log", timeout_s)
    PLAYBOOK_RUNS.append(playbook)
    return out


@step("ansible_1")
def ansible_1() -> dict:
    prep = prepare_service_venv() if (service_phase() or install_phase()) else None
    out = run_playbook()
    out["venv_prep"] = prep
    return out


@step("host_state")
def host_state() -> dict:
    return {
        "numa_balancing": read("/proc/sys/kernel/numa_balancing"),
        "thp_enabled": thp_selected("enabled"),
        "thp_defrag": thp_selected("defrag"),
        "hugepages_2m": hugepages_2m(),
        "hugepages_2m_wanted": {str(k): v for k, v in HUGEPAGES_2M_LAB.items()},
        "sysctl_file": read("/etc/sysctl.d/60-moe-numa-host.conf") if Path(
            "/etc/sysctl.d/60-moe-numa-host.conf").exists() else None,
        "thp_tmpfiles": read("/etc/tmpfiles.d/60-moe-thp.conf") if Path(
            "/etc/tmpfiles.d/60-moe-thp.conf").exists() else None,
        "hugepages_tmpfiles": read("/etc/tmpfiles.d/60-moe-hugepages.conf") if Path(
            "/etc/tmpfiles.d/60-moe-hugepages.conf").exists() else None,
        # What the boot path would do: systemd-sysctl and systemd-tmpfiles parse the files.
        "sysctl_parse": sh(["sysctl", "-n", "-p", "/etc/sysctl.d/60-moe-numa-host.conf"])["rc"],
        "tmpfiles_parse": sh(["systemd-tmpfiles", "--cat-config"])["rc"],
    }


@step("ansible_2")
def ansible_2() -> dict:
    return run_playbook()


@step("boot_path")
def boot_path() -> dict:
    """What a reboot would do, without one (the VM's overlay does not survive it): put the
    kernel defaults back, run the two boot services that read the role's files, read again."""
    Path("/proc/sys/kernel/numa_balancing").write_text("1")
    (THP_SYSFS / "enabled").write_text("always")
    (THP_SYSFS / "defrag").write_text("madvise")
    for n in nodes():
        (NODE_SYSFS / f"node{n}/hugepages/hugepages-2048kB/nr_hugepages").write_text("0")
    reset = {"numa_balancing": read("/proc/sys/kernel/numa_balancing"), "thp_enabled": thp_selected("enabled"),
             "hugepages_2m": hugepages_2m()}
    sysctl = sh(["systemctl", "restart", "systemd-sysctl.service"], timeout_s=300)
    # systemd-tmpfiles-setup.service refuses a manual restart: run its command line
    # (`systemd-tmpfiles --create --remove --boot --exclude-prefix=/dev`) without --remove.
    tmpfiles = sh(["systemd-tmpfiles", "--create", "--boot", "--exclude-prefix=/dev"], timeout_s=300)
    return {
        "reset_to": reset,
        "sysctl_rc": sysctl["rc"],
        "tmpfiles_rc": tmpfiles["rc"],
        "stderr": (sysctl["stderr"] + tmpfiles["stderr"])[-1500:],
        "numa_balancing": read("/proc/sys/kernel/numa_balancing"),
        "thp_enabled": thp_selected("enabled"),
        "thp_defrag": thp_selected("defrag"),
        "hugepages_2m": hugepages_2m(),
    }


@step("nvidia_skip")
def nvidia_skip() -> dict:
    log = (OUT / "ansible-1.log").read_text() if (OUT / "ansible-1.log").exists() else ""
    vendors = [read(p) for p in Path("/sys/bus/pci/devices").glob("*/vendor")]
    return {
        "nvidia_devices": [v for v in vendors if v.lower() == "0x10de"],
        "pci_vendors": sorted(set(vendors)),
        "skip_message": "No PCI device with vendor 0x10de" in log,
        "blacklist_written": Path("/etc/modprobe.d/blacklist-nouveau.conf").exists(),
        "modules_load_written": Path("/etc/modules-load.d/moe-nvidia.conf").exists(),
    }


@step("moe_service_install")
def moe_service_install() -> dict:
    """What the role's installation tasks (run by ansible_1 offline from the wheelhouse, and
    again by ansible_2, which must change nothing) left behind."""
    runs = [report["steps"][name] for name in ("ansible_1", "ansible_2")]
    venv = Path("/opt/moe-service/venv")
    site = next((venv / "lib").glob("python3*/site-packages"))
    helped = sh(["runuser", "-u", "moe-service", "--", str(venv / "bin/moe-service"), "--help"], timeout_s=600)
    return {
        "runs": [{k: r.get(k) for k in ("rc", "ok", "changed", "failed", "seconds", "changed_task_names")}
                 | {"stdout_tail": (r.get("stdout_tail") or "")[-2500:]} for r in runs],
        "user": sh(["id", "moe-service"])["stdout"].strip(),
        "entry_point": (venv / "bin/moe-service").exists(),
        "dist_info": sorted(p.name for p in site.glob("moe_service-*.dist-info")),
        "help_as_service_user": {"rc": helped["rc"], "stdout": helped["stdout"][-1500:],
                                 "stderr": helped["stderr"][-1500:]},
        "units_installed": {n: (Path("/etc/systemd/system") / n).exists()
                            and (Path("/etc/systemd/system") / n).read_text() == (REPO / "units" / n).read_text()
                            for n in ("moe-service.service", "moe-service@.service")},
        "wheelhouse": sorted(p.name for p in Path("/opt/moe-service/wheelhouse").glob("*")),
        "pip_in_venv": sh([str(venv / "bin/python"), "-m", "pip", "--version"])["stdout"].strip(),
    }


def install_units_if_missing() -> None:
    """Outside the service phase the role did not install the units: install them as it does."""
    for name in ("moe-service.service", "moe-service@.service"):
        dest = Path("/etc/systemd/system") / name
        if not dest.exists():
            shutil.copy(REPO / "units" / name, dest)
    if sh(["id", "moe-service"])["rc"] != 0:
        sh(["useradd", "--system", "--user-group", "--home-dir", "/var/lib/moe-service", "--no-create-home",
            "--shell", "/usr/sbin/nologin", "moe-service"], check=True)
    sh(["systemctl", "daemon-reload"], check=True)


@step("units_verify")
def units_verify() -> dict:
    install_units_if_missing()
    tmp = Path("/tmp/units-verify")
    tmp.mkdir(exist_ok=True)
    out: dict[str, object] = {}
    # The files as shipped, with ExecStart pointed at an existing binary unless the real
    # venv is installed (verify checks that the command exists).
    real = Path("/opt/moe-service/venv/bin/moe-service").exists()
    out["exec_start_real"] = real
    for src, name in (("moe-service.service", "moe-service.service"), ("moe-service@.service", "moe-service@lab.service")):
        text = (REPO / "units" / src).read_text()
        if not real:
            text = text.replace("/opt/moe-service/venv/bin/moe-service", "/bin/true")
        (tmp / name).write_text(text)
        res = sh(["systemd-analyze", "verify", str(tmp / name)], timeout_s=120)
        out[name] = {"rc": res["rc"], "output": (res["stdout"] + res["stderr"]).strip()}
    return out


@step("units_security")
def units_security() -> dict:
    out: dict[str, object] = {}
    for unit in ("moe-service.service", "moe-service@lab.service"):
        res = sh(["systemd-analyze", "security", "--no-pager", unit], timeout_s=120)
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\S+)", res["stdout"])
        out[unit] = {
            "rc": res["rc"],
            "exposure": float(m.group(1)) if m else None,
            "verdict": m.group(2) if m else None,
            "failed_checks": [ln.strip() for ln in res["stdout"].splitlines() if ln.lstrip().startswith("✗")],
        }
    return out


@step("syscall_probe")
def syscall_probe() -> dict:
    """Run syscall_probe.py as ExecStart of a copy of the real unit (Type=oneshot)."""
    install_units_if_missing()
    text = (REPO / "units/moe-service.service").read_text()
    drop = ("Type=", "NotifyAccess=", "ExecStart=", "WatchdogSec=", "Restart=", "RestartSec=",
            "RestartPreventExitStatus=", "TimeoutStartSec=", "WantedBy=")
    lines = [ln for ln in text.splitlines() if not ln.startswith(drop)]
    i = lines.index("[Service]") + 1
    probe = REPO / "tests/systemd/lab/syscall_probe.py"
    lines[i:i] = ["Type=oneshot", f"ExecStart=/usr/bin/python3 {probe}", "TimeoutStartSec=600s"]
    Path("/etc/systemd/system/moe-syscall-probe.service").write_text("\n".join(lines) + "\n")
    sh(["systemctl", "daemon-reload"], check=True)
    start = sh(["systemctl", "start", "moe-syscall-probe.service"], timeout_s=700)
    journal = sh(["journalctl", "-u", "moe-syscall-probe.service", "-o", "cat", "--no-pager"])["stdout"]
    probe_line = next((ln for ln in journal.splitlines() if ln.startswith("PROBE ")), None)
    show = unit_show("moe-syscall-probe.service", "Result", "ExecMainStatus", "SystemCallFilter")
    return {
        "start_rc": start["rc"],
        "start_stderr": start["stderr"][-2000:],
        "result": show.get("Result"),
        "exit_status": show.get("ExecMainStatus"),
        "probe": json.loads(probe_line[6:]) if probe_line else None,
        "journal_tail": journal[-3000:],
        "filter_has_mbind": " mbind" in " " + show.get("SystemCallFilter", ""),
        "filter_length": len(show.get("SystemCallFilter", "").split()),
    }


def journal_json(unit: str) -> list[dict]:
    out = sh(["journalctl", "-u", unit, "-o", "json", "--no-pager"], timeout_s=120)["stdout"]
    entries = []
    for line in out.splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return entries


def health_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@step("lifecycle_start")
def lifecycle_start() -> dict:
    """Start the unit the role installed with the load-only config (no HTTP yet)."""
    conf = Path("/etc/moe-service/moe-service.toml")
    conf.parent.mkdir(exist_ok=True)
    shutil.copy(os.environ["LAB_MOE_LIFECYCLE_CONFIG"], conf)
    shutil.chown(conf, "root", "moe-service")
    conf.chmod(0o640)
    dropin = Path(f"/run/systemd/system/{UNIT}.d")
    dropin.mkdir(parents=True, exist_ok=True)
    start_timeout = int(os.environ.get("LAB_SERVICE_START_TIMEOUT_S", "1800"))
    # Emulated CPUs: importing torch alone takes minutes before the first sd_notify message.
    (dropin / "80-lab-slow-cpu.conf").write_text(f"[Service]\nTimeoutStartSec={start_timeout}s\n")
    sh(["systemctl", "daemon-reload"], check=True)
    t0 = time.monotonic()
    res = sh(["systemctl", "start", UNIT], timeout_s=start_timeout + 60)
    return {"rc": res["rc"], "stderr": res["stderr"][-1500:], "start_seconds": round(time.monotonic() - t0, 1),
            "config": conf.read_text()}


@step("service_active")
def service_active() -> dict:
    show = unit_show(UNIT, "ActiveState", "SubState", "Type", "NRestarts", "MainPID", "StatusText", "Result",
                     "WatchdogUSec", "User", "LimitMEMLOCK")
    journal = sh(["journalctl", "-u", UNIT, "-o", "short-monotonic", "--no-pager"])["stdout"]
    return {
        "show": show,
        "health": health_status(os.environ.get("LAB_MOE_HEALTH_URL", "http://127.0.0.1:8000/health")),
        # systemd's own line, logged when READY=1 arrives (not the server's "Started server process").
        "started_line": next((ln for ln in journal.splitlines() if "systemd[1]: Started moe-service" in ln), None),
        "journal_tail": journal[-4000:],
    }


@step("service_journal")
def service_journal() -> dict:
    every = journal_json(UNIT)
    entries = [e for e in every if e.get("SYSLOG_IDENTIFIER") == "moe-service"]
    fields = sorted({k for e in entries for k in e if not k.startswith("_") and not k.startswith("__")})
    staged = [e for e in entries if "STAGE" in e]
    return {
        "all_entries": len(every),
        "identifiers": sorted({str(e.get("SYSLOG_IDENTIFIER")) for e in every}),
        "transports": sorted({str(e.get("_TRANSPORT")) for e in entries}),
        "entries": len(entries),
        "fields": fields,
        "stages": sorted({str(e["STAGE"]) for e in staged}),
        "priorities": sorted({str(e.get("PRIORITY")) for e in entries}),
        "sample": {k: v for k, v in (staged[0] if staged else entries[0] if entries else {}).items()
                   if not k.startswith("__")},
    }


@step("service_stop")
def service_stop() -> dict:
    t0 = time.monotonic()
    res = sh(["systemctl", "stop", UNIT], timeout_s=300)
    seconds = round(time.monotonic() - t0, 1)
    show = unit_show(UNIT, "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    journal = sh(["journalctl", "-u", UNIT, "-o", "cat", "--no-pager", "-n", "30"])["stdout"]
    return {"rc": res["rc"], "stop_seconds": seconds, "show": show, "journal_tail": journal[-3000:]}


@step("service_watchdog")
def service_watchdog() -> dict:
    stall_s = int(os.environ.get("LAB_STALL_AFTER_S", "20"))
    watchdog_s = int(os.environ.get("LAB_WATCHDOG_S", "30"))
    dropin = Path(f"/run/systemd/system/{UNIT}.d")
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / "90-lab-stall.conf").write_text(
        f"[Service]\nEnvironment=MOE_SERVICE_TEST_STALL_AFTER_S={stall_s}\nWatchdogSec={watchdog_s}s\n")
    sh(["systemctl", "daemon-reload"], check=True)
    sh(["systemctl", "reset-failed", UNIT])
    before = int(unit_show(UNIT, "NRestarts").get("NRestarts", "0") or 0)
    start_timeout = float(os.environ.get("LAB_SERVICE_START_TIMEOUT_S", "1800"))
    start = sh(["systemctl", "start", UNIT], timeout_s=start_timeout)
    t0 = time.monotonic()
    deadline = t0 + stall_s + watchdog_s + 15 + 240
    seen: list[dict] = []
    restarts = before
    while time.monotonic() < deadline:
        show = unit_show(UNIT, "ActiveState", "SubState", "NRestarts", "Result")
        restarts = int(show.get("NRestarts", "0") or 0)
        if not seen or seen[-1] != show:
            seen.append(dict(show, t_s=round(time.monotonic() - t0, 1)))
        if restarts > before:
            break
        time.sleep(2)
    journal = sh(["journalctl", "-u", UNIT, "-o", "cat", "--no-pager", "-n", "80"])["stdout"]
    sh(["systemctl", "stop", UNIT], timeout_s=300)
    (dropin / "90-lab-stall.conf").unlink()
    sh(["systemctl", "daemon-reload"])
    return {
        "start_rc": start["rc"],
        "start_stderr": start["stderr"][-1500:],
        "nrestarts_before": before,
        "nrestarts_after": restarts,
        "states": seen,
        "watchdog_lines": [ln for ln in journal.splitlines() if "atchdog" in ln],
        "journal_tail": journal[-3000:],
    }


@step("hugepages_shortfall")
def hugepages_shortfall() -> dict:
    """Ask node 1 for far more 2 MiB pages than it has: the role must fail and say so."""
    res = run_playbook(["--tags", "hugepages", "-e", json.dumps({
        "hugepages_2m_per_node": {"1": 100000},
        "hugepages_tmpfiles_file": "/tmp/lab-shortfall-hugepages.conf",
    })], timeout_s=900)
    granted = hugepages_2m()
    # Give the memory back for whatever runs after this.
    Path(NODE_SYSFS / "node1/hugepages/hugepages-2048kB/nr_hugepages").write_text(str(HUGEPAGES_2M_LAB[1]))
    text = res["stdout_tail"]
    msg = re.search(r"node1: the kernel granted (\d+) of\s+100000", text)
    return {"rc": res["rc"], "failed": res.get("failed"), "message_found": bool(msg),
            "granted": int(msg.group(1)) if msg else None, "node1_after": granted.get("1"),
            "stdout_tail": text[-2500:]}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    env_step()
    ansible_1()
    host_state()
    ansible_2()
    boot_path()
    nvidia_skip()
    if install_phase():
        install = moe_service_install()
        if os.environ.get("LAB_MOE_LIFECYCLE_CONFIG") and all(r.get("rc") == 0 for r in install.get("runs", [])):
            report["service_mode"] = "lifecycle"
            lifecycle_start()
            service_active()
            service_journal()
            service_stop()
            service_watchdog()
    units_verify()
    units_security()
    syscall_probe()
    if service_phase():
        report["service_mode"] = "full"
        if report["steps"]["ansible_1"].get("rc") == 0:
            service_active()
            service_journal()
            service_stop()
            service_watchdog()
        else:
            report["service_skipped"] = "ansible_1 failed: the service was not started"
    hugepages_shortfall()
    report["finished"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
