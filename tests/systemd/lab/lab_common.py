"""What both lab check scripts share: the step report, the command runner, ansible-playbook.

Imported by tests/systemd/lab/lab_checks.py (the numa-lab VM, systemd as PID 1) and
tests/systemd/lab/fleet_checks.py (the systemd container): each runs as a script with the
system Python and the standard library only, so this module is found next to them (a script's
own folder is the first entry of sys.path) and imports nothing but the standard library.

The report: ``report["steps"][name]`` holds each step's dict (or its exception and traceback)
with ``duration_s``, ``report["order"]`` the order they ran in; report.json in $LAB_OUT is
rewritten after every step, so a lab that times out still leaves the steps it finished.

Environment: LAB_OUT (default /lab-out), LAB_REPO (the repository root, default the current
folder), LAB_ANSIBLE_PLAYBOOK, LAB_SHARED_SITE_PACKAGES (prepare_service_venv).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

OUT = Path(os.environ.get("LAB_OUT", "/lab-out"))
REPO = Path(os.environ.get("LAB_REPO", os.getcwd()))
PLAYBOOK_BIN = os.environ.get("LAB_ANSIBLE_PLAYBOOK", "ansible-playbook")

report: dict[str, object] = {"steps": {}, "order": [], "started_monotonic_s": time.monotonic()}


def save() -> None:
    """Write the report so far (called after every step)."""
    report["elapsed_s"] = round(time.monotonic() - float(report["started_monotonic_s"]), 1)
    tmp = OUT / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    tmp.replace(OUT / "report.json")


def recorder(prog: str) -> Callable[[str], Callable]:
    """The ``@step(name)`` decorator of script ``prog`` (the name its progress lines start with):
    run the step, record its dict (or the exception) and its duration, save the report."""

    def step(name: str):
        def wrap(fn):
            def run(*args, **kwargs):
                t0 = time.monotonic()
                print(f"{prog}: {name} ...", flush=True)
                try:
                    result = fn(*args, **kwargs)
                except Exception as exc:  # recorded, the next steps still run
                    result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                result["duration_s"] = round(time.monotonic() - t0, 1)
                report["steps"][name] = result
                report["order"].append(name)
                print(f"{prog}: {name} done in {result['duration_s']} s", flush=True)
                save()
                return result

            return run

        return wrap

    return step


def sh(argv: list[str], timeout_s: float = 600, env: dict | None = None, check: bool = False) -> dict:
    """Run a command; return rc, stdout, stderr (text)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    out = {"argv": argv, "rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    if check and proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return out


def read(path: Path | str) -> str:
    return Path(path).read_text().strip()


def prepare_service_venv() -> dict:
    """Make /opt/moe-service/venv see the shared venv's dependencies (the lab has no network).

    The role reuses an existing virtualenv as it is; this one is created with the system
    Python (the shared venv's own interpreter lives under /root, which the service user
    cannot reach) and gets a .pth line naming a folder of links to the shared venv's
    site-packages, minus any moe-service installed there, so that pip installs the wheel
    under test and everything else (torch 2.13.0, numpy, ...) is already satisfied.
    """
    shared = Path(os.environ["LAB_SHARED_SITE_PACKAGES"])
    venv = Path("/opt/moe-service/venv")
    # --without-pip: pip and setuptools come from the shared venv too (Debian's ensurepip
    # brings setuptools 66, older than torch 2.13 declares, and the VM cannot fetch a newer).
    sh(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout_s=900)
    links = Path("/opt/moe-service/lab-site-packages")
    links.mkdir(parents=True, exist_ok=True)
    skipped = []
    for entry in shared.iterdir():
        low = entry.name.lower()
        if low.startswith(("moe_service", "moe-service", "__editable__", "pipeline")):
            skipped.append(entry.name)
            continue
        (links / entry.name).symlink_to(entry)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "lab-shared.pth").write_text(str(links) + "\n")
    return {"venv": str(venv), "shared_site_packages": str(shared), "left_out": skipped}


def changed_task_names(stdout: str) -> list[str]:
    """Names of the tasks that reported changed, from the default callback's output."""
    names, current = [], None
    for line in stdout.splitlines():
        m = re.match(r"^(?:TASK|RUNNING HANDLER) \[(.*)\]", line)
        if m:
            current = m.group(1)
        elif line.startswith("changed:") and current and current not in names:
            names.append(current)
    return names


_RECAP = re.compile(r"^\S+\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)", re.M)


def ansible_playbook(argv: list[str], log_name: str, timeout_s: float = 1800) -> dict:
    """Run ansible-playbook ``argv`` with the repository's ansible.cfg and roles; its output
    goes to $LAB_OUT/``log_name``. Returns argv, rc, seconds, the output's tails, the changed
    tasks (and their names), the log's name and, when the recap line is there, ok, changed,
    unreachable, failed and skipped."""
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible/ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", PYTHONUNBUFFERED="1", ANSIBLE_ROLES_PATH=str(REPO / "ansible/roles"))
    # A PYTHONPATH naming the checkout (its build leaves moe_service.egg-info there) would make
    # pip in the service's virtualenv take the package as installed: the wheel must go in.
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    res = sh(argv, timeout_s=timeout_s, env=env)
    (OUT / log_name).write_text(res["stdout"] + "\n--- stderr ---\n" + res["stderr"])
    out = {
        "argv": argv,
        "rc": res["rc"],
        "seconds": round(time.monotonic() - t0, 1),
        "stdout_tail": res["stdout"][-6000:],
        "stderr_tail": res["stderr"][-3000:],
        "changed_tasks": re.findall(r"^changed: \[[^]]+\](?: => \(item=([^)]*)\))?", res["stdout"], re.M),
        "changed_task_names": changed_task_names(res["stdout"]),
        "log": log_name,
    }
    recap = _RECAP.search(res["stdout"])
    if recap:
        out.update(ok=int(recap[1]), changed=int(recap[2]), unreachable=int(recap[3]), failed=int(recap[4]),
                   skipped=int(recap[5]))
    return out
