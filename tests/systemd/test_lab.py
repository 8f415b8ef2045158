"""The operators' side in a real systemd: Ansible roles, units, sandbox, service lifecycle.

One lab VM boot (tests/lab/vm.py; systemd as PID 1, 2 NUMA nodes) runs tests/systemd/lab/lab_checks.py,
which applies ansible/site.yml to the VM itself twice, checks the units and their sandbox,
and, once `moe-service serve` exists, starts the service through the role and checks its
lifecycle. It writes report.json; the tests below only read that report.

Skips (with the reason) when the lab cannot run here (tests/lab/vm.py lab_available(): the
reason names the missing Debian packages). The service checks skip while the package has no
`serve` command or no lab config; while the pipeline has no serve stage, the unit's lifecycle
(READY=1, journal fields, stop, watchdog) runs with a load-only pipeline instead (no HTTP).
Under emulation one boot takes 15-40 minutes on a busy 2-core machine: marked `lab` and `slow`.

Environment knobs: LAB_WORK_DIR (host folder the VM
and the sandboxed service can see: not /tmp or /var/tmp), LAB_TIMEOUT_S, MOE_LAB_SERVICE_CONFIG
(TOML for the service phase; default tests/systemd/lab/service.toml with the demo model),
MOE_LAB_HEALTH_URL, LAB_STALL_AFTER_S, LAB_WATCHDOG_S, LAB_SERVICE_START_TIMEOUT_S,
MOE_LAB_FULL_SERVICE=1 (the role starts the real serving pipeline: warmup JIT-compiles every
kernel under emulation, so this adds tens of minutes; by default the lifecycle runs with a
load-only pipeline).
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

from tests.lab.vm import lab_available, run_in_vm
from tests.systemd import lab_harness

pytestmark = [pytest.mark.lab, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# Not /tmp (the VM does not share it) and not /var/tmp: the unit's PrivateTmp=yes hides both
# from the service, so a model there is "not found" (the lab caught that once).
LAB_WORK = Path(os.environ.get("LAB_WORK_DIR", "/srv/moe-service-systemd-lab"))
EXPOSURE_MAX = 4.5
HUGEPAGES_2M_LAB = {"0": 64, "1": 64}  # tests/systemd/lab/inventory.yml


def lab_unavailable_reason() -> str | None:
    if os.environ.get("NUMA_LAB") == "1":
        return "already inside the lab VM"
    ok, reason = lab_available()
    return None if ok else reason


# The environment boot_lab works from (None: os.environ), set before it starts.
_ENVIRON: dict[str, str] | None = None


def this_checkout(code: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run Python code against this checkout's packages (lab_harness.this_checkout)."""
    return lab_harness.this_checkout(code, _ENVIRON, timeout_s)


def cli_unavailable_reason() -> str | None:
    """Why the package cannot be installed as the service yet, or None."""
    if not (REPO / "moe_service/cli.py").is_file():
        return "`moe-service serve` does not exist yet: no moe_service/cli.py in this checkout"
    res = this_checkout("import moe_service.cli as c; sys.exit(c.main(['serve', '--help']))")
    if res.returncode != 0:
        return "`moe-service serve --help` fails: " + (res.stderr.strip().splitlines() or ["?"])[-1]
    return None


def demo_model() -> tuple[Path | None, str | None]:
    """(the embedded demo model built under LAB_WORK, None) or (None, why it cannot be built)."""
    model = LAB_WORK / "models/smollm2-135m-instruct-moe8.gguf"
    reason = lab_harness.build_demo_model(model, _ENVIRON)
    return (None, reason) if reason else (model, None)


def staged_config(template: str, name: str) -> tuple[Path | None, str | None]:
    """tests/systemd/lab/<template> with @DEMO_MODEL@ filled in, staged where the VM sees it,
    and checked by this checkout's `moe-service config validate`."""
    model, reason = demo_model()
    if model is None:
        return None, reason
    staged = LAB_WORK / name  # the VM does not see /tmp: stage it where it can
    staged.write_text((REPO / "tests/systemd/lab" / template).read_text().replace("@DEMO_MODEL@", str(model)))
    staged.chmod(0o644)
    res = this_checkout(f"import moe_service.cli as c; sys.exit(c.main(['config', 'validate', {str(staged)!r}]))")
    if res.returncode != 0:
        problems = "; ".join(ln.strip() for ln in res.stderr.strip().splitlines()[:2])
        return None, f"`moe-service config validate` rejects {template}: {problems}"
    return staged, None


def lab_service_config() -> tuple[Path | None, str | None]:
    """(the TOML the lab service runs with, None) or (None, why the service cannot serve yet).

    MOE_LAB_SERVICE_CONFIG is used as it is; otherwise tests/systemd/lab/service.toml with the
    embedded demo model built here. It must pass this checkout's `moe-service config
    validate` (every declared stage exists) and declare a serve stage.
    """
    if os.environ.get("MOE_LAB_SERVICE_CONFIG"):
        staged = LAB_WORK / "service.toml"
        shutil.copy(os.environ["MOE_LAB_SERVICE_CONFIG"], staged)
        staged.chmod(0o644)
    else:
        staged, reason = staged_config("service.toml", "service.toml")
        if staged is None:
            return None, f"the pipeline cannot serve yet: {reason}"
    res = this_checkout("from moe_service.config import load_config; "
                        f"print('serve' in load_config({str(staged)!r}).pipeline.stages)")
    if res.returncode != 0 or res.stdout.strip() != "True":
        return None, "the pipeline cannot serve yet: the lab config declares no serve stage"
    return staged, None


def build_wheelhouse(dest: Path, environ: dict[str, str]) -> None:
    """The package under test as a wheel (dependencies come from the shared venv in the VM)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest),
                    str(REPO)], check=True, timeout=600, env=environ)


def boot_lab(environ: dict[str, str]) -> dict:
    """Boot the lab and run lab_checks.py; the report (raises pytest's skip or fail outcome).

    ``environ``: the environment to work from, a snapshot taken before any test ran (this runs
    in a background thread while other tests monkeypatch os.environ)."""
    global _ENVIRON
    _ENVIRON = environ
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    LAB_WORK.mkdir(parents=True, exist_ok=True)
    out = LAB_WORK / f"out-{time.strftime('%Y%m%d-%H%M%S')}"
    lab_repo = lab_harness.checkout_for_units(LAB_WORK)  # REPO, or a copy the units can see
    env = dict(
        environ,
        LAB_REPO=str(lab_repo),
        LAB_ANSIBLE_PLAYBOOK=str(Path(sys.executable).parent / "ansible-playbook"),
        LAB_SHARED_SITE_PACKAGES=sysconfig.get_paths()["purelib"],
    )
    service_reason = cli_unavailable_reason()
    if service_reason is None:
        wheelhouse = LAB_WORK / "wheelhouse"
        build_wheelhouse(wheelhouse, environ)
        env["LAB_MOE_WHEELHOUSE"] = str(wheelhouse)
        config, service_reason = lab_service_config()
        if config is not None and os.environ.get("MOE_LAB_FULL_SERVICE") != "1":
            # The full phase JIT-compiles every kernel under emulation, twice (start and the
            # watchdog restart): tens of minutes. Opt in; the lifecycle phase runs by default.
            config, service_reason = None, "the full service phase is opt-in (MOE_LAB_FULL_SERVICE=1)"
        if config is not None:
            env.update(LAB_MOE_SERVICE_CONFIG=str(config),
                       LAB_MOE_HEALTH_URL=os.environ.get("MOE_LAB_HEALTH_URL", "http://127.0.0.1:8000/health"))
        else:
            # Until then the unit's lifecycle runs with a load-only pipeline (no HTTP).
            lifecycle, lifecycle_reason = staged_config("lifecycle.toml", "lifecycle.toml")
            if lifecycle is not None:
                env["LAB_MOE_LIFECYCLE_CONFIG"] = str(lifecycle)
            else:
                service_reason += f"; no lifecycle run either: {lifecycle_reason}"
    if service_reason is None:
        timeout_s = int(os.environ.get("LAB_TIMEOUT_S", "5400"))
    else:
        env.pop("LAB_MOE_SERVICE_CONFIG", None)
        env["LAB_MOE_SKIP_REASON"] = service_reason
        timeout_s = int(os.environ.get("LAB_TIMEOUT_S", "4800"))
    extra = {k: v for k, v in env.items() if environ.get(k) != v}
    t0 = time.monotonic()
    rc, output, _ = run_in_vm("/usr/bin/python3 tests/systemd/lab/lab_checks.py", nodes=2, mem_gib=4, systemd=True,
                              timeout_s=timeout_s, out_dir=out, env=extra, cwd=lab_repo, base_env=environ)
    report = lab_harness.collect_report(out, rc, output, t0, "the lab VM", "numa_lab_rc")
    report["service_skip_reason"] = service_reason
    return report


_BACKGROUND = lab_harness.BackgroundLab("systemd-lab", boot_lab)


def start_in_background() -> Future:
    """Start :func:`boot_lab` in a daemon thread now (once per process); the lab_report
    fixture waits for it. tests/conftest.py calls this when collection selected this module,
    so the VM (one emulated core, 12-30 minutes) runs beside the rest of the suite instead of
    after it."""
    return _BACKGROUND.start()


@pytest.fixture(scope="module")
def lab_report() -> dict:
    """The lab's report.json (started in the background at collection; started here otherwise)."""
    report = start_in_background().result()
    print(f"numa-lab boot + checks: {report['host_wall_s']} s wall; report: {report['out_dir']}/report.json")
    return report



def step(report: dict, name: str) -> dict:
    return lab_harness.report_step(report, name, "the lab", "numa_lab_rc")


# --- host roles ------------------------------------------------------------------------


def test_vm_runs_systemd_with_two_nodes(lab_report):
    env = step(lab_report, "env")
    assert env["pid1"] == "systemd" and env["nodes"] == [0, 1]
    assert lab_report.get("finished"), f"lab_checks.py stopped early; steps done: {lab_report['order']}"


def test_site_yml_first_run_succeeds(lab_report):
    run = step(lab_report, "ansible_1")
    assert run["rc"] == 0 and run.get("failed") == 0, run["stdout_tail"][-3000:]
    assert run.get("changed", 0) > 0  # the VM starts from kernel defaults


def test_kernel_settings_applied_now(lab_report):
    before, now = step(lab_report, "env"), step(lab_report, "host_state")
    assert before["numa_balancing_before"] == "1"  # the VM boots with the kernel default
    assert now["numa_balancing"] == "0"
    assert (now["thp_enabled"], now["thp_defrag"]) == ("madvise", "defer+madvise")


def test_kernel_settings_persisted_for_boot(lab_report):
    now = step(lab_report, "host_state")
    assert "kernel.numa_balancing = 0" in now["sysctl_file"]
    assert "transparent_hugepage/enabled - - - - madvise" in now["thp_tmpfiles"]
    assert "transparent_hugepage/defrag - - - - defer+madvise" in now["thp_tmpfiles"]
    for node, count in HUGEPAGES_2M_LAB.items():
        assert f"node{node}/hugepages/hugepages-2048kB/nr_hugepages - - - - {count}" in now["hugepages_tmpfiles"]
    assert now["sysctl_parse"] == 0 and now["tmpfiles_parse"] == 0


def test_boot_services_restore_the_settings(lab_report):
    """sysctl.d and tmpfiles.d, read by the services a boot runs, restore everything."""
    s = step(lab_report, "boot_path")
    assert s["reset_to"] == {"numa_balancing": "1", "thp_enabled": "always", "hugepages_2m": {"0": 0, "1": 0}}
    assert s["sysctl_rc"] == 0 and s["tmpfiles_rc"] == 0, s["stderr"]
    assert s["numa_balancing"] == "0"
    assert (s["thp_enabled"], s["thp_defrag"]) == ("madvise", "defer+madvise")
    assert s["hugepages_2m"] == HUGEPAGES_2M_LAB


def test_hugepages_reserved_per_node(lab_report):
    now = step(lab_report, "host_state")
    assert step(lab_report, "env")["hugepages_2m_before"] == {"0": 0, "1": 0}
    assert now["hugepages_2m"] == HUGEPAGES_2M_LAB


def test_second_run_changes_nothing(lab_report):
    run = step(lab_report, "ansible_2")
    assert run["rc"] == 0, run["stdout_tail"][-3000:]
    assert run.get("changed") == 0, f"not idempotent: {run['changed_task_names']}"


def test_nvidia_prereqs_skips_without_nvidia_device(lab_report):
    s = step(lab_report, "nvidia_skip")
    assert s["nvidia_devices"] == []
    assert s["skip_message"], "the role did not print its skip message"
    assert not s["blacklist_written"] and not s["modules_load_written"]


def test_hugepages_shortfall_fails_clearly(lab_report):
    s = step(lab_report, "hugepages_shortfall")
    assert s["rc"] != 0 and s["failed"] == 1, s["stdout_tail"]
    assert s["message_found"], s["stdout_tail"]
    assert s["granted"] is not None and s["granted"] < 100000


# --- units -----------------------------------------------------------------------------


def test_units_verify_clean_under_systemd(lab_report):
    s = step(lab_report, "units_verify")
    for name in ("moe-service.service", "moe-service@lab.service"):
        assert s[name]["rc"] == 0 and s[name]["output"] == "", s[name]


def test_units_security_exposure(lab_report):
    s = step(lab_report, "units_security")
    for unit in ("moe-service.service", "moe-service@lab.service"):
        assert s[unit]["exposure"] is not None, s[unit]
        assert s[unit]["exposure"] <= EXPOSURE_MAX, s[unit]


def test_numa_syscalls_allowed_by_the_unit_sandbox(lab_report):
    s = step(lab_report, "syscall_probe")
    assert s["start_rc"] == 0 and s["exit_status"] == "0", s["journal_tail"]
    probe = s["probe"]
    assert probe is not None, s["journal_tail"]
    for call in ("get_mempolicy", "set_mempolicy", "mbind", "move_pages", "sched_setaffinity"):
        assert probe[call]["ret"] == 0, (call, probe[call])
    assert probe["migrate_pages"]["ret"] >= 0, probe["migrate_pages"]
    # mbind really placed the pages: move_pages (query mode) finds them on the target node.
    assert probe["move_pages"]["page_nodes"] == [probe["mbind"]["target_node"]] * 2


def test_unit_sandbox_is_in_force(lab_report):
    """Controls for the test above: the probe ran filtered, unprivileged and read-only."""
    probe = step(lab_report, "syscall_probe")["probe"]
    assert probe["seccomp"] == "2" and probe["nonewprivs"] == "1"
    assert probe["capeff"] == "0000000000000000"
    assert probe["uid"] != 0
    assert probe["fchown"]["errno_name"] == "EPERM"  # ~@privileged
    assert probe["etc_write"]["errno_name"] == "EROFS"  # ProtectSystem=strict
    assert probe["cache_write"]["ret"] == 0 and probe["cache_directory"] == "/var/cache/moe-service"
    assert probe["root_visible"] is False and probe["home_listing"]["errno_name"] == "EACCES"  # ProtectHome=yes
    assert probe["memlock_infinite"] is True  # LimitMEMLOCK=infinity


# --- moe_service role, installation only (while the pipeline cannot serve) ------------


def test_moe_service_role_installs_offline_and_idempotently(lab_report):
    if "moe_service_install" not in lab_report["steps"]:
        pytest.skip("the whole role ran in the service phase" if not lab_report.get("service_skip_reason")
                    else f"no package to install: {lab_report['service_skip_reason']}")
    s = step(lab_report, "moe_service_install")
    first, second = s["runs"]
    assert first["rc"] == 0 and first["failed"] == 0, first["stdout_tail"]
    assert "moe_service : Install moe-service into the virtualenv" in first["changed_task_names"]
    assert second["rc"] == 0 and second["changed"] == 0, second["changed_task_names"]
    assert s["entry_point"] and len(s["dist_info"]) == 1, s  # the wheel, in the service's own venv
    assert s["help_as_service_user"]["rc"] == 0, s["help_as_service_user"]
    assert s["units_installed"] == {"moe-service.service": True, "moe-service@.service": True}
    assert "uid=" in s["user"] and "moe-service" in s["user"]


# --- service (needs `moe-service serve`) -----------------------------------------------


@pytest.fixture
def service_report(lab_report) -> dict:
    """The report when the unit ran the real service: "full" (the role started it, HTTP and
    all) or "lifecycle" (a load-only pipeline started by hand while there is no serve stage)."""
    if lab_report.get("service_skipped"):
        pytest.fail(lab_report["service_skipped"])
    if not lab_report.get("service_mode"):
        pytest.skip(lab_report.get("service_skip_reason") or "the service did not run")
    return lab_report


def test_service_reaches_active_via_ready(service_report):
    if service_report["service_mode"] == "lifecycle":
        start = step(service_report, "lifecycle_start")
        assert start["rc"] == 0, start["stderr"]
    s = step(service_report, "service_active")
    assert s["show"]["Type"] == "notify"
    assert (s["show"]["ActiveState"], s["show"]["SubState"]) == ("active", "running"), s["journal_tail"]
    assert s["started_line"], "systemd logged no 'Started' line (READY=1 never came?)"
    assert s["show"]["User"] == "moe-service" and s["show"]["LimitMEMLOCK"] == "infinity"
    if service_report["service_mode"] == "full":
        assert s["health"] == 200


def test_service_reports_its_stage_in_status(service_report):
    """STATUS= lines reach systemd (`systemctl status` shows the last one)."""
    s = step(service_report, "service_active")
    assert s["show"]["StatusText"], s["show"]


def test_service_journal_has_structured_fields(service_report):
    s = step(service_report, "service_journal")
    assert s["entries"] > 0
    assert "STAGE" in s["fields"], s["fields"]
    assert "PRIORITY" in s["fields"] and s["priorities"], s["sample"]


def test_service_stops_cleanly(service_report):
    s = step(service_report, "service_stop")
    assert s["rc"] == 0
    assert s["show"]["ActiveState"] == "inactive", s["journal_tail"]
    assert (s["show"]["Result"], s["show"]["ExecMainStatus"]) == ("success", "0"), s["journal_tail"]


def test_stalled_engine_is_restarted_by_the_watchdog(service_report):
    s = step(service_report, "service_watchdog")
    assert s["start_rc"] == 0, s["start_stderr"]
    assert s["nrestarts_after"] > s["nrestarts_before"], s["states"]
    assert any("Watchdog timeout" in line for line in s["watchdog_lines"]), s["journal_tail"]
