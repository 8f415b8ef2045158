"""tests/systemd/lab/lab_common.py on this host (no VM, no container): the step report both lab
scripts write, ansible-playbook's recap and changed tasks read from its output (a recorded
playbook stands in for Ansible), and both scripts importing under the system Python with the
standard library only, as they do inside the labs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parent / "lab"
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def lab_common(tmp_path, monkeypatch):
    """A fresh lab_common (its report starts empty) writing to tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("LAB_OUT", str(out))
    monkeypatch.setenv("LAB_REPO", str(tmp_path / "repo"))
    spec = importlib.util.spec_from_file_location("lab_common_under_test", LAB / "lab_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_steps_are_recorded_in_order_with_errors_and_saved(lab_common, capsys):
    step = lab_common.recorder("lab_checks")

    @step("first")
    def first() -> dict:
        return {"value": 1}

    @step("broken")
    def broken() -> dict:
        raise RuntimeError("no such unit")

    assert first()["value"] == 1
    assert broken()["error"] == "RuntimeError: no such unit"
    saved = json.loads((lab_common.OUT / "report.json").read_text())
    assert saved["order"] == ["first", "broken"]
    assert saved["steps"]["first"]["value"] == 1 and saved["steps"]["first"]["duration_s"] >= 0
    assert "no such unit" in saved["steps"]["broken"]["traceback"]
    assert saved["elapsed_s"] >= 0
    assert "lab_checks: broken done in" in capsys.readouterr().out


def test_ansible_playbook_reads_the_recap_and_the_changed_tasks(lab_common, tmp_path, monkeypatch):
    # A playbook binary printing the default callback's output (and the env it ran with).
    fake = tmp_path / "ansible-playbook"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo "args: $*"
        echo "config=$ANSIBLE_CONFIG pythonpath=${PYTHONPATH:-unset}"
        echo "TASK [hugepages : Reserve the pools now] ****"
        echo "changed: [lab]"
        echo "TASK [moe_service : Install the wheel] ****"
        echo "ok: [lab]"
        echo "RUNNING HANDLER [moe_service : Restart] ****"
        echo "changed: [lab] => (item=moe-service@a)"
        echo "PLAY RECAP ****"
        echo "lab                        : ok=7    changed=2    unreachable=0    failed=0    skipped=3    rescued=0"
        echo "to stderr" >&2
        exit 0
        """))
    fake.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", "/checkout")
    out = lab_common.ansible_playbook([str(fake), "-i", "inventory.yml", "site.yml"], "ansible-1.log", timeout_s=60)
    assert out["rc"] == 0 and (out["ok"], out["changed"], out["unreachable"], out["failed"], out["skipped"]) == (
        7, 2, 0, 0, 3)
    assert out["changed_task_names"] == ["hugepages : Reserve the pools now", "moe_service : Restart"]
    assert out["changed_tasks"] == ["", "moe-service@a"]
    assert f"config={lab_common.REPO / 'ansible/ansible.cfg'} pythonpath=unset" in out["stdout_tail"]
    log = (lab_common.OUT / "ansible-1.log").read_text()
    assert out["log"] == "ansible-1.log" and "PLAY RECAP" in log and log.endswith("--- stderr ---\nto stderr\n")


def test_a_playbook_without_a_recap_has_no_counts(lab_common, tmp_path):
    out = lab_common.ansible_playbook(["/bin/sh", "-c", "echo ERROR! the playbook could not be found; exit 1"],
                                      "ansible-x.log", timeout_s=60)
    assert out["rc"] == 1 and "failed" not in out and out["changed_task_names"] == []


@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason=f"no {SYSTEM_PYTHON} (the labs' interpreter)")
@pytest.mark.parametrize("script", ["lab_checks", "fleet_checks"])
def test_lab_scripts_import_with_the_system_python(script, tmp_path):
    """Each script as the lab starts it: the system Python, its own folder first on sys.path
    (-c: the working directory), no site-packages (-S); importing it must not run a step."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LAB_OUT": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    res = subprocess.run([SYSTEM_PYTHON, "-S", "-B", "-c", f"import {script}; print(sorted({script}.report['steps']))"],
                         cwd=LAB, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    assert not (tmp_path / "report.json").exists()
