"""Probe the sandbox of moe-service's unit from inside it; print one JSON object.

Runs as ExecStart= of a copy of units/moe-service.service (same user, same sandbox, same
SystemCallFilter=; only Type= and ExecStart= differ), under systemd in the numa-lab VM, with
the system Python and the standard library only. For each operation the service's
placement code needs it records the return value and errno:

  get_mempolicy / set_mempolicy   policy of the thread           (x86-64 nr 239 / 238)
  mbind + first touch + move_pages  2 pages bound to the last node, then queried (237 / 279)
  migrate_pages                   own pages, node 0 -> last node  (256)
  sched_setaffinity               pin to the first allowed CPU    (203)

and, as controls that show the sandbox is in force: fchown of its own file (in @privileged,
which the unit denies: expected EPERM), a write under /etc (ProtectSystem=strict: expected
EROFS), listing /home (ProtectHome=yes: expected EACCES), the Seccomp mode from
/proc/self/status (2 = filter) and RLIMIT_MEMLOCK (LimitMEMLOCK=infinity).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import resource

SYS_MBIND = 237
SYS_SET_MEMPOLICY = 238
SYS_GET_MEMPOLICY = 239
SYS_MIGRATE_PAGES = 256
SYS_MOVE_PAGES = 279
MPOL_DEFAULT = 0
MPOL_BIND = 2
MPOL_MF_STRICT = 1
PAGE_BYTES = mmap.PAGESIZE

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def call(nr: int, *args) -> dict:
    """One raw syscall: {"ret": return value, "errno": errno name or None}."""
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(nr), *args)
    err = ctypes.get_errno() if ret == -1 else 0
    return {"ret": int(ret), "errno": os.strerror(err) if err else None, "errno_name": _errname(err)}


def _errname(err: int) -> str | None:
    import errno as errno_mod

    return errno_mod.errorcode.get(err) if err else None


def nodes_online() -> list[int]:
    """Node numbers from /sys/devices/system/node/online, e.g. "0-1" -> [0, 1]."""
    text = open("/sys/devices/system/node/online").read().strip()
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> None:
    result: dict[str, object] = {"uid": os.getuid(), "user": os.environ.get("USER")}
    nodes = nodes_online()
    target = nodes[-1]
    result["nodes"] = nodes
    maxnode = 64
    mask = (ctypes.c_ulong * 1)(1 << target)

    mode = ctypes.c_int(-1)
    result["get_mempolicy"] = call(SYS_GET_MEMPOLICY, ctypes.byref(mode), None, ctypes.c_ulong(0),
                                   None, ctypes.c_ulong(0))
    result["get_mempolicy"]["mode"] = mode.value
    result["set_mempolicy"] = call(SYS_SET_MEMPOLICY, ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0))

    # Two anonymous pages bound to the last node before first touch, then queried.
    n_pages = 2
    buf = mmap.mmap(-1, n_pages * PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    result["mbind"] = call(SYS_MBIND, ctypes.c_void_p(addr), ctypes.c_ulong(n_pages * PAGE_BYTES),
                           ctypes.c_int(MPOL_BIND), mask, ctypes.c_ulong(maxnode), ctypes.c_uint(MPOL_MF_STRICT))
    for i in range(n_pages):
        buf[i * PAGE_BYTES] = 1
    pages = (ctypes.c_void_p * n_pages)(*[addr + i * PAGE_BYTES for i in range(n_pages)])
    status = (ctypes.c_int * n_pages)(*([-1] * n_pages))
    result["move_pages"] = call(SYS_MOVE_PAGES, ctypes.c_int(0), ctypes.c_ulong(n_pages), pages, None, status,
                                ctypes.c_int(0))
    result["move_pages"]["page_nodes"] = list(status)
    result["mbind"]["target_node"] = target

    old_mask = (ctypes.c_ulong * 1)(1 << nodes[0])
    result["migrate_pages"] = call(SYS_MIGRATE_PAGES, ctypes.c_int(os.getpid()), ctypes.c_ulong(maxnode),
                                   old_mask, mask)
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        result["sched_setaffinity"] = {"ret": 0, "errno": None, "errno_name": None, "cpu": cpu}
    except OSError as exc:
        result["sched_setaffinity"] = {"ret": -1, "errno": exc.strerror, "errno_name": _errname(exc.errno or 0)}

    # Controls: the sandbox must be in force for the results above to mean anything.
    cache = os.environ.get("CACHE_DIRECTORY", "")
    result["cache_directory"] = cache
    try:
        path = os.path.join(cache, "probe.txt")
        with open(path, "w") as f:
            f.write("ok")
            result["cache_write"] = {"ret": 0, "errno_name": None}
            try:
                os.fchown(f.fileno(), os.getuid(), os.getgid())
                result["fchown"] = {"ret": 0, "errno_name": None}
            except OSError as exc:
                result["fchown"] = {"ret": -1, "errno_name": _errname(exc.errno or 0)}
    except OSError as exc:
        result["cache_write"] = {"ret": -1, "errno_name": _errname(exc.errno or 0)}
    try:
        with open("/etc/moe-service-probe", "w") as f:
            f.write("x")
        result["etc_write"] = {"ret": 0, "errno_name": None}
    except OSError as exc:
        result["etc_write"] = {"ret": -1, "errno_name": _errname(exc.errno or 0)}
    try:
        result["home_listing"] = {"ret": 0, "entries": sorted(os.listdir("/home"))}
    except OSError as exc:
        result["home_listing"] = {"ret": -1, "errno_name": _errname(exc.errno or 0)}
    result["root_visible"] = os.path.exists("/root/.pyenv")
    for line in open("/proc/self/status"):
        if line.startswith(("Seccomp:", "NoNewPrivs:", "CapEff:")):
            key, _, value = line.partition(":")
            result[key.strip().lower()] = value.strip()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    result["memlock_infinite"] = soft == resource.RLIM_INFINITY and hard == resource.RLIM_INFINITY
    print("PROBE " + json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
