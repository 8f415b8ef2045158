"""Static and systemd-analyze checks of units/moe-service.service and moe-service@.service.

These run on the build machine (no systemd as PID 1 needed): `systemd-analyze verify` and
`systemd-analyze security --offline=yes` read unit files directly. The same checks run
against the loaded units inside the numa-lab VM (tests/systemd/test_lab.py), where the
syscall filter is also exercised for real.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAIN = REPO / "units/moe-service.service"
TEMPLATE = REPO / "units/moe-service@.service"
EXPOSURE_MAX = 4.5
NUMA_SYSCALLS = ("mbind", "set_mempolicy", "get_mempolicy", "move_pages", "migrate_pages", "sched_setaffinity")

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def directives(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every directive line, in file order."""
    section, out = "", []
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("["):
            section = s.strip("[]")
            continue
        key, _, value = s.partition("=")
        out.append((section, key, value))
    return out


def values(path: Path, key: str) -> list[str]:
    return [v for _, k, v in directives(path) if k == key]


def copy_for_analyze(tmp_path: Path, src: Path, name: str) -> Path:
    """The unit with ExecStart's binary replaced by /bin/true (verify checks it exists)."""
    dest = tmp_path / name
    dest.write_text(src.read_text().replace("/opt/moe-service/venv/bin/moe-service", "/bin/true"))
    return dest


def test_template_differs_only_in_instance_lines():
    """The template is the plain unit with %i in the description, config path and cache dirs."""
    normalized = [
        (s, k, v.replace(" %i:", ":").replace("/etc/moe-service/%i.toml", "/etc/moe-service/moe-service.toml")
         .replace("moe-service/%i", "moe-service"))
        for s, k, v in directives(TEMPLATE)
    ]
    assert normalized == directives(PLAIN)
    assert "--config /etc/moe-service/%i.toml" in values(TEMPLATE, "ExecStart")[0]


@pytest.mark.parametrize("unit", [PLAIN, TEMPLATE], ids=lambda p: p.name)
def test_every_directive_is_explained_by_a_comment(unit: Path):
    """Each paragraph (lines between blank lines) of directives opens with a comment."""
    paragraph_has_comment, missing = False, []
    for line in unit.read_text().splitlines():
        s = line.strip()
        if not s:
            paragraph_has_comment = False
        elif s.startswith("#"):
            paragraph_has_comment = True
        elif s.startswith("["):
            paragraph_has_comment = False
        elif not paragraph_has_comment:
            missing.append(s)
    assert missing == [], f"directives without an explaining comment in {unit.name}: {missing}"


@pytest.mark.parametrize("unit", [PLAIN, TEMPLATE], ids=lambda p: p.name)
def test_lifecycle_and_identity(unit: Path):
    assert values(unit, "Type") == ["notify"]
    assert values(unit, "NotifyAccess") == ["main"]
    assert values(unit, "Restart") == ["on-failure"]
    assert values(unit, "RestartSec") and values(unit, "WatchdogSec") and values(unit, "TimeoutStartSec")
    assert values(unit, "LimitMEMLOCK") == ["infinity"]
    assert values(unit, "User") == ["moe-service"] and values(unit, "Group") == ["moe-service"]
    assert not values(unit, "DynamicUser")
    assert values(unit, "ExecStart")[0].startswith("/opt/moe-service/venv/bin/moe-service serve --config /etc/")


@pytest.mark.parametrize("unit", [PLAIN, TEMPLATE], ids=lambda p: p.name)
def test_sandbox_keeps_what_the_service_needs(unit: Path):
    """Hardening that still lets it JIT, reach the GPU, serve HTTP and talk to systemd."""
    assert not values(unit, "MemoryDenyWriteExecute"), "numba JIT needs writable+executable memory"
    assert values(unit, "ProtectSystem") == ["strict"]
    assert values(unit, "CacheDirectory")
    assert values(unit, "PrivateDevices") == ["no"], "PrivateDevices=yes hides /dev/nvidia*"
    assert values(unit, "DevicePolicy") == ["closed"]
    assert "char-nvidia* rw" in values(unit, "DeviceAllow")
    assert values(unit, "NoNewPrivileges") == ["yes"]
    families = " ".join(values(unit, "RestrictAddressFamilies")).split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    assert values(unit, "ProcSubset") in ([], ["all"]), "preflight reads /proc/meminfo and /proc/sys"
    filters = values(unit, "SystemCallFilter")
    assert filters[0].split()[0] == "@system-service"
    denies = " ".join(f[1:] for f in filters if f.startswith("~")).split()
    assert "@resources" not in denies, "~@resources would deny mbind/set_mempolicy/move_pages"


def syscall_group(name: str) -> set[str]:
    """The system calls of a systemd syscall group, nested groups expanded (local systemd)."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True,
                         check=True).stdout
    calls: set[str] = set()
    for line in out.splitlines()[1:]:
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        item = item.split()[0]
        calls |= syscall_group(item) if item.startswith("@") else {item}
    return calls


@needs_analyze
@pytest.mark.parametrize("unit", [PLAIN, TEMPLATE], ids=lambda p: p.name)
def test_numa_syscalls_pass_the_filter(unit: Path):
    """Allow lists, then deny lists, as systemd applies them: the NUMA calls stay allowed.

    Uses this machine's systemd group definitions; the VM test runs the calls for real.
    """
    allowed: set[str] = set()
    for spec in values(unit, "SystemCallFilter"):
        deny = spec.startswith("~")
        names = (spec[1:] if deny else spec).split()
        calls = set().union(*(syscall_group(n) if n.startswith("@") else {n} for n in names))
        allowed = allowed - calls if deny else allowed | calls
    missing = [c for c in NUMA_SYSCALLS if c not in allowed]
    assert missing == [], f"{unit.name}'s SystemCallFilter= denies {missing}"
    assert "chown" not in allowed and "setuid" not in allowed  # the ~@privileged part is in force


@needs_analyze
@pytest.mark.parametrize("src,name", [(PLAIN, "moe-service.service"), (TEMPLATE, "moe-service@lab.service")])
def test_systemd_analyze_verify_is_clean(tmp_path: Path, src: Path, name: str):
    path = copy_for_analyze(tmp_path, src, name)
    res = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert res.returncode == 0 and (res.stdout + res.stderr).strip() == "", res.stdout + res.stderr


@needs_analyze
@pytest.mark.parametrize("src,name", [(PLAIN, "moe-service.service"), (TEMPLATE, "moe-service@lab.service")])
def test_security_exposure_at_most_4_5(tmp_path: Path, src: Path, name: str):
    path = copy_for_analyze(tmp_path, src, name)
    res = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(path)],
                         capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout)
    assert m, res.stdout[-2000:] + res.stderr
    assert float(m.group(1)) <= EXPOSURE_MAX, res.stdout
