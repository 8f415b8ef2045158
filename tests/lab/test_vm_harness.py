"""The lab harness itself: exit status, output, files through $LAB_OUT, environment, the
NUMA layout asked for (nodes, CPUs, distances). One short plain boot."""

from __future__ import annotations

import pytest

from tests.lab.vm import lab_available, qemu_command, run_in_vm


@pytest.mark.lab
def test_command_status_output_files_and_topology(tmp_path):
    dist = [[10, 31], [31, 10]]
    rc, output, out = run_in_vm(
        'echo "lab=$NUMA_LAB marker=$LAB_MARKER"; cat /sys/devices/system/node/node1/distance; '
        'cat /sys/devices/system/node/node1/cpulist; echo payload > "$LAB_OUT/result.txt"; exit 7',
        nodes=2, mem_gib=1, cpus=4, distances=dist, env={"LAB_MARKER": "x y"}, out_dir=tmp_path / "out",
        timeout_s=300,
    )
    assert rc == 7, output
    assert "lab=1 marker=x y" in output
    assert "31 10" in output and "2-3" in output
    assert (out / "result.txt").read_text() == "payload\n"


def test_qemu_command_layout(tmp_path):
    argv = qemu_command(tmp_path / "vmlinuz", tmp_path / "initrd", tmp_path, nodes=4, mem_gib=6, cpus=8,
                        systemd=True, distances=[[10, 12, 21, 21], [12, 10, 21, 21], [21, 21, 10, 12],
                                                 [21, 21, 12, 10]], accel="tcg")
    joined = " ".join(argv)
    assert "-m 6144M" in joined and "-smp 8" in joined
    assert "node,nodeid=3,cpus=6-7,memdev=m3" in joined and "memory-backend-ram,id=m0,size=1536M" in joined
    assert "dist,src=0,dst=2,val=21" in joined and "dist,src=1,dst=0,val=12" in joined
    assert "moe_lab.systemd=1" in joined


def test_lab_available_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    ok, reason = lab_available()
    assert not ok and "qemu-system-x86_64" in reason and "apt-get install -y qemu-system-x86" in reason
