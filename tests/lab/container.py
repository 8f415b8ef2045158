"""A systemd container lab: run one command under a real systemd (PID 1) at native speed.

The QEMU lab (tests/lab/vm.py) emulates the CPU (TCG, 30-60x slower), which suits NUMA
placement and unit lifecycle checks but not serving a model: importing torch and loading
numba's kernels take minutes per process start there. The fleet lab (several service starts
and restarts behind HAProxy) runs here instead: this machine's own processes in private
namespaces, with systemd as their PID 1::

    unshare --mount                  a private mount namespace for the root below
      tmpfs + overlay                root = this machine's / (read-only lower layer) + a tmpfs
                                     upper layer: every path, Python and virtualenv is the same
                                     inside; writes vanish when the container stops
    systemd-nspawn --boot            systemd as PID 1 of a new PID namespace, private network
                                     (loopback only: ports cannot clash with the host's),
                                     /sys and /proc/sys read-only (the host's kernel settings
                                     cannot be changed from inside), the out folder bound at
                                     /lab-out, the given folders bound at their own paths
      moe-lab.target -> moe-lab-job.service (oneshot: the command, then poweroff)

Prerequisites (Debian, as root): ``apt-get install -y systemd-container`` (systemd-nspawn);
systemd itself, util-linux (unshare) and overlayfs are there on any Debian host. The kernel
is the host's: nothing here is about NUMA (use the VM for that).

Use from tests::

    from tests.lab.container import container_available, run_in_container
    ok, reason = container_available()
    rc, output, out_dir = run_in_container("python3 check.py", timeout_s=900, binds=[repo])

Inside, the command runs as root through ``/bin/sh -c`` in ``cwd``, with the environment
vm.py passes (PATH, HOME, VIRTUAL_ENV, PYTHONPATH, LANG, LAB_*, MOE_*, ``env``) and
``LAB_OUT=/lab-out NUMA_LAB=1 MOE_LAB_CONTAINER=1``. Exit status: the command's; 124 on
timeout; 125 when the container could not run it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.lab.vm import RC_TIMEOUT, RC_VM_FAILED, _job_script, lab_main

APT_PACKAGES = ("systemd-container",)
INSTALL_COMMAND = "apt-get install -y " + " ".join(APT_PACKAGES)
SYSTEMD = Path("/lib/systemd/systemd")

_UNITS = {
    "moe-lab.target": """[Unit]
Description=moe-service container lab
Requires=basic.target moe-lab-job.service
After=basic.target
AllowIsolate=yes
""",
    "moe-lab-job.service": """[Unit]
Description=moe-service container lab job
After=basic.target
[Service]
Type=oneshot
TimeoutStartSec=infinity
ExecStart=/bin/sh -c '/bin/sh /lab-out/.job > /lab-out/.output 2>&1; echo $? > /lab-out/.rc; sync'
ExecStopPost=/bin/systemctl poweroff --no-block
""",
}

# Runs in the private mount namespace: build the overlay root, install the lab units, hand
# over to systemd-nspawn (exec: the namespace, and with it the mounts, ends with it).
_LAUNCH = r"""set -eu
work=$1; shift
mount -t tmpfs -o size=8g,mode=0755 moe-lab-ct "$work"
mkdir -p "$work/upper" "$work/work" "$work/root"
mount -t overlay moe-lab-ct -o "lowerdir=/,upperdir=$work/upper,workdir=$work/work" "$work/root"
cp "$LAB_CT_OUT"/.units/* "$work/root/etc/systemd/system/"
nspawn=$1; shift
exec "$nspawn" -D "$work/root" "$@"
"""


def container_available() -> tuple[bool, str]:
    """(True, "ready") when a container lab can start here, else (False, what is missing)."""
    missing = []
    if os.geteuid() != 0:
        return False, "container lab needs root (mount namespaces, overlayfs, systemd-nspawn)"
    if not shutil.which("systemd-nspawn"):
        missing.append("systemd-nspawn")
    if not SYSTEMD.exists():
        missing.append(str(SYSTEMD))
    if not shutil.which("unshare"):
        missing.append("unshare (util-linux)")
    if missing:
        return False, f"container lab cannot run here: missing {', '.join(missing)} (install: {INSTALL_COMMAND})"
    filesystems = Path("/proc/filesystems").read_text() if Path("/proc/filesystems").exists() else ""
    if "overlay" not in filesystems:
        # The module loads on first mount on most kernels; try it once.
        subprocess.run(["modprobe", "overlay"], capture_output=True)
        if "overlay" not in Path("/proc/filesystems").read_text():
            return False, "container lab cannot run here: the kernel has no overlay file system"
    return True, "ready"


def nspawn_command(machine: str, out_dir: Path, binds: Sequence[Path], boot_args: Sequence[str]) -> list[str]:
    """The systemd-nspawn argv (the launcher inserts -D ROOT after the program name)."""
    argv = ["systemd-nspawn", "--quiet", "--register=no", f"--machine={machine}",
            "--private-network", "--console=passive", f"--bind={out_dir}:/lab-out",
            "--setenv=MOE_LAB_CONTAINER=1"]
    if not Path("/run/systemd/system").exists():
        # No systemd on the host (CI, build containers): no one to create a scope unit for the
        # container; it stays in the caller's cgroup. Under a host systemd nspawn makes a scope.
        argv.insert(3, "--keep-unit")
    for b in binds:
        # Folders on other file systems than / are not in the overlay's lower layer: bind them.
        argv.append(f"--bind-ro={b}")
    return argv + ["--boot", "--"] + list(boot_args)


def run_in_container(cmd: str, *, timeout_s: float = 600, out_dir: Path | str | None = None,
                     env: dict[str, str] | None = None, cwd: Path | str | None = None,
                     binds: Sequence[Path | str] = (), machine: str = "moe-lab",
                     base_env: Mapping[str, str] | None = None) -> tuple[int, str, Path]:
    """Boot systemd in a container over this machine's root, run ``cmd`` as a oneshot unit,
    power off.

    ``binds``: folders bound read-only at the same path (those on another file system than /,
    e.g. the checkout and the virtualenv, which the overlay does not show). ``out_dir``: host
    folder bound at $LAB_OUT=/lab-out (default a fresh folder under /var/tmp). ``base_env``:
    as in :func:`tests.lab.vm.run_in_vm`.

    Returns (exit status, the command's stdout+stderr, out_dir): the command's status, 124
    on timeout, 125 when the container could not run it (then the output says why).
    Raises RuntimeError when the container lab is not available (:func:`container_available`).
    """
    ok, reason = container_available()
    if not ok:
        raise RuntimeError(reason)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="moe-lab-ct-out-", dir="/var/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    for name in (".rc", ".job", ".output", ".nspawn.log"):
        (out / name).unlink(missing_ok=True)
    base_env = dict(os.environ if base_env is None else base_env)
    job = _job_script(cmd, dict(env or {}, MOE_LAB_CONTAINER="1"), Path(cwd or os.getcwd()).resolve(), base_env)
    # The command's own deadline, inside: it ends and the container powers off by itself.
    job = job.replace("\n/bin/sh -c ", f"\ntimeout --kill-after=20 {int(timeout_s)} /bin/sh -c ", 1)
    (out / ".job").write_text(job)
    (out / ".units").mkdir(exist_ok=True)
    for name, text in _UNITS.items():
        (out / ".units" / name).write_text(text)
    work = Path(tempfile.mkdtemp(prefix="moe-lab-ct-", dir="/var/tmp"))
    nspawn = nspawn_command(machine, out, [Path(b).resolve() for b in binds],
                            ["--unit=moe-lab.target", "systemd.show_status=0"])
    argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", _LAUNCH, "moe-lab-ct", str(work)]
    argv += nspawn
    log = open(out / ".nspawn.log", "wb")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(base_env, LAB_CT_OUT=str(out)), start_new_session=True)
    try:
        try:
            proc.wait(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            # SIGTERM: systemd-nspawn asks the container's systemd to power off; then SIGKILL.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return RC_TIMEOUT, _read(out / ".output") + f"\nmoe-lab: container timed out after {timeout_s} s\n", out
    finally:
        log.close()
        shutil.rmtree(work, ignore_errors=True)  # empty: its tmpfs lived in the namespace
    output = _read(out / ".output")
    rc_file = out / ".rc"
    if not rc_file.exists() or not rc_file.read_text().strip():
        return (RC_VM_FAILED, output + f"\nmoe-lab: the container reported no exit status (systemd-nspawn exit "
                f"{proc.returncode}): {_read(out / '.nspawn.log')[-2000:]}\n", out)
    return int(rc_file.read_text().strip()), output, out


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run one command under systemd in a container (module docstring).")
    p.add_argument("--bind", action="append", default=[])
    return lab_main(p, argv, container_available,
                    lambda a, cmd: run_in_container(cmd, timeout_s=a.timeout, out_dir=a.out, binds=a.bind))


if __name__ == "__main__":
    raise SystemExit(main())
