"""Checks of ansible/ that run on the build machine (the roles run for real in test_lab.py).

- site.yml and the example inventory pass `ansible-playbook --syntax-check`;
- every role variable is prefixed with the role's name, documented in defaults/main.yml
  (or derived in vars/main.yml), and every prefixed name the role uses is defined somewhere;
- the templates render what systemd, systemd-tmpfiles, sysctl and moe-service read: the
  TOML parses back to the merged settings, the drop-in overrides ExecStart and quotes
  Environment=, the tmpfiles.d lines name each node's pool.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with ansible-core (pip install -e .[lint])")

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
ROLES = ("numa_host", "hugepages", "nvidia_prereqs", "moe_service", "moe_balancer")
PLAYBOOK_BIN = shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) or shutil.which(
    "ansible-playbook")

needs_ansible = pytest.mark.skipif(PLAYBOOK_BIN is None, reason="ansible-core is not installed (pip install -e .[lint])")


def ansible_env() -> dict:
    import os

    return dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                ANSIBLE_LOCAL_TEMP="/tmp/ansible-local", ANSIBLE_COLLECTIONS_PATH="/nonexistent")


@needs_ansible
def test_site_yml_syntax():
    res = subprocess.run([PLAYBOOK_BIN, "--syntax-check", "-i", "inventory/example.yml", "site.yml"], cwd=ANSIBLE,
                         capture_output=True, text=True, env=ansible_env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def yaml_keys_with_comment(path: Path) -> dict[str, bool]:
    """Top-level keys of a YAML file -> whether a comment line sits in the block above it."""
    out, commented = {}, False
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            commented = True
        elif not line.strip():
            commented = False
        elif re.match(r"^[A-Za-z_][A-Za-z0-9_]*:", line):
            out[line.split(":", 1)[0]] = commented
        elif line.startswith(("---",)):
            commented = False
    return out


@pytest.mark.parametrize("role", ROLES)
def test_role_defaults_prefixed_and_documented(role: str):
    keys = yaml_keys_with_comment(ANSIBLE / "roles" / role / "defaults/main.yml")
    assert keys, f"{role} has no defaults"
    assert [k for k in keys if not k.startswith(role + "_")] == []
    assert [k for k, documented in keys.items() if not documented] == [], "undocumented defaults"


def names_defined_in_tasks(node, found: set[str]) -> None:
    """register:, task-level vars: keys and index_var:/loop_var: values, recursively."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "register" and isinstance(value, str):
                found.add(value)
            elif key == "vars" and isinstance(value, dict):
                found.update(value)
            elif key in ("index_var", "loop_var") and isinstance(value, str):
                found.add(value)
            names_defined_in_tasks(value, found)
    elif isinstance(node, list):
        for item in node:
            names_defined_in_tasks(item, found)


@pytest.mark.parametrize("role", ROLES)
def test_role_uses_only_defined_names(role: str):
    """A typo in a prefixed variable name would otherwise surface only on a real host."""
    root = ANSIBLE / "roles" / role
    defined: set[str] = set()
    for sub in ("defaults", "vars"):
        f = root / sub / "main.yml"
        if f.exists():
            defined.update(yaml.safe_load(f.read_text()) or {})
    files = [p for sub in ("tasks", "handlers", "templates", "vars") for p in (root / sub).glob("*") if p.is_file()]
    for f in files:
        if f.suffix == ".yml":
            names_defined_in_tasks(yaml.safe_load(f.read_text()), defined)
    used, retired = set(), set()
    for f in files:
        used.update(re.findall(rf"\b{role}_[a-z0-9_]+\b", f.read_text()))
        # a retired variable is named only to refuse an inventory that still sets it
        retired.update(re.findall(rf"\b({role}_[a-z0-9_]+) is not defined\b", f.read_text()))
    assert sorted(used - defined - retired) == []


RENDER_PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  vars_files:
    - {roles}/moe_service/defaults/main.yml
    - {roles}/moe_service/vars/main.yml
    - {roles}/numa_host/defaults/main.yml
    - {roles}/hugepages/defaults/main.yml
    - {roles}/hugepages/vars/main.yml
  tasks:
    - name: Render each instance's TOML
      ansible.builtin.template:
        src: {roles}/moe_service/templates/moe-service.toml.j2
        dest: "{out}/{{{{ moe_service_item_name or 'plain' }}}}.toml"
        mode: "0644"
      loop: "{{{{ moe_service_instances }}}}"
    - name: Render each instance's drop-in
      ansible.builtin.template:
        src: {roles}/moe_service/templates/dropin.conf.j2
        dest: "{out}/{{{{ moe_service_item_name or 'plain' }}}}.conf"
        mode: "0644"
      loop: "{{{{ moe_service_instances }}}}"
    - name: Record each instance's unit, config path and health URL
      ansible.builtin.copy:
        content: "{{{{ moe_service_item_unit }}}} {{{{ moe_service_item_config_path }}}} {{{{ moe_service_item_health_url }}}}"
        dest: "{out}/{{{{ moe_service_item_name or 'plain' }}}}.derived"
        mode: "0644"
      loop: "{{{{ moe_service_instances }}}}"
    - name: Render the sysctl.d, THP and hugepages files
      ansible.builtin.template:
        src: "{roles}/{{{{ item.0 }}}}/templates/{{{{ item.1 }}}}"
        dest: "{out}/{{{{ item.1 }}}}"
        mode: "0644"
      loop:
        - [numa_host, sysctl.conf.j2]
        - [numa_host, thp-tmpfiles.conf.j2]
        - [hugepages, hugepages-tmpfiles.conf.j2]
"""

RENDER_VARS = {
    "moe_service_environment": {"OMP_NUM_THREADS": "1", "PCT": "50%"},
    "moe_service_venv_path": "/srv/venv",
    "numa_host_sysctl_extra": {"vm.zone_reclaim_mode": 0},
    "hugepages_2m_per_node": {"0": 512, "1": 256},
    "hugepages_1g_per_node": {"1": 2},
    "moe_service_instances": [
        {"name": "", "config": {
            "model": {"path": "/srv/models/m.gguf"},
            "serve": {"host": "0.0.0.0", "shutdown_grace_s": 20},
            "pipeline": {"stages": ["fastload", "placement", "serve"], "fastload": {"threads": 16, "thp": True}},
            "odd key": {"a.b": 'quote " and \\ backslash', "ratio": 0.25},
            "replicas": [{"layer": 1, "nodes": [0, 1]}, {"layer": 2, "nodes": [1]}],
        }},
        {"name": "qwen3", "config": {"serve": {"host": "::", "port": 8001}}, "environment": {"EXTRA": "x y"}},
    ],
}


@needs_ansible
def test_templates_render_what_the_consumers_read(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    book = tmp_path / "render.yml"
    book.write_text(RENDER_PLAYBOOK.format(roles=ANSIBLE / "roles", out=out))
    extra = tmp_path / "vars.json"
    extra.write_text(json.dumps(RENDER_VARS))
    res = subprocess.run([PLAYBOOK_BIN, "-i", "localhost,", str(book), "-e", f"@{extra}",
                          "-e", f"ansible_python_interpreter={sys.executable}"], capture_output=True,
                         text=True, env=ansible_env(), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]

    plain = tomllib.loads((out / "plain.toml").read_text())
    assert plain["serve"] == {"host": "0.0.0.0", "port": 8000, "shutdown_grace_s": 20}  # merged over defaults
    assert plain["model"] == {"path": "/srv/models/m.gguf"}
    assert plain["pipeline"] == {"stages": ["fastload", "placement", "serve"], "fastload": {"threads": 16, "thp": True}}
    assert plain["odd key"] == {"a.b": 'quote " and \\ backslash', "ratio": 0.25}
    assert plain["replicas"] == [{"layer": 1, "nodes": [0, 1]}, {"layer": 2, "nodes": [1]}]
    assert tomllib.loads((out / "qwen3.toml").read_text()) == {"serve": {"host": "::", "port": 8001}}

    assert (out / "plain.derived").read_text() == (
        "moe-service.service /etc/moe-service/moe-service.toml http://127.0.0.1:8000/health")
    assert (out / "qwen3.derived").read_text() == (
        "moe-service@qwen3.service /etc/moe-service/qwen3.toml http://[::1]:8001/health")

    dropin = (out / "qwen3.conf").read_text().splitlines()
    assert dropin[dropin.index("[Service]") + 1:][:2] == [
        "ExecStart=", "ExecStart=/srv/venv/bin/moe-service serve --config /etc/moe-service/qwen3.toml"]
    assert 'Environment="PCT=50%%"' in dropin  # % is a unit-file specifier: doubled
    assert 'Environment="EXTRA=x y"' in dropin and 'Environment="OMP_NUM_THREADS=1"' in dropin
    assert "TimeoutStartSec=300s" in dropin and "WatchdogSec=60s" in dropin

    sysctl = (out / "sysctl.conf.j2").read_text()
    assert "kernel.numa_balancing = 0" in sysctl and "vm.zone_reclaim_mode = 0" in sysctl
    thp = (out / "thp-tmpfiles.conf.j2").read_text()
    assert "w /sys/kernel/mm/transparent_hugepage/defrag - - - - defer+madvise" in thp
    pools = [ln for ln in (out / "hugepages-tmpfiles.conf.j2").read_text().splitlines() if ln.startswith("w ")]
    assert pools == [  # 1 GiB pools first: they fragment first
        "w /sys/devices/system/node/node1/hugepages/hugepages-1048576kB/nr_hugepages - - - - 2",
        "w /sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages - - - - 512",
        "w /sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages - - - - 256",
    ]
