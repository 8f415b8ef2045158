"""The prefix cache's disk tier: blocks evicted from host memory, and the blocks still in
memory at shutdown, kept in files so that a hit reads them back and a restart finds them.

::

    PrefixCache (engine/prefix.py)
      evicts a block  --spill-->   writer thread: temp file, fsync, rename  (bounded queue)
      misses a block  --get---->   read the file, check its checksum, hand back its arrays
      SIGTERM, after the drain --save(deadline)--> the blocks still in memory, most recently
                                   used first (a chain's parents before its children), as many
                                   as fit before the deadline
    start  --PrefixStore(...)-->   index the directory: every block whose header is whole and
                                   names this store's identity, oldest use first

Layout: ``<serve.prefix_cache_dir>/<namespace>/<block key hex>.blk``. The namespace is a
digest of the store's identity (:func:`store_identity`: the model file's size, mtime and a
digest of its first MiB, engine.kv_type, the context, tokens per block, bytes per token, the
package version and a digest of the engine's source files), written beside the blocks in
``identity.json``. Anything that changes the KV values changes the namespace, so a block of
another model, setting or version is never found; the other namespaces are removed at start
(their blocks can never be used again and would hold disk space).

One file per block (format ``FORMAT_VERSION``), little-endian::

    0   8 bytes  magic b"MOEPFXB1"
    8   u32      header length H           12  u32  CRC-32 of the header
    16  u64      payload length P          24  u32  CRC-32 of the payload   28  u32  0
    32  H bytes  header, JSON: namespace, key, parent (hex or null), tokens, arrays
                 [{name, dtype, shape, offset, nbytes}]
    32+H P bytes payload: the arrays' bytes, each at a 64-byte aligned offset

A block's payload is a set of named arrays (``{"kv": uint8 rows}`` today; a model's
per-sequence state snapshots are more names in the same dict), so adding state needs no new
format. A file is written to a temporary name, fsynced and renamed: a reader never sees a
half-written block, and a stop that runs out of time leaves only a temporary file, removed
at the next start. A file whose size, magic, header checksum, namespace or key does not match
is skipped with a log line (``prefix_store_skipped``) and removed; a payload whose checksum
fails is found when it is read, skipped and removed the same way. Never a crash: every disk
error becomes a log line and a miss. Files are created 0600, directories 0700, whatever the
umask.

The size bound (serve.prefix_cache_disk_gib) evicts the least recently used blocks first
(a hit refreshes a file's mtime, which orders the index at the next start).

Thread safety: the engine thread calls :meth:`get`, :meth:`has`, :meth:`spill` and (after
it stopped) :meth:`save`; the writer thread writes spills. One lock guards the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from moe_service.log import get_logger
from moe_service.paths import cache_dir, fsync_dir

log = get_logger(__name__)

FORMAT_VERSION = 1
MAGIC = b"MOEPFXB1"
_PREFIX = struct.Struct("<8sIIQII")
PREFIX_BYTES = _PREFIX.size  # 32
ALIGN = 64
SUFFIX = ".blk"
KEY_BYTES = 16
_NAMESPACE_RE = re.compile(r"^[0-9a-f]{32}$")
_MAX_HEADER_BYTES = 1 << 20
MODEL_HEAD_BYTES = 1 << 20
"""Bytes at the start of the model file that go into its identity digest (the GGUF header,
metadata and the start of the tensor table)."""

Arrays = Mapping[str, np.ndarray]


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a block of ``tokens`` whose chain's previous block has key ``parent``
    (None for the first): 16 bytes of BLAKE2b over the parent key and the tokens (int64 LE).
    Stable across processes (unlike Python's hash of a tuple), so the same prompt finds the same
    files after a restart."""
    h = hashlib.blake2b(parent if parent is not None else b"", digest_size=KEY_BYTES)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


@lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """A digest of the engine's source files (moe_service/engine/**.py, sorted by path): any
    change to the code that computes KV values gives another store namespace."""
    root = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def model_identity(path: Path | str) -> dict:
    """The model file's identity: size, mtime (ns) and a BLAKE2b digest of its first MiB.
    Raises OSError when it cannot be read."""
    p = Path(path)
    st = p.stat()
    with open(p, "rb") as f:
        head = f.read(MODEL_HEAD_BYTES)
    return {"name": p.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_blake2b": hashlib.blake2b(head, digest_size=16).hexdigest()}


def store_identity(*, model_path: Path | str, kv_type: str, n_ctx: int, block_tokens: int, token_bytes: int,
                   arch: str = "") -> dict:
    """Everything that changes the KV values a block holds (module docstring). Raises OSError
    when the model file cannot be read."""
    from moe_service import __version__

    return {"format": FORMAT_VERSION, "model": model_identity(model_path), "arch": arch, "kv_type": kv_type,
            "n_ctx": int(n_ctx), "block_tokens": int(block_tokens), "token_bytes": int(token_bytes),
            "version": __version__, "engine": engine_fingerprint()}


def namespace_of(identity: dict) -> str:
    """32 hex digits naming the store directory of ``identity``."""
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()


def resolve_store_dir(value: str) -> Path | None:
    """serve.prefix_cache_dir as a path: "" -> None (off); relative -> under the service's cache
    directory (the unit's CacheDirectory=, $CACHE_DIRECTORY; moe_service.paths.cache_dir);
    absolute -> as given."""
    if not value:
        return None
    p = Path(value).expanduser()
    return p if p.is_absolute() else cache_dir() / p


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class _Entry:
    path: Path
    parent: bytes | None
    tokens: tuple[int, ...]
    nbytes: int


class _Invalid(Exception):
    """A block file that must not be loaded (the message says why)."""


def _layout(arrays: Arrays) -> tuple[list[dict], int]:
    specs, offset = [], 0
    for name, a in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"prefix store: array names must be non-empty strings (got {name!r})")
        a = np.asarray(a)
        specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                      "nbytes": int(a.nbytes)})
        offset = _aligned(offset + int(a.nbytes))
    return specs, offset


def _read_header(f, size: int, namespace: str, name: str) -> dict:
    raw = f.read(PREFIX_BYTES)
    if len(raw) < PREFIX_BYTES:
        raise _Invalid(f"truncated: {size} bytes, shorter than the {PREFIX_BYTES}-byte prefix")
    magic, hlen, hcrc, plen, pcrc, _ = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise _Invalid("foreign: not a prefix-cache block (magic)")
    if hlen > _MAX_HEADER_BYTES:
        raise _Invalid(f"foreign or torn: header length {hlen}")
    if size != PREFIX_BYTES + hlen + plen:
        raise _Invalid(f"truncated or torn: {size} bytes, its header says {PREFIX_BYTES + hlen + plen}")
    hraw = f.read(hlen)
    if len(hraw) != hlen or zlib.crc32(hraw) != hcrc:
        raise _Invalid("torn: header checksum mismatch")
    try:
        header = json.loads(hraw)
    except ValueError:
        raise _Invalid("torn: header is not JSON") from None
    if header.get("format") != FORMAT_VERSION or header.get("namespace") != namespace:
        raise _Invalid(f"foreign: written for store {header.get('namespace')!r} format {header.get('format')!r}")
    if header.get("key") != name:
        raise _Invalid(f"foreign: its header names block {header.get('key')!r}")
    if header.get("payload_bytes") != plen or header.get("payload_crc32") != pcrc:
        raise _Invalid("torn: payload length or checksum differs from the header's")
    return header


class PrefixStore:
    """Blocks of the prefix cache in ``root``/<namespace> (module docstring), at most
    ``capacity_bytes`` of files. ``identity``: :func:`store_identity`. ``max_pending_bytes``:
    spills waiting for the writer thread beyond which new spills are dropped (the disk is
    slower than the evictions). Creating it indexes the directory (and removes other
    namespaces and leftovers). Raises OSError when ``root`` cannot be created."""

    def __init__(self, root: Path | str, identity: dict, capacity_bytes: int, *,
                 max_pending_bytes: int = 512 << 20):
        self.root = Path(root)
        self.identity = identity
        self.namespace = namespace_of(identity)
        self.dir = self.root / self.namespace
        self.capacity_bytes = int(capacity_bytes)
        self.max_pending_bytes = int(max_pending_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, tuple[bytes | None, tuple[int, ...], Arrays, int]] = {}
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._stopping = threading.Event()
        self.bytes_used = 0
        self.written = self.loaded = self.skipped = self.evicted = self.dropped = 0
        self._write_bps = 200e6  # measured as files are written; first guess for save()'s deadline
        self._make_dirs()
        self._drop_other_namespaces()
        self.scan()

    # -- directory ---------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        for d in (self.root, self.dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        ident = self.dir / "identity.json"
        if not ident.exists():
            tmp = self.dir / f".identity.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.identity, f, indent=1, sort_keys=True)
            os.replace(tmp, ident)

    def _drop_other_namespaces(self) -> None:
        for p in self.root.iterdir():
            if p.is_dir() and _NAMESPACE_RE.match(p.name) and p.name != self.namespace:
                log.info("prefix_store_removed_namespace", dir=str(p), bytes=dir_bytes(p),
                         reason="written for another model, KV setting or engine version: never used")
                shutil.rmtree(p, ignore_errors=True)

    def _skip(self, path: Path, reason: str) -> None:
        self.skipped += 1
        log.warning("prefix_store_skipped", file=str(path), reason=reason)
        try:
            path.unlink()
        except OSError:
            pass

    def scan(self) -> int:
        """Index the namespace's block files, oldest mtime first, checking each one's prefix
        and header (the payload's checksum is checked when it is read); remove temporary
        leftovers and files that fail. Returns the blocks indexed."""
        found = []
        with os.scandir(self.dir) as it:
            for de in it:
                path = Path(de.path)
                if de.name.endswith(".tmp"):
                    log.info("prefix_store_removed_partial", file=de.name, reason="a write that did not finish")
                    path.unlink(missing_ok=True)
                    continue
                if not de.name.endswith(SUFFIX) or not de.is_file(follow_symlinks=False):
                    continue
                name = de.name[:-len(SUFFIX)]
                try:
                    st = de.stat(follow_symlinks=False)
                    with open(path, "rb") as f:
                        header = _read_header(f, st.st_size, self.namespace, name)
                    parent = bytes.fromhex(header["parent"]) if header.get("parent") else None
                    entry = _Entry(path, parent, tuple(int(t) for t in header["tokens"]), st.st_size)
                    found.append((st.st_mtime_ns, bytes.fromhex(name), entry))
                except (_Invalid, OSError, ValueError, KeyError, TypeError) as e:
                    self._skip(path, str(e))
        found.sort(key=lambda x: x[0])
        with self._lock:
            self._index.clear()
            self.bytes_used = 0
            for _, key, entry in found:
                self._index[key] = entry
                self.bytes_used += entry.nbytes
            self._make_room(0)
        log.info("prefix_store_indexed", dir=str(self.dir), blocks=len(self._index), bytes=self.bytes_used,
                 capacity_bytes=self.capacity_bytes, skipped=self.skipped)
        return len(self._index)

    # -- lookups -----------------------------------------------------------------------------

    def has(self, key: bytes) -> bool:
        """The block is on disk or waiting to be written."""
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        return len(self._index)

    def get(self, key: bytes, tokens: Sequence[int]) -> dict[str, np.ndarray] | None:
        """The arrays of block ``key`` holding ``tokens``, or None (not stored, other tokens, or
        a file that fails its checks: skipped, removed and logged)."""
        tokens = tuple(tokens)
        with self._lock:
            pend = self._pending.get(key)
            if pend is not None:
                return dict(pend[2]) if pend[1] == tokens else None
            entry = self._index.get(key)
            if entry is None or entry.tokens != tokens:
                return None
            self._index.move_to_end(key)
        try:
            arrays = self._read(entry.path, key.hex())
        except (_Invalid, OSError, ValueError, KeyError, TypeError) as e:
            with self._lock:
                if self._index.get(key) is entry:
                    del self._index[key]
                    self.bytes_used -= entry.nbytes
            self._skip(entry.path, str(e))
            return None
        try:
            os.utime(entry.path)  # its recency survives a restart
        except OSError:
            pass
        self.loaded += 1
        return arrays

    def _read(self, path: Path, name: str) -> dict[str, np.ndarray]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header = _read_header(f, size, self.namespace, name)
            plen = header["payload_bytes"]
            buf = bytearray(plen)
            if f.readinto(buf) != plen:
                raise _Invalid("truncated: payload shorter than its header says")
        if zlib.crc32(buf) != header["payload_crc32"]:
            raise _Invalid("torn or corrupted: payload checksum mismatch")
        out = {}
        for spec in header["arrays"]:
            dt = np.dtype(spec["dtype"])
            count = int(np.prod(spec["shape"], dtype=np.int64)) if spec["shape"] else 1
            if count * dt.itemsize != spec["nbytes"] or spec["offset"] + spec["nbytes"] > plen:
                raise _Invalid(f"torn: array {spec['name']!r} does not fit its payload")
            out[spec["name"]] = np.frombuffer(buf, dt, count, spec["offset"]).reshape(spec["shape"])
        return out

    # -- writing -----------------------------------------------------------------------------

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used files until ``nbytes`` more fit (lock held)."""
        while self._index and self.bytes_used + nbytes > self.capacity_bytes:
            _, entry = self._index.popitem(last=False)
            self.bytes_used -= entry.nbytes
            self.evicted += 1
            try:
                entry.path.unlink()
            except OSError as e:
                log.warning("prefix_store_unlink_failed", file=str(entry.path), error=str(e))

    def write(self, key: bytes, parent: bytes | None, tokens: Sequence[int], arrays: Arrays, *,
              mtime_ns: int | None = None) -> bool:
        """Write one block now (temp file, fsync, rename); True when it is on disk. False when it
        is larger than the whole capacity or the disk refused (logged)."""
        specs, plen = _layout(arrays)
        tokens = tuple(int(t) for t in tokens)
        crc = 0
        pieces: list[memoryview | bytes] = []
        pos = 0
        for spec, a in zip(specs, arrays.values(), strict=True):
            if spec["offset"] > pos:
                pad = bytes(spec["offset"] - pos)
                pieces.append(pad)
                crc = zlib.crc32(pad, crc)
            mv = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data).cast("B")
            pieces.append(mv)
            crc = zlib.crc32(mv, crc)
            pos = spec["offset"] + spec["nbytes"]
        if plen > pos:
            pad = bytes(plen - pos)
            pieces.append(pad)
            crc = zlib.crc32(pad, crc)
        header = json.dumps({"format": FORMAT_VERSION, "namespace": self.namespace, "key": key.hex(),
                             "parent": parent.hex() if parent is not None else None, "tokens": list(tokens),
                             "arrays": specs, "payload_bytes": plen, "payload_crc32": crc}).encode()
        size = PREFIX_BYTES + len(header) + plen
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._index:
                return True
            self._make_room(size)
        final = self.dir / f"{key.hex()}{SUFFIX}"
        tmp = self.dir / f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        t0 = time.monotonic()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(_PREFIX.pack(MAGIC, len(header), zlib.crc32(header), plen, crc, 0))
                    f.write(header)
                    for piece in pieces:
                        f.write(piece)
                os.fsync(fd)
            finally:
                os.close(fd)
            if mtime_ns is not None:
                os.utime(tmp, ns=(mtime_ns, mtime_ns))
            os.rename(tmp, final)
        except OSError as e:
            log.warning("prefix_store_write_failed", file=str(final), error=str(e))
            tmp.unlink(missing_ok=True)
            return False
        dt = time.monotonic() - t0
        if dt > 0:
            self._write_bps = 0.7 * self._write_bps + 0.3 * (size / dt)
        with self._lock:
            self._index[key] = _Entry(final, parent, tokens, size)
            self.bytes_used += size
            self._make_room(0)
        self.written += 1
        return True

    def spill(self, key: bytes, parent: bytes | None, tokens: Sequence[int], arrays: Arrays) -> bool:
        """Queue a block evicted from memory for the writer thread (returns at once). False
        when it is already stored or queued, or the queue holds max_pending_bytes (dropped)."""
        nbytes = sum(int(np.asarray(a).nbytes) for a in arrays.values())
        with self._lock:
            if key in self._index or key in self._pending or self._stopping.is_set():
                return False
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped += 1
                return False
            self._pending[key] = (parent, tuple(tokens), arrays, nbytes)
            self._pending_bytes += nbytes
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-store-writer", daemon=True)
            self._writer.start()
        self._queue.put(key)
        return True

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                item = self._pending.get(key)
            if item is None:
                continue
            parent, tokens, arrays, _ = item
            try:
                self.write(key, parent, tokens, arrays)
            except Exception as e:  # never take the engine down for its disk tier
                log.warning("prefix_store_write_failed", key=key.hex(), error=f"{type(e).__name__}: {e}")
            with self._lock:
                if self._pending.pop(key, None) is not None:
                    self._pending_bytes -= item[3]

    def _stop_writer(self, timeout_s: float) -> None:
        self._stopping.set()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=max(0.0, timeout_s))

    def save(self, blocks: Iterable[tuple[bytes, bytes | None, Sequence[int], Arrays]], deadline_s: float) -> dict:
        """At shutdown: stop the writer (it finishes the file it writes), then write ``blocks``
        (key, parent key, tokens, arrays; most valuable first: parents before children) that
        are not stored yet, then the spills still queued, each only while it can finish before
        ``deadline_s`` (time.monotonic(); estimated from the measured write speed). What does
        not fit is left out, never half-written. Files get decreasing mtimes in this order so
        that the next start indexes the first ones as the most recently used. Returns written,
        already (stored before), left_out, seconds."""
        t0 = time.monotonic()
        self._stop_writer(deadline_s - t0)
        with self._lock:
            queued = [(k, p[0], p[1], p[2]) for k, p in self._pending.items()]
        written = already = left_out = 0
        now_ns = time.time_ns()
        for key, parent, tokens, arrays in [*blocks, *queued]:
            if self.has(key) and key not in self._pending:
                already += 1
                continue
            nbytes = sum(int(np.asarray(a).nbytes) for a in arrays.values())
            if time.monotonic() + nbytes / max(self._write_bps, 1e6) * 1.5 > deadline_s:
                left_out += 1
                continue
            with self._lock:
                self._pending.pop(key, None)
            if self.write(key, parent, tokens, arrays, mtime_ns=now_ns - (written + 1) * 1000):
                written += 1
            else:
                left_out += 1
        fsync_dir(self.dir)
        out = {"written": written, "already": already, "left_out": left_out,
               "seconds": round(time.monotonic() - t0, 3), "blocks": len(self._index), "bytes": self.bytes_used}
        log.info("prefix_store_saved", dir=str(self.dir), **out)
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the writer thread (queued spills not yet written are dropped)."""
        self._stop_writer(timeout_s)

    def stats(self) -> dict:
        return {"dir": str(self.dir), "blocks": len(self._index), "bytes": self.bytes_used,
                "capacity_bytes": self.capacity_bytes, "written": self.written, "loaded": self.loaded,
                "skipped": self.skipped, "evicted": self.evicted, "dropped": self.dropped,
                "pending": len(self._pending)}
