"""The container lab harness (tests/lab/container.py): exit status, output, files through
$LAB_OUT, the environment, systemd as PID 1, a private network, writes kept inside. One boot
of a few seconds; skipped with the reason where it cannot run (not root, no systemd-nspawn)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.lab.container import container_available, nspawn_command, run_in_container


def test_command_status_output_files_and_isolation(tmp_path):
    ok, reason = container_available()
    if not ok or os.environ.get("NUMA_LAB") == "1":
        pytest.skip(reason if not ok else "already inside a lab")
    marker = Path("/var/tmp") / f"moe-lab-ct-marker-{os.getpid()}"
    rc, output, out = run_in_container(
        'echo "pid1=$(cat /proc/1/comm) lab=$NUMA_LAB ct=$MOE_LAB_CONTAINER marker=$LAB_MARKER"; '
        "echo state=$(systemctl is-system-running); "
        'ls /sys/class/net | tr "\\n" " "; echo; '
        f'echo inside > {marker}; echo payload > "$LAB_OUT/result.txt"; exit 7',
        env={"LAB_MARKER": "x y"}, out_dir=tmp_path / "out", timeout_s=120, cwd="/",
    )
    assert rc == 7, output
    assert "pid1=systemd lab=1 ct=1 marker=x y" in output
    assert "state=starting" in output, output  # the job is part of the boot transaction
    assert output.split("\n")[2].split() == ["lo"], output  # private network: loopback only
    assert (out / "result.txt").read_text() == "payload\n"
    assert not marker.exists()  # the root is a throw-away overlay


def test_nspawn_command_binds_and_boots_the_lab_target(tmp_path):
    argv = nspawn_command("m", tmp_path, [Path("/srv/x")], ["--unit=moe-lab.target"])
    assert argv[0] == "systemd-nspawn" and "--private-network" in argv and "--machine=m" in argv
    assert f"--bind={tmp_path}:/lab-out" in argv and "--bind-ro=/srv/x" in argv
    assert argv[-3:] == ["--boot", "--", "--unit=moe-lab.target"]
