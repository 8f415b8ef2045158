"""The project's NUMA lab: run one command inside a throw-away QEMU VM with several NUMA nodes.

Our build and CI machines have one NUMA node and no systemd as PID 1, so tests of memory
placement (mbind, move_pages, per-node residency) and of the service under systemd run in a
VM that boots this machine's own kernel::

    qemu-system-x86_64 -accel tcg, N nodes (-numa node/dist), M GiB split evenly
      kernel  /boot/vmlinuz-* (the newest)
      initrd  busybox + the 9p/virtio/overlay modules of that kernel + our /init (cached)
      root    this machine's / over 9p, read-only, with a tmpfs overlay: every path, Python
              and virtualenv is the same inside; writes vanish at power-off
      out     a host folder over 9p at /lab-out ($LAB_OUT inside): files come back
      ttyS0   kernel console -> OUT/.console      ttyS1 -> the command's stdout+stderr
      init    plain: /bin/sh runs the job, writes its exit status, powers off
              systemd: systemd is PID 1, the job runs as a oneshot unit, then poweroff

Prerequisites (Debian): ``apt-get install -y qemu-system-x86 linux-image-amd64
busybox-static cpio`` (plus kmod for modprobe, normally present). No network inside the VM:
prepare files on the host first. Emulation (TCG) runs CPU work 30-60x slower than the host:
keep lab tests to placement and lifecycle checks, never JIT-compile numba kernels inside, and
never quote a time measured inside. A plain boot takes about 15-20 s.

Use from tests::

    from tests.lab.vm import lab_available, run_in_vm
    ok, reason = lab_available()
    rc, output, out_dir = run_in_vm("python -m pytest tests/numa -q", nodes=4, mem_gib=4)

Inside, the command runs as root through ``/bin/sh -c`` in the current directory, with PATH,
HOME, VIRTUAL_ENV, PYTHONPATH, LANG, every LAB_* / MOE_* variable, ``env`` and
``LAB_OUT=/lab-out NUMA_LAB=1``. Exit status: the command's; 124 on timeout; 125 when the VM
could not run it. Command line: ``python tests/lab/vm.py [--nodes N] [--mem-gib G]
[--systemd] [--out DIR] -- CMD``.
"""

from __future__ import annotations

import atexit
import glob
import gzip
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

APT_PACKAGES = ("qemu-system-x86", "linux-image-amd64", "busybox-static", "cpio")
INSTALL_COMMAND = "apt-get install -y " + " ".join(APT_PACKAGES)
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
PASSED_ENV = ("PATH", "HOME", "VIRTUAL_ENV", "PYTHONPATH", "LANG")
RC_TIMEOUT = 124
RC_VM_FAILED = 125

# The VM's /init (busybox sh). Mount 9p root read-only + tmpfs overlay, move the out folder
# in, then either run the job and power off, or hand over to systemd.
_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
fail() { echo "moe-lab-vm: $*" > /dev/ttyS1; echo 125 > /lab-out/.rc 2>/dev/null; sync; poweroff -f; }
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m 2>/dev/null; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576,ro,cache=loose hostroot /lower || fail "9p root mount failed"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 labout /lab-out || fail "9p out mount failed"
mount -t tmpfs -o size=80% tmpfs /upper; mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /newroot || fail "overlay mount failed"
mkdir -p /newroot/lab-out; mount --move /lab-out /newroot/lab-out
mount --move /proc /newroot/proc; mount --move /sys /newroot/sys; mount --move /dev /newroot/dev
if grep -q 'moe_lab.systemd=1' /newroot/proc/cmdline; then
  cp /newroot/lab-out/.units/* /newroot/etc/systemd/system/ || fail "no units for systemd mode"
  exec switch_root /newroot /lib/systemd/systemd --unit=moe-lab.target
fi
exec switch_root /newroot /bin/sh -c 'mount -t tmpfs tmpfs /run; mkdir -p /dev/shm; mount -t tmpfs tmpfs /dev/shm; /bin/sh /lab-out/.job > /dev/ttyS1 2>&1; echo $? > /lab-out/.rc; sync; echo o > /proc/sysrq-trigger; sleep 30'
"""

_UNITS = {
    "moe-lab.target": """[Unit]
Description=moe-service lab
Requires=basic.target moe-lab-job.service
After=basic.target
AllowIsolate=yes
""",
    "moe-lab-job.service": """[Unit]
Description=moe-service lab job
After=basic.target
[Service]
Type=oneshot
ExecStart=/bin/sh -c '/bin/sh /lab-out/.job > /dev/ttyS1 2>&1; echo $? > /lab-out/.rc; sync'
ExecStopPost=/bin/systemctl poweroff --force
""",
}


def kernel_image() -> Path | None:
    """The kernel the VM boots: $LAB_KERNEL, else the newest /boot/vmlinuz-*."""
    if os.environ.get("LAB_KERNEL"):
        return Path(os.environ["LAB_KERNEL"])
    images = glob.glob("/boot/vmlinuz-*")

    def version_key(p: str) -> list:
        return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p)]

    return Path(sorted(images, key=version_key)[-1]) if images else None


def _module_files(kver: str, name: str) -> list[str]:
    """Module files (dependencies first) of ``name`` for kernel ``kver``; [] when built in."""
    out = subprocess.run(["modprobe", "-S", kver, "--show-depends", name], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"modprobe -S {kver} --show-depends {name}: {out.stderr.strip()}")
    return [line.split()[1] for line in out.stdout.splitlines() if line.startswith("insmod ")]


def lab_available() -> tuple[bool, str]:
    """(True, "ready") when a VM can boot here, else (False, what is missing and how to install it)."""
    missing = []
    if not shutil.which("qemu-system-x86_64"):
        missing.append("qemu-system-x86_64")
    kimg = kernel_image()
    if kimg is None or not kimg.exists():
        missing.append("a kernel in /boot")
    busybox = shutil.which("busybox")
    if not busybox:
        missing.append("busybox")
    else:
        listed = subprocess.run([busybox, "--list"], capture_output=True, text=True).stdout.split()
        if "switch_root" not in listed:
            missing.append("a busybox with switch_root (busybox-static)")
    for tool in ("cpio", "modprobe"):
        if not shutil.which(tool):
            missing.append(tool)
    if missing:
        return False, f"NUMA lab VM cannot run here: missing {', '.join(missing)} (install: {INSTALL_COMMAND})"
    kver = kimg.name.removeprefix("vmlinuz-")
    try:
        for m in MODULES:
            _module_files(kver, m)
    except RuntimeError as e:
        return False, f"NUMA lab VM cannot run here: kernel {kver} modules not found ({e})"
    if not os.access("/", os.R_OK):
        return False, "NUMA lab VM cannot run here: / is not readable for the 9p root"
    return True, "ready"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or "/var/tmp"
    d = Path(base) / "moe-service-lab"
    d.mkdir(parents=True, exist_ok=True)
    return d


def build_initrd(kimg: Path) -> Path:
    """The initrd for ``kimg`` (busybox, 9p/virtio/overlay modules, our /init), built once and
    cached under $XDG_CACHE_HOME (default /var/tmp)/moe-service-lab, keyed by kernel and /init."""
    kver = kimg.name.removeprefix("vmlinuz-")
    key = hashlib.sha256((_INIT + kver).encode()).hexdigest()[:12]
    target = _cache_dir() / f"initrd-{kver}-{key}.gz"
    if target.exists() and target.stat().st_size > 0:
        return target
    with tempfile.TemporaryDirectory(prefix="moe-lab-initrd-") as tmp:
        root = Path(tmp)
        for d in ("bin", "lib/modules", "proc", "sys", "dev", "lower", "upper", "newroot", "lab-out"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(shutil.which("busybox"), root / "bin/busybox")
        order: list[str] = []
        for m in MODULES:
            for f in _module_files(kver, m):
                if f not in order:
                    order.append(f)
        for f in order:
            shutil.copy2(f, root / "lib/modules" / Path(f).name)
        (root / "lib/modules/order").write_text("".join(Path(f).name + "\n" for f in order))
        (root / "init").write_text(_INIT)
        (root / "init").chmod(0o755)
        files = subprocess.run(["find", "."], cwd=root, capture_output=True, text=True, check=True).stdout
        cpio = subprocess.run(["cpio", "-o", "-H", "newc"], cwd=root, input=files.encode(),
                              capture_output=True, check=True).stdout
        # unique: two labs (the systemd one runs in the background) may build it at once
        tmp_target = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp_target.write_bytes(gzip.compress(cpio, compresslevel=1))
        tmp_target.replace(target)
    return target


def _job_script(cmd: str, env: dict[str, str] | None, cwd: Path, base_env: Mapping[str, str]) -> str:
    lines = ["set -u"]
    names = list(PASSED_ENV) + sorted(k for k in base_env if k.startswith(("LAB_", "MOE_")))
    for k in names:
        if k in base_env:
            lines.append(f"export {k}={shlex.quote(base_env[k])}")
    for k, v in (env or {}).items():
        lines.append(f"export {k}={shlex.quote(str(v))}")
    lines.append("export LAB_OUT=/lab-out NUMA_LAB=1")
    lines.append(f"cd {shlex.quote(str(cwd))} || exit 125")
    lines.append(f"/bin/sh -c {shlex.quote(cmd)}")
    return "\n".join(lines) + "\n"


def qemu_command(kimg: Path, initrd: Path, out_dir: Path, nodes: int, mem_gib: float, cpus: int,
                 systemd: bool, distances: Sequence[Sequence[int]] | None, accel: str) -> list[str]:
    """The qemu-system-x86_64 argv for a VM of ``nodes`` nodes (memory and CPUs split evenly)."""
    mem_mib = int(mem_gib * 1024)
    node_mib = mem_mib // nodes
    argv = ["qemu-system-x86_64", "-accel", accel, "-cpu", "max", "-smp", str(cpus), "-m", f"{node_mib * nodes}M"]
    for i in range(nodes):
        lo, hi = i * cpus // nodes, (i + 1) * cpus // nodes - 1
        argv += ["-object", f"memory-backend-ram,id=m{i},size={node_mib}M",
                 "-numa", f"node,nodeid={i},cpus={lo}-{hi},memdev=m{i}"]
    if distances is not None:
        for i in range(nodes):
            for j in range(nodes):
                if i != j:
                    argv += ["-numa", f"dist,src={i},dst={j},val={distances[i][j]}"]
    append = "console=ttyS0 quiet loglevel=1 panic=-1"
    if systemd:
        append += " moe_lab.systemd=1 systemd.show_status=0"
    argv += [
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={out_dir},mount_tag=labout,security_model=none,multidevs=remap",
        "-kernel", str(kimg), "-initrd", str(initrd), "-append", append,
        "-display", "none", "-serial", f"file:{out_dir}/.console", "-serial", "stdio",
        "-monitor", "none", "-no-reboot",
    ]
    return argv


_RUNNING: set[subprocess.Popen] = set()


@atexit.register
def _kill_running_vms() -> None:
    """A VM left running by an interrupted caller (e.g. a background lab thread when pytest
    exits early) is killed with the process, not left behind."""
    for proc in list(_RUNNING):
        proc.kill()


def run_in_vm(cmd: str, nodes: int = 4, mem_gib: float = 4, *, cpus: int | None = None, systemd: bool = False,
              timeout_s: float = 600, out_dir: Path | str | None = None,
              distances: Sequence[Sequence[int]] | None = None, env: dict[str, str] | None = None,
              cwd: Path | str | None = None, accel: str | None = None,
              base_env: Mapping[str, str] | None = None) -> tuple[int, str, Path]:
    """Boot a VM with ``nodes`` NUMA nodes and ``mem_gib`` GiB, run ``cmd`` there, power off.

    ``cpus``: vCPUs (default one per node; a multiple of ``nodes``). ``distances``: an
    N x N SLIT matrix (default QEMU's 10/20). ``systemd``: systemd is PID 1 and ``cmd`` runs as
    the oneshot unit moe-lab-job.service. ``out_dir``: host folder mounted at $LAB_OUT
    (default a fresh temporary folder). ``accel``: QEMU accelerator ($LAB_ACCEL or tcg). ``base_env``: the environment whose PASSED_ENV, LAB_* and MOE_*
    variables the command gets (default os.environ now; a caller in a background thread passes
    a snapshot, so that a test's monkeypatched variables do not leak into the VM).

    Returns (exit status, the command's stdout+stderr, out_dir). The status is the command's,
    124 on timeout, 125 when the VM could not run it; the kernel console is out_dir/.console.
    Raises RuntimeError when the lab is not available (see :func:`lab_available`).
    """
    ok, reason = lab_available()
    if not ok:
        raise RuntimeError(reason)
    if not 1 <= nodes <= 8:
        raise ValueError(f"nodes must be 1..8 (got {nodes})")
    cpus = cpus or nodes
    if cpus % nodes:
        raise ValueError(f"cpus ({cpus}) must be a multiple of nodes ({nodes})")
    if distances is not None and (len(distances) != nodes or any(len(r) != nodes for r in distances)):
        raise ValueError(f"distances must be a {nodes}x{nodes} matrix")
    kimg = kernel_image()
    initrd = build_initrd(kimg)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="moe-lab-out-", dir="/var/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    for name in (".rc", ".job", ".console"):
        (out / name).unlink(missing_ok=True)
    base_env = dict(os.environ if base_env is None else base_env)
    (out / ".job").write_text(_job_script(cmd, env, Path(cwd or os.getcwd()).resolve(), base_env))
    if systemd:
        (out / ".units").mkdir(exist_ok=True)
        for name, text in _UNITS.items():
            (out / ".units" / name).write_text(text)
    argv = qemu_command(kimg, initrd, out, nodes, mem_gib, cpus, systemd, distances,
                        accel or os.environ.get("LAB_ACCEL", "tcg"))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=base_env)
    _RUNNING.add(proc)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
        output = stdout.decode(errors="replace").replace("\r", "")
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        partial = (stdout or b"").decode(errors="replace").replace("\r", "")
        return RC_TIMEOUT, partial + f"\nmoe-lab: timed out after {timeout_s} s (console: {out}/.console)\n", out
    finally:
        _RUNNING.discard(proc)
    rc_file = out / ".rc"
    if not rc_file.exists() or not rc_file.read_text().strip():
        return RC_VM_FAILED, output + f"\nmoe-lab: the VM reported no exit status (console: {out}/.console)\n", out
    return int(rc_file.read_text().strip()), output, out


def lab_main(p, argv: list[str] | None, available, run) -> int:
    """The command line both labs share (this VM and tests/lab/container.py): ``p`` (an
    argparse parser with the lab's own options) gets --timeout, --out, --check and the command;
    --check prints ``available()``'s reason (exit 0 when ready, 1 when not); otherwise
    ``run(args, command line)`` -> (status, output, out folder) runs it, the output goes to
    stdout and the status is the exit status."""
    import argparse

    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out")
    p.add_argument("--check", action="store_true", help="say whether the lab can run here")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.check:
        ok, reason = available()
        print(reason)
        return 0 if ok else 1
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command given")
    t0 = time.monotonic()
    rc, output, out = run(a, " ".join(shlex.quote(c) for c in cmd))
    sys.stdout.write(output)
    print(f"moe-lab: exit {rc} after {time.monotonic() - t0:.1f} s; files in {out}", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run one command in a multi-node NUMA VM (see module docstring).")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--mem-gib", type=float, default=4)
    p.add_argument("--cpus", type=int)
    p.add_argument("--systemd", action="store_true")
    return lab_main(p, argv, lab_available,
                    lambda a, cmd: run_in_vm(cmd, a.nodes, a.mem_gib, cpus=a.cpus, systemd=a.systemd,
                                             timeout_s=a.timeout, out_dir=a.out))


if __name__ == "__main__":
    sys.exit(main())
