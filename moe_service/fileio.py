"""Reading model files with direct I/O, and what the page cache holds of them.

O_DIRECT (open(2)) reads go from the device into the caller's buffer by DMA, with no copy in
the page cache: a 300 GB model loaded this way leaves no second 300 GB copy behind to evict
everything else. The rules (open(2), "O_DIRECT"): the buffer address, the file offset and the
length must each be a multiple of the device's logical block size. :data:`DIRECT_ALIGN_BYTES`
(4096) satisfies every common device (512-byte and 4 KiB logical blocks). A read at the end
of the file may return fewer bytes (the file's last partial block).

:func:`read_span_direct` reads any byte range ``[file_offset, file_offset + nbytes)`` into any
place of the arena:

* where the destination address and the file offset have the same remainder modulo 4096
  (the layouts place extents that way, see :func:`moe_service.layout.dio_offset`), the
  aligned middle goes straight into the arena, and the unaligned head and tail (at most one
  partial block each) go through a small aligned bounce buffer, also with O_DIRECT;
* otherwise the aligned cover of the range is read into the bounce buffer piece by piece
  and copied into place (numpy copies release the GIL).

A filesystem may refuse O_DIRECT: at open (EINVAL: ramfs, tmpfs before Linux 6.6, some FUSE
and network filesystems) or at the first read (EINVAL). :func:`open_direct` returns None for
the first, :class:`DirectRefused` is raised for the second; the caller reads buffered then.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np

from moe_service.errors import ModelFileError
from moe_service.layout import align_up
from moe_service.sizes import MiB

DIRECT_ALIGN_BYTES = 4096
"""Alignment of address, offset and length of every O_DIRECT read made here."""

DIRECT_CALL_BYTES = 8 * MiB
"""Bytes one O_DIRECT read asks for. The block layer cuts it into requests of at most
max_sectors_kb (4096 on the test VM's virtio disk, often 128-1280 on NVMe) that are all in
flight together: the call itself is a thread's queue depth (2 requests here, 8-64 on NVMe),
so several outstanding reads per thread need no extra machinery.

Queue depth, measured (3.1 GB file, cold, a shared 2-core VM whose other tenants kept 5-9
cores' worth of load, so single figures vary by 2x; 3 rounds, GB/s):
O_DIRECT 2 threads x 8 MiB 1.14 / 1.34 / 2.21, 4 x 8 MiB 0.97 / 1.19 / 1.25, 8 x 4 MiB
1.19 / 1.28 / 1.85, 1 x 64 MiB 0.97 / 1.56 / 1.70, 4 x 2 MiB 1.17 / 1.18 / 1.58, each at
0.05-0.12 CPU cores; buffered 2 threads in the same rounds 0.32-0.36 at 0.26-0.29 cores.
Past 2-4 requests in flight this disk gives no more, whatever supplies the depth. So: plain
preadv threads, each read large. io_uring was not taken: the maintained Python binding
(liburing 2026.3.30, a Zig-built wheel) accepts only bytearray buffers, which are neither
4 KiB aligned (O_DIRECT into one is EINVAL) nor the arena, so every byte would need a copy,
and a large O_DIRECT preadv already has the depth io_uring would add."""


class DirectRefused(OSError):
    """The filesystem opened a file with O_DIRECT but refused an O_DIRECT read (EINVAL)."""


def open_direct(path: Path | str) -> int | None:
    """``os.open(path, O_RDONLY | O_DIRECT | O_CLOEXEC)``, or None when the filesystem refuses
    O_DIRECT (EINVAL). Other errors (missing file, permissions) raise OSError."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise


def direct_supported(path: Path | str) -> bool:
    """True when ``path`` can be opened with O_DIRECT and its first block read that way."""
    fd = open_direct(path)
    if fd is None:
        return False
    try:
        buf = mmap.mmap(-1, DIRECT_ALIGN_BYTES)
        try:
            os.preadv(fd, [buf], 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            buf.close()
        return True
    finally:
        os.close(fd)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """uint8 [align_up(nbytes, 4096)] over a fresh anonymous mapping (page aligned): a bounce
    buffer for O_DIRECT reads."""
    mm = mmap.mmap(-1, align_up(max(nbytes, 1), DIRECT_ALIGN_BYTES))
    return np.frombuffer(mm, dtype=np.uint8)


def _eof(path, offset: int, missing: int) -> ModelFileError:
    return ModelFileError(
        f"{path}: file ends at byte {offset} but {missing} more bytes were expected there "
        "(file truncated or changed while loading?)"
    )


def _preadv_direct(fd: int, buf, offset: int, path) -> int:
    try:
        return os.preadv(fd, [buf], offset)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectRefused(e.errno, f"{path}: O_DIRECT read at byte {offset} refused: {e.strerror}") from None
        raise


def _read_through(fd: int, dst: np.ndarray, dst_off: int, file_off: int, nbytes: int, bounce: np.ndarray,
                  path, on_read) -> int:
    """Read ``nbytes`` at ``file_off`` (any alignment) into ``dst[dst_off:]`` through ``bounce``."""
    A = DIRECT_ALIGN_BYTES
    bview = memoryview(bounce)
    calls, pos, end = 0, file_off, file_off + nbytes
    try:
        while pos < end:
            blk = pos - pos % A
            want_end = min(end, blk + len(bounce))
            ask = align_up(want_end, A) - blk
            got = _preadv_direct(fd, bview[:ask], blk, path)
            calls += 1
            usable = min(want_end, blk + got) - pos
            if usable <= 0:
                raise _eof(path, blk + got, end - pos)
            np.copyto(dst[dst_off + pos - file_off : dst_off + pos - file_off + usable],
                      bounce[pos - blk : pos - blk + usable])
            pos += usable
            if on_read is not None:
                on_read(usable)
    finally:
        bview.release()
    return calls


def read_span_direct(fd: int, arena: np.ndarray, view: memoryview, arena_offset: int, file_offset: int,
                     nbytes: int, bounce: np.ndarray, *, path, call_bytes: int = DIRECT_CALL_BYTES,
                     on_read=None) -> int:
    """Fill ``arena[arena_offset : arena_offset + nbytes]`` with the bytes of ``fd`` (opened
    with O_DIRECT) at ``file_offset``; ``view`` is ``memoryview(arena)``; ``bounce`` an aligned
    buffer from :func:`aligned_buffer` (a multiple of 4096, at least one block). Reads at
    most ``call_bytes`` (rounded down to 4096, at least 4096) per call. ``on_read(nbytes)``
    after each piece lands. Returns the number of read calls.

    Raises ModelFileError naming ``path`` when the file ends first, DirectRefused when the
    filesystem refuses an O_DIRECT read (nothing is half-done that a buffered re-read of the
    same span would not overwrite).
    """
    A = DIRECT_ALIGN_BYTES
    cap = max(A, call_bytes - call_bytes % A)
    addr = int(arena.__array_interface__["data"][0]) + arena_offset
    end = file_offset + nbytes
    lo, hi = align_up(file_offset, A), end - end % A
    if addr % A != file_offset % A or lo >= hi:
        return _read_through(fd, arena, arena_offset, file_offset, nbytes, bounce, path, on_read)
    calls = 0
    if lo > file_offset:  # the head: part of one block
        calls += _read_through(fd, arena, arena_offset, file_offset, lo - file_offset, bounce, path, on_read)
    pos = lo
    while pos < hi:
        n = min(cap, hi - pos)
        a = arena_offset + pos - file_offset
        got = _preadv_direct(fd, view[a : a + n], pos, path)
        calls += 1
        if got <= 0 or (got % A and pos + got < hi):
            raise _eof(path, pos + max(got, 0), end - pos - max(got, 0))
        pos += got
        if on_read is not None:
            on_read(got)
    if end > hi:  # the tail: part of one block
        calls += _read_through(fd, arena, arena_offset + hi - file_offset, hi, end - hi, bounce, path, on_read)
    return calls


# --- the page cache ---------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """/proc/meminfo as bytes (the kB fields times 1024; counts such as HugePages_Total as is)."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts:
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


_libc = None


def cached_fraction_sampled(path: Path | str, windows: int = 64, window_pages: int = 32) -> float:
    """Estimated fraction of ``path``'s pages in the page cache: mincore(2) over ``windows``
    runs of ``window_pages`` pages spread evenly over the file (64 calls: about a
    millisecond for a 600 GB file as for a small one). 1.0 for an empty file; 0.0 when the
    file cannot be mapped."""
    global _libc
    import ctypes

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    n_pages = -(-size // page)
    run = min(window_pages, n_pages)
    starts = np.unique(np.linspace(0, n_pages - run, num=min(windows, n_pages)).astype(np.int64))
    vec = np.zeros(run, dtype=np.uint8)
    hits = seen = 0
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            arr = np.frombuffer(mm, dtype=np.uint8)
            base = int(arr.__array_interface__["data"][0])
            try:
                for i in starts.tolist():
                    n = min(run, n_pages - i)
                    if _libc.mincore(ctypes.c_void_p(base + i * page), n * page, ctypes.c_void_p(vec.ctypes.data)) == 0:
                        hits += int(np.count_nonzero(vec[:n] & 1))
                        seen += n
            finally:
                del arr
    except (OSError, ValueError):
        return 0.0
    return hits / seen if seen else 0.0
