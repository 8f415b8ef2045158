"""Anonymous memory for the weights: reserve, advise, populate, read into, release.

Thin ctypes wrappers over the Linux calls fastload and replication need (x86-64 numbers):
madvise(2) with MADV_HUGEPAGE (14), MADV_NOHUGEPAGE (15), MADV_POPULATE_WRITE (23, Linux
5.14+) and MADV_DONTNEED (4). ctypes releases the GIL around foreign calls, so a populate of
64 MiB running in one Python thread does not stop the others; ``os.preadv`` releases it too.

The arena is ONE private anonymous mapping (never a mapping of the model file: file-backed
pages of a GGUF on ext4/xfs get no transparent huge pages and stay shared with the page
cache), aligned to 2 MiB so that every 2 MiB-aligned region can be backed by huge pages.
With hugetlb pages (``hugetlb_page_bytes``) it is mapped with MAP_HUGETLB | MAP_HUGE_2MB or
MAP_HUGE_1GB (mmap(2): log2 of the page size << MAP_HUGE_SHIFT 26); the kernel aligns such a
mapping to its page size and reserves its pages from the pools when it is mapped.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np

from moe_service.errors import CapacityError, ModelFileError
from moe_service.layout import REGION_ALIGN_BYTES, align_up
from moe_service.sizes import gib_text

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_WRITE = 23

MAP_HUGETLB = 0x40000
MAP_HUGE_SHIFT = 26
MAP_HUGE_2MB = 21 << MAP_HUGE_SHIFT
MAP_HUGE_1GB = 30 << MAP_HUGE_SHIFT

SHORTAGE_ERRNOS = (errno.ENOMEM, errno.EFAULT, getattr(errno, "EHWPOISON", 133))
"""errno values of a populate that found no memory (ENOMEM; EFAULT: a hugetlb pool was empty,
the fault's SIGBUS turned into an error; EHWPOISON: a poisoned page): capacity, not a retry."""

PREAD_MAX_BYTES = 0x7FFFF000
"""Linux moves at most this many bytes in one read/pread/preadv call (MAX_RW_COUNT)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(address: int, nbytes: int, advice: int) -> None:
    """madvise(2) on ``[address, address + nbytes)`` (page aligned). The GIL is released
    during the call. Raises OSError with the errno on failure."""
    if _libc.madvise(address, nbytes, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({address:#x}, {nbytes}, {advice}): {os.strerror(err)}")


def populate_write_supported() -> bool:
    """True when the kernel knows MADV_POPULATE_WRITE (probe: ``madvise(0, 0, 23)``, which
    answers 0 when it is known and EINVAL when not)."""
    try:
        madvise(0, 0, MADV_POPULATE_WRITE)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True


def populate_write(address: int, nbytes: int) -> None:
    """Fault in ``[address, address + nbytes)`` (page aligned) for writing, under the range's
    memory policy: madvise(MADV_POPULATE_WRITE), repeated on EINTR/EAGAIN. Works on THP and
    hugetlb mappings. Raises OSError with the errno (see :data:`SHORTAGE_ERRNOS`)."""
    while True:
        try:
            madvise(address, nbytes, MADV_POPULATE_WRITE)
            return
        except OSError as e:
            if e.errno not in (errno.EINTR, errno.EAGAIN):
                raise


def hugetlb_mmap_flags(page_bytes: int) -> int:
    """mmap flags for hugetlb pages of ``page_bytes``: MAP_HUGETLB | log2(page_bytes) << 26
    (MAP_HUGE_2MB for 2 MiB, MAP_HUGE_1GB for 1 GiB). Raises ValueError for a size that is
    not a power of two of at least 64 KiB."""
    shift = page_bytes.bit_length() - 1
    if page_bytes < 65536 or page_bytes != 1 << shift:
        raise ValueError(f"hugetlb page size must be a power of two >= 64 KiB (got {page_bytes})")
    return MAP_HUGETLB | (shift << MAP_HUGE_SHIFT)


def address_of(arr: np.ndarray) -> int:
    """Virtual address of ``arr``'s first byte."""
    return int(arr.__array_interface__["data"][0])


def reserve_arena(nbytes: int, align: int = REGION_ALIGN_BYTES, *,
                  hugetlb_page_bytes: int | None = None) -> np.ndarray:
    """Reserve ``nbytes`` of private anonymous memory starting on an ``align`` boundary.

    Returns uint8 [nbytes] over the mapping (MAP_PRIVATE | MAP_ANONYMOUS, read/write). No
    page is touched: pages appear at first touch or populate, under whatever memory policy
    is set on the range by then. The mapping is ``align`` bytes larger than asked so that
    the start can be aligned; the slack is never touched.

    ``hugetlb_page_bytes`` (2 MiB or 1 GiB): map hugetlb pages instead (MAP_HUGETLB with the
    size flag); ``nbytes`` must then be a multiple of the page size, and the kernel reserves
    that many pages from the pools now (the node each comes from is decided at first touch).

    Raises CapacityError when the kernel refuses the address space (overcommit limits) or,
    with hugetlb, when the pools hold fewer free pages than the mapping needs.
    """
    if nbytes <= 0:
        raise ValueError(f"arena size must be positive (got {nbytes})")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    slack = align
    if hugetlb_page_bytes:
        if nbytes % hugetlb_page_bytes:
            raise ValueError(f"a hugetlb arena must be a multiple of its {hugetlb_page_bytes}-byte pages "
                             f"(got {nbytes} bytes)")
        flags |= hugetlb_mmap_flags(hugetlb_page_bytes)
        slack = 0  # hugetlb mappings start on a page boundary, and slack would take pool pages
    try:
        mm = mmap.mmap(-1, nbytes + slack, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        if hugetlb_page_bytes:
            kib = hugetlb_page_bytes // 1024
            raise CapacityError(
                f"cannot map {nbytes // hugetlb_page_bytes} hugetlb pages of {kib} kB ({gib_text(nbytes, 1)}) "
                f"for the arena: {os.strerror(e.errno or 0)}; the pools hold fewer free pages than that "
                f"(/sys/devices/system/node/node*/hugepages/hugepages-{kib}kB/free_hugepages)"
            ) from None
        raise CapacityError(
            f"cannot reserve {nbytes} bytes ({gib_text(nbytes, 1)}) of anonymous memory for the "
            f"arena: {os.strerror(e.errno or 0)} (see /proc/sys/vm/overcommit_memory)"
        ) from None
    probe = np.frombuffer(mm, dtype=np.uint8, count=1)
    base = address_of(probe)
    del probe
    skew = align_up(base, align) - base if slack else 0
    if skew + nbytes > len(mm):
        raise CapacityError(f"the kernel placed the arena at {base:#x}, not on a {align}-byte boundary")
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=skew)


def reserve_thp_arena(nbytes: int) -> np.ndarray:
    """:func:`reserve_arena` with MADV_HUGEPAGE over it: uint8 [nbytes], zero, 2 MiB aligned,
    backed by transparent huge pages where the kernel has them. In THP "madvise" mode (the
    common default) plain allocations get 4 KiB pages, and streaming GBs of weights through
    them costs TLB misses (measured: 4-layer Qwen3-30B-A3B-shaped Q8_0 decode 70 -> 104
    tok/s on 2 cores). A kernel without THP (EINVAL) gives 4 KiB pages; other errors raise
    OSError. Raises CapacityError as reserve_arena."""
    arena = reserve_arena(nbytes)
    try:
        madvise(address_of(arena), align_up(arena.nbytes, mmap.PAGESIZE), MADV_HUGEPAGE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return arena


def free_arena(arena: np.ndarray) -> None:
    """Give an arena's memory back now: MADV_DONTNEED over it (RSS drops at once; any view
    still held reads zeros afterwards, never faults), then unmap it when no other view
    of it is alive (otherwise the mapping goes when the last view is garbage collected).
    hugetlb pages go back to their node's pool (MADV_DONTNEED on hugetlb needs Linux 5.18;
    before that they return when the mapping goes)."""
    try:
        madvise(address_of(arena), align_up(arena.nbytes, mmap.PAGESIZE), MADV_DONTNEED)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    mm = arena.base.obj if isinstance(arena.base, memoryview) else None
    del arena
    if isinstance(mm, mmap.mmap):
        try:
            mm.close()
        except BufferError:
            pass


def pread_full(
    fd: int,
    view: memoryview,
    offset: int,
    *,
    path: Path | str,
    max_call_bytes: int = PREAD_MAX_BYTES,
    on_read=None,
) -> int:
    """Fill ``view`` (a writable byte memoryview) with the bytes of ``fd`` at ``offset``.

    Loops: one preadv moves at most ``min(max_call_bytes, 0x7ffff000)`` bytes and reads may
    be short. ``on_read(nbytes)`` is called after each call. Returns the number of calls.
    Raises ModelFileError naming ``path`` and the offset when the file ends first.
    """
    cap = min(max_call_bytes, PREAD_MAX_BYTES)
    got, n, calls = 0, len(view), 0
    while got < n:
        step = os.preadv(fd, [view[got : got + min(cap, n - got)]], offset + got)
        calls += 1
        if step == 0:
            raise ModelFileError(
                f"{path}: file ends at byte {offset + got} but {n - got} more bytes were expected there "
                "(file truncated or changed while loading?)"
            )
        got += step
        if on_read is not None:
            on_read(step)
    return calls


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which cgroups and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def anon_huge_bytes() -> int:
    """This process's anonymous memory backed by transparent huge pages (AnonHugePages of
    /proc/self/smaps_rollup), in bytes."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def thp_mode() -> str:
    """The bracketed value of /sys/kernel/mm/transparent_hugepage/enabled ('always',
    'madvise', 'never'), or 'unavailable'."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes: resident now and its peak."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out.get("VmRSS", 0), out.get("VmHWM", 0)
