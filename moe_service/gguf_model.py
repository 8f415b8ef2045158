"""GGUF catalog: every shard, tensor and expert slab of a model, validated before any allocation.

One shard file (a split set is several, each a whole GGUF with its own data section)::

    | "GGUF" 4 | version u32 4 | n_tensors u64 8 | n_kv u64 8 |              header: 4 + 4 + 8 + 8
    | n_kv x (key string, value type u32, value) |                          metadata
    | n_tensors x (name string, n_dims u32, ne i64[n_dims], type u32, offset u64) |
    | zero padding to general.alignment | data: tensor bytes at data_offset + offset |

    string = u64 length + UTF-8 bytes; array = elem type u32 + count u64 + elems

Split sets are named ``NAME-00001-of-00003.gguf`` (1-based in the name) and carry
``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (the total over all
shards); only the first shard carries the model metadata.

The header is parsed here with ``struct``/numpy over a read-only mmap of the header bytes
(the ``gguf`` package supplies the type tables: :data:`gguf.GGML_QUANT_SIZES`,
:class:`gguf.GGMLQuantizationType`). ``gguf.GGUFReader`` is not used because it raises a bare
ValueError on the first unknown type id or truncated tensor, and takes seconds to walk a
150k-token vocabulary; this parser records every problem and lists everything it can.

Expert tensors ``blk.N.ffn_{gate,up,down,gate_up}_exps.weight`` have ne = {cols, rows, E}:
expert e is one contiguous slab of ``rows * row_bytes`` bytes at ``e * slab_bytes`` from the
tensor's start. That slab is the unit of NUMA placement and replication.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moe_service.errors import ModelFileError
from moe_service.formats import FORMATS
from moe_service.sizes import gib_text

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, n_tensors, n_kv

SHARD_NAME_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""``NAME-0000k-of-0000N.gguf``: llama.cpp's split naming (LLAMA_SPLIT_PATH / gguf-split)."""

EXPERT_TENSOR_RE = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<kind>gate_up|gate|up|down)_exps\.weight$")
EXPERT_KINDS = ("gate", "up", "down", "gate_up")

SUPPORTED_GGML_TYPES: frozenset[int] = frozenset(FORMATS) | {int(GGMLQuantizationType.I32)}
"""ggml type ids the engine reads: the block formats its kernels compute on (the format
declarations, moe_service/formats.py) and I32 index tables (deepseek4's
ffn_gate_tid2eid, read as int32, never as a weight: arch.base.MATRIX_TYPES). A tensor of another
known type is listed but reported as unsupported; pass ``supported_types`` to widen the set."""

# GGUF metadata value types -> struct format (scalars) and numpy dtype (arrays of scalars).
_KV_STRING, _KV_ARRAY, _KV_BOOL = 8, 9, 7
_KV_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_KV_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4
"""Deepest array-of-arrays in metadata (llama.cpp's gguf reader accepts none; the recursion
of a file nesting them 1000 deep would exhaust Python's stack)."""
MAX_TENSOR_NAME_BYTES = 255
"""Longest tensor name accepted (ggml's GGML_MAX_NAME is 64 with the NUL; some builds raise it)."""
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 24
"""Longest metadata string value (16 MiB; a chat template is tens of KiB): a corrupted length
read from the data section would otherwise make one string of the rest of the file."""
MAX_ARRAY_ITEMS = 1 << 20
"""Most items of one metadata array. The largest real ones are vocabularies (~260k tokens);
a corrupted count would otherwise read gigabytes of tensor data as metadata, and a Python
list takes ~8-32 bytes per item (a flipped count in a 100 GB file: an out-of-memory kill)."""
MAX_PARAM = 1 << 40
"""Largest integer hyperparameter accepted (layers, widths, heads, context, experts)."""


# --------------------------------------------------------------------------------------------
# Public records


@dataclass(frozen=True)
class Shard:
    """One GGUF file of a model. ``index`` is 0-based (``split.no``; 0 for a single file);
    ``data_offset`` is where the data section starts (absolute, in bytes); ``alignment`` is
    the file's ``general.alignment``."""

    path: Path
    index: int
    size_bytes: int
    data_offset: int
    alignment: int
    n_tensors: int
    identity: tuple[int, int, int, int] | None = None
    """(st_dev, st_ino, st_size, st_mtime_ns) when the header was read: :func:`check_unchanged`
    compares it with the file's current stat (a model file replaced or rewritten since)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are and how they are laid out.

    ``file_offset``: absolute byte offset in shard ``shard``'s file. ``ne``: ggml order
    (ne[0] = elements per row, fastest axis); ``shape``: numpy order (``ne`` reversed).
    A row is ``ne[0] // block_size`` blocks of ``type_size`` bytes (``row_bytes``);
    ``n_rows`` = prod(ne[1:]); ``nbytes`` = ``row_bytes * n_rows``.
    """

    name: str
    shard: int
    file_offset: int
    nbytes: int
    ggml_type: int
    type_name: str
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    block_size: int
    type_size: int
    row_bytes: int
    n_rows: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def end_offset(self) -> int:
        """One past the tensor's last byte in its shard file."""
        return self.file_offset + self.nbytes


@dataclass(frozen=True)
class ExpertTensor:
    """A 3-D routed-expert tensor ``blk.{layer}.ffn_{kind}_exps.weight``, ne = {cols, rows, E}.

    Expert e's weights are one contiguous slab of ``slab_bytes`` (= rows * row_bytes) at
    ``tensor.file_offset + e * slab_bytes``. ``kind`` is 'gate', 'up', 'down' or 'gate_up'
    (fused: gate rows first, then up rows).
    """

    layer: int
    kind: str
    tensor: TensorInfo
    n_expert: int
    slab_bytes: int

    def slab(self, e: int) -> tuple[int, int, int]:
        """(shard index, absolute file offset, nbytes) of expert ``e``'s slab.

        Raises IndexError when ``e`` is not in [0, n_expert).
        """
        if not 0 <= e < self.n_expert:
            raise IndexError(f"{self.tensor.name}: expert {e} out of range [0, {self.n_expert})")
        return self.tensor.shard, self.tensor.file_offset + e * self.slab_bytes, self.slab_bytes


class ExpertLayer(dict):
    """The routed-expert tensors of one layer: kind ('gate', 'up', 'down', 'gate_up') ->
    :class:`ExpertTensor`."""

    def __init__(self, layer: int, tensors: dict[str, ExpertTensor] | None = None):
        super().__init__(tensors or {})
        self.layer = layer

    @property
    def n_expert(self) -> int:
        """Experts in this layer (the largest E over its tensors; they agree in a valid file)."""
        return max((et.n_expert for et in self.values()), default=0)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert over all kinds of this layer (sum of the slabs)."""
        return sum(et.slab_bytes for et in self.values())

    def __repr__(self) -> str:
        return f"ExpertLayer(layer={self.layer}, kinds={sorted(self)}, n_expert={self.n_expert})"


@dataclass(frozen=True)
class ModelParams:
    """Hyperparameters from ``{arch}.*`` metadata (llama.cpp's llama_hparams names).

    head_dim: ``attention.key_length``, else n_embd // n_head; head_dim_v: ``value_length``,
    else head_dim. n_ff: dense FFN width (``feed_forward_length``); n_ff_exp: expert width
    (``expert_feed_forward_length``; for ``llama`` the experts use ``feed_forward_length``;
    when the key is absent, the expert tensors' row count). n_vocab: length of
    ``tokenizer.ggml.tokens``, else ``{arch}.vocab_size``, else token_embd's ne[1].
    Per-layer array values (some architectures store head counts per layer) are reduced to
    their maximum; the full arrays stay in :attr:`GGUFModel.metadata`.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    n_ff: int
    n_ff_exp: int
    n_expert_shared: int
    n_layer_dense_lead: int
    rope_freq_base: float
    rope_dim: int
    rms_eps: float


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a model file. ``kind`` is a short tag ('missing_shard',
    'foreign_shard', 'truncated', 'alignment', 'duplicate', 'unknown_type',
    'unsupported_type', 'block_size', 'overlap', 'header', 'metadata', 'expert_shape');
    ``message`` is the operator-facing sentence."""

    kind: str
    message: str
    path: Path | None = None
    tensor: str | None = None

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------------------------
# Header parsing


class _Truncated(Exception):
    def __init__(self, pos: int, need: int):
        super().__init__(pos, need)
        self.pos, self.need = pos, need


class _BadHeader(Exception):
    pass


class _Cursor:
    """Reads little-endian GGUF fields from a buffer, raising _Truncated past its end."""

    def __init__(self, buf: mmap.mmap, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Truncated(start, n)
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self, limit: int = MAX_STRING_BYTES, what: str = "string") -> str:
        n = self.u64()
        if n > limit:
            raise _BadHeader(f"a {what} of {n} bytes at byte {self.pos - 8} (at most {limit} are accepted)")
        s = self.take(n)
        return self.buf[s : s + n].decode("utf-8", "surrogateescape")

    def _strings(self, count: int) -> list[str]:
        """An array of ``count`` strings (the vocabulary: 100k+ of them), in one local loop."""
        buf, size, pos = self.buf, self.size, self.pos
        if count * 8 > size - pos:
            raise _Truncated(pos, count * 8)
        unpack = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(pos, 8)
            n = unpack(buf, pos)[0]
            pos += 8
            if n > MAX_STRING_BYTES:
                raise _BadHeader(f"a string of {n} bytes at byte {pos - 8} (at most {MAX_STRING_BYTES} are accepted)")
            if pos + n > size:
                raise _Truncated(pos, n)
            append(buf[pos:pos + n].decode("utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0):
        if vtype == _KV_STRING:
            return self.string()
        fmt = _KV_SCALAR.get(vtype)
        if fmt is not None:
            return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]
        if vtype != _KV_ARRAY:
            raise _BadHeader(f"unknown metadata value type {vtype} at byte {self.pos - 4}")
        etype, count = self.u32(), self.u64()
        if count > MAX_ARRAY_ITEMS:
            raise _BadHeader(f"a metadata array of {count} items at byte {self.pos - 12} (at most "
                             f"{MAX_ARRAY_ITEMS} are accepted: a vocabulary has a few 100k)")
        dtype = _KV_NUMPY.get(etype)
        if dtype is not None:
            itemsize = np.dtype(dtype).itemsize
            if count * itemsize > self.size - self.pos:
                raise _Truncated(self.pos, count * itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.take(count * itemsize))
            out = arr.astype(bool).tolist() if etype == _KV_BOOL else arr.tolist()
            del arr  # release the buffer export so the mmap can close
            return out
        if etype == _KV_STRING:
            return self._strings(count)
        if etype in (_KV_STRING, _KV_ARRAY):
            if etype == _KV_ARRAY and depth >= MAX_ARRAY_NESTING:
                raise _BadHeader(f"metadata arrays nested deeper than {MAX_ARRAY_NESTING} levels at byte "
                                 f"{self.pos - 12}")
            min_item = 8 if etype == _KV_STRING else 12
            if count * min_item > self.size - self.pos:
                raise _Truncated(self.pos, count * min_item)
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise _BadHeader(f"unknown array element type {etype} at byte {self.pos - 12}")


@dataclass
class _TensorEntry:
    name: str
    ne: tuple[int, ...]
    type_id: int
    rel_offset: int


@dataclass
class _ShardHeader:
    path: Path
    size_bytes: int
    version: int
    kv: dict[str, object]
    entries: list[_TensorEntry]
    data_offset: int
    alignment: int
    problems: list[Problem] = field(default_factory=list)
    identity: tuple[int, int, int, int] | None = None


def _read_header(path: Path) -> _ShardHeader:
    """Parse one GGUF file's header, metadata and tensor infos (not its data).

    Raises ModelFileError (naming the file) when it is not a GGUF, has an unsupported
    version or its header is cut short. Softer faults (duplicate keys, bad alignment) are
    returned in ``problems``.
    """
    try:
        return _read_header_of(path)
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a GGUF file") from None
    except PermissionError:
        raise ModelFileError(f"{path}: cannot read the model file: permission denied (the service user needs "
                             "read access to the file and search access to its folders)") from None
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the model file: {e.strerror or e}") from None


def _read_header_of(path: Path) -> _ShardHeader:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelFileError(f"{path}: model file not found") from None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(f"{path}: not a regular file (a device, FIFO or socket cannot hold a GGUF model)")
    size = st.st_size
    if size < HEADER_BYTES:
        raise ModelFileError(f"{path}: not a GGUF file (only {size} bytes, a header needs {HEADER_BYTES})")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        fst = os.fstat(f.fileno())
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise ModelFileError(f"{path}: the file was replaced while it was being opened; try again")
        identity = (fst.st_dev, fst.st_ino, fst.st_size, fst.st_mtime_ns)
        size = min(size, fst.st_size, len(buf))
        if buf[:4] != GGUF_MAGIC:
            raise ModelFileError(
                f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})"
            )
        cur = _Cursor(buf, size)
        cur.take(4)
        version = cur.u32()
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
                raise ModelFileError(f"{path}: big-endian GGUF files are not supported")
            raise ModelFileError(
                f"{path}: unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        problems: list[Problem] = []
        kv: dict[str, object] = {}
        entries: list[_TensorEntry] = []
        try:
            n_tensors, n_kv = cur.u64(), cur.u64()
            for _ in range(n_kv):
                key = cur.string(MAX_KEY_BYTES, "metadata key")
                value = cur.value(cur.u32())
                if key in kv:
                    problems.append(Problem("header", f"{path}: metadata key {key!r} appears twice", path))
                    continue
                kv[key] = value
            for _ in range(n_tensors):
                name = cur.string(MAX_TENSOR_NAME_BYTES, "tensor name")
                n_dims = cur.u32()
                if n_dims > _MAX_DIMS:
                    raise _BadHeader(f"tensor {name!r} has {n_dims} dimensions (ggml allows {_MAX_DIMS})")
                ne = struct.unpack_from(f"<{n_dims}q", buf, cur.take(8 * n_dims))
                type_id = cur.u32()
                rel_offset = cur.u64()
                entries.append(_TensorEntry(name, tuple(int(n) for n in ne), type_id, rel_offset))
        except _Truncated as t:
            raise ModelFileError(
                f"{path}: header cut short: {t.need} bytes needed at byte {t.pos} but the file has {size} bytes"
            ) from None
        except _BadHeader as b:
            raise ModelFileError(f"{path}: malformed GGUF header: {b}") from None
        alignment = kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            problems.append(
                Problem(
                    "alignment",
                    f"{path}: general.alignment is {alignment!r}, not a positive power of two",
                    path,
                )
            )
            alignment = DEFAULT_ALIGNMENT
        elif alignment & (alignment - 1):
            problems.append(
                Problem("alignment", f"{path}: general.alignment is {alignment}, not a power of two", path)
            )
        data_offset = -(-cur.pos // alignment) * alignment
    return _ShardHeader(path, size, version, kv, entries, data_offset, alignment, problems, identity)


# --------------------------------------------------------------------------------------------
# The catalog


def _type_name(type_id: int) -> str | None:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return None


def shard_paths(path: Path) -> tuple[list[Path], int | None]:
    """All file names of the split set ``path`` belongs to, in shard order, and the shard
    index (0-based) that ``path`` names; ``([path], None)`` when the name is not a split name.

    Raises ModelFileError for a split name that cannot be (``x-00001-of-00000.gguf``,
    ``x-00003-of-00002.gguf``)."""
    m = SHARD_NAME_RE.match(path.name)
    if not m:
        return [path], None
    count, no = int(m["count"]), int(m["no"])
    if not 1 <= no <= count:
        raise ModelFileError(f"{path}: the split name says shard {no} of {count}, which cannot be: split "
                             f"names count from NAME-00001-of-0000N.gguf to NAME-0000N-of-0000N.gguf")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    return paths, no - 1


def _scalar(v) -> int | float | None:
    if isinstance(v, list):
        nums = [x for x in v if isinstance(x, int | float)]
        return max(nums) if nums else None
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


class GGUFModel:
    """A GGUF model (one file or a split set): shards, tensors, expert slabs, hyperparameters.

    Build with :meth:`open`. Attributes:

    - ``path``: the file it was opened from; ``shards``: list[:class:`Shard`] by index
      (with ``strict=True`` every shard is present, so ``shards[i].index == i``);
    - ``tensors``: name -> :class:`TensorInfo`, in file order, shard by shard (tensors of
      unknown ggml type are left out: they are in :meth:`problems`);
    - ``metadata``: the first shard's key/value pairs as plain Python values (lists for arrays);
    - ``params``: :class:`ModelParams`; ``expert_layers``: layer -> :class:`ExpertLayer`;
    - ``total_bytes``: sum of the listed tensors' bytes.
    """

    def __init__(
        self,
        path: Path,
        shards: list[Shard],
        tensors: dict[str, TensorInfo],
        metadata: dict[str, object],
        problems: list[Problem],
    ):
        self.path = path
        self.shards = shards
        self.tensors = tensors
        self.metadata = metadata
        self._problems = problems
        self.params = self._read_params()
        self.expert_layers = self._group_experts()

    # -- construction --------------------------------------------------------------------

    @classmethod
    def open(
        cls, path: str | os.PathLike, *, strict: bool = True, supported_types: frozenset[int] | None = None
    ) -> GGUFModel:
        """Catalog the model that ``path`` belongs to (any shard of a split set, or one file).

        Reads only headers (a few MB at most). Checks: every shard present and of this set
        (``split.count``, ``split.no``, ``split.tensors.count``), every tensor inside its file,
        alignment, duplicate names, known and supported ggml types (``supported_types``,
        default :data:`SUPPORTED_GGML_TYPES`), ne[0] a multiple of the block size, no
        overlapping tensors, the required hyperparameters present.

        Raises ModelFileError when ``path`` itself is not a readable GGUF, and, with
        ``strict=True`` (the default), one ModelFileError summarising every problem found
        (its ``problems`` attribute lists them). With ``strict=False`` the catalog is returned
        as far as it could be built and :meth:`problems` lists what is wrong.
        """
        path = Path(path)
        supported = SUPPORTED_GGML_TYPES if supported_types is None else frozenset(supported_types)
        opened = _read_header(path)  # the file named must at least be a GGUF
        problems: list[Problem] = list(opened.problems)
        names, opened_index = shard_paths(path)
        headers: dict[int, _ShardHeader] = {}
        declared_count = opened.kv.get("split.count")

        if opened_index is None:
            if isinstance(declared_count, int) and declared_count > 1:
                problems.append(
                    Problem(
                        "missing_shard",
                        f"{path} says it is shard {int(opened.kv.get('split.no', 0)) + 1} of {declared_count} "
                        f"(split.count) but its name does not follow NAME-0000k-of-{declared_count:05d}.gguf, "
                        "so the other shards cannot be found",
                        path,
                    )
                )
            headers[0] = opened
        else:
            for i, p in enumerate(names):
                if i == opened_index:
                    headers[i] = opened
                    continue
                if not p.exists():
                    problems.append(
                        Problem(
                            "missing_shard",
                            f"missing shard {p} (shard {i + 1} of {len(names)} of the set {path} belongs to)",
                            p,
                        )
                    )
                    continue
                try:
                    headers[i] = _read_header(p)
                except ModelFileError as e:
                    problems.append(Problem("header", str(e), p))
            problems += _check_split_set(path, names, opened_index, headers)

        shards: list[Shard] = []
        tensors: dict[str, TensorInfo] = {}
        where: dict[str, Path] = {}
        for index in sorted(headers):
            h = headers[index]
            shards.append(Shard(h.path, index, h.size_bytes, h.data_offset, h.alignment, len(h.entries),
                                h.identity))
            problems += _catalog_shard(h, index, supported, tensors, where)
        metadata = dict((headers.get(0) or headers[min(headers)]).kv)
        model = cls(path, shards, tensors, metadata, problems)
        model._problems += model._check_params() + model._check_experts()
        if strict and model._problems:
            raise model.error()
        return model

    # -- validation results --------------------------------------------------------------

    def problems(self) -> list[Problem]:
        """Everything found wrong while cataloging, in the order found (empty when valid)."""
        return list(self._problems)

    def error(self, limit: int = 8) -> ModelFileError:
        """One ModelFileError summarising :meth:`problems` (first ``limit`` named, the rest counted);
        ``err.problems`` holds the full list."""
        probs = self._problems
        shown = "; ".join(p.message for p in probs[:limit])
        more = f"; and {len(probs) - limit} more" if len(probs) > limit else ""
        err = ModelFileError(f"{self.path}: {len(probs)} problem(s) in the model files: {shown}{more}")
        err.problems = list(probs)
        return err

    # -- conveniences --------------------------------------------------------------------

    @property
    def arch(self) -> str:
        return self.params.arch

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def arch_value(self, key: str, default=None):
        """Metadata value ``{arch}.{key}`` (e.g. ``arch_value('expert_shared_count', 0)``)."""
        return self.metadata.get(f"{self.params.arch}.{key}", default)

    def expert_tensor(self, layer: int, kind: str) -> ExpertTensor:
        """The ``kind`` expert tensor of ``layer``; KeyError naming both when absent."""
        try:
            return self.expert_layers[layer][kind]
        except KeyError:
            raise KeyError(f"layer {layer} has no {kind!r} expert tensor") from None

    @property
    def expert_bytes(self) -> int:
        """Bytes held by routed-expert tensors (the part placed per NUMA node)."""
        return sum(et.tensor.nbytes for lay in self.expert_layers.values() for et in lay.values())

    def __repr__(self) -> str:
        return (
            f"GGUFModel({str(self.path)!r}, arch={self.params.arch!r}, shards={len(self.shards)}, "
            f"tensors={len(self.tensors)}, bytes={self.total_bytes})"
        )

    # -- params and experts --------------------------------------------------------------

    def _read_params(self) -> ModelParams:
        md = self.metadata
        arch = md.get("general.architecture")
        arch = arch if isinstance(arch, str) else ""

        self._param_problems: list[Problem] = []

        def num(key: str, default=0, *, integer: bool = True):
            v = _scalar(md.get(f"{arch}.{key}"))
            if v is None:
                return default
            bad = None
            if not math.isfinite(v):
                bad = "not a finite number"
            elif integer and not float(v).is_integer():
                bad = "not an integer"
            elif integer and not 0 <= v <= MAX_PARAM:
                bad = f"outside 0..{MAX_PARAM}"
            elif not integer and abs(v) > 1e30:
                bad = "out of range"
            if bad is not None:
                self._param_problems.append(
                    Problem("metadata", f"{self.path}: metadata key {arch}.{key} is {v!r}: {bad}", self.path))
                return default
            return v

        n_embd, n_head = int(num("embedding_length")), int(num("attention.head_count"))
        head_dim = int(num("attention.key_length", (n_embd // n_head) if n_head else 0))
        n_expert = int(num("expert_count"))
        n_ff = int(num("feed_forward_length"))
        n_ff_exp = int(num("expert_feed_forward_length"))
        if arch == "llama" and n_expert:
            n_ff_exp = n_ff
        if not n_ff_exp and n_expert:  # width from the tensors: gate/up ne = {H, I, E}
            for name, t in self.tensors.items():
                m = EXPERT_TENSOR_RE.match(name)
                if m and m["kind"] in ("gate", "up") and len(t.ne) == 3:
                    n_ff_exp = t.ne[1]
                    break
        tokens = md.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            n_vocab = len(tokens)
        elif num("vocab_size"):
            n_vocab = int(num("vocab_size"))
        else:
            emb = self.tensors.get("token_embd.weight")
            n_vocab = emb.ne[1] if emb is not None and len(emb.ne) > 1 else 0
        return ModelParams(
            arch=arch,
            n_layer=int(num("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(num("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            head_dim_v=int(num("attention.value_length", head_dim)),
            n_vocab=n_vocab,
            n_ctx_train=int(num("context_length")),
            n_expert=n_expert,
            n_expert_used=int(num("expert_used_count")),
            n_ff=n_ff,
            n_ff_exp=n_ff_exp,
            n_expert_shared=int(num("expert_shared_count")),
            n_layer_dense_lead=int(num("leading_dense_block_count")),
            rope_freq_base=float(num("rope.freq_base", 10000.0, integer=False)),
            rope_dim=int(num("rope.dimension_count", head_dim)),
            rms_eps=float(num("attention.layer_norm_rms_epsilon", 1e-5, integer=False)),
        )

    def _check_params(self) -> list[Problem]:
        md, arch = self.metadata, self.params.arch
        if not arch:
            return [
                Problem(
                    "metadata",
                    f"{self.path}: general.architecture is missing from the first shard",
                    self.path,
                )
            ]
        out = list(getattr(self, "_param_problems", ()))
        for key in ("block_count", "embedding_length", "attention.head_count"):
            if _scalar(md.get(f"{arch}.{key}")) is None:
                out.append(
                    Problem("metadata", f"{self.path}: metadata key {arch}.{key} is missing", self.path)
                )
        p = self.params
        if p.n_expert and not 0 < p.n_expert_used <= p.n_expert:
            out.append(
                Problem(
                    "metadata",
                    f"{self.path}: {arch}.expert_used_count is {p.n_expert_used}, expected 1..{p.n_expert}",
                    self.path,
                )
            )
        return out

    def _group_experts(self) -> dict[int, ExpertLayer]:
        layers: dict[int, ExpertLayer] = {}
        for name, t in self.tensors.items():
            m = EXPERT_TENSOR_RE.match(name)
            if not m or len(t.ne) != 3 or t.ne[2] <= 0:
                continue
            layer = int(m["layer"])
            n_expert = t.ne[2]
            lay = layers.setdefault(layer, ExpertLayer(layer))
            lay[m["kind"]] = ExpertTensor(layer, m["kind"], t, n_expert, t.nbytes // n_expert)
        return dict(sorted(layers.items()))

    def _check_experts(self) -> list[Problem]:
        out = []
        for name, t in self.tensors.items():
            if EXPERT_TENSOR_RE.match(name) and (len(t.ne) != 3 or t.ne[2] <= 0):
                out.append(
                    Problem(
                        "expert_shape",
                        f"expert tensor {name} has ne={list(t.ne)}, expected 3 dims {{cols, rows, n_expert}}",
                        tensor=name,
                    )
                )
        n_expert = self.params.n_expert
        for layer, lay in self.expert_layers.items():
            for et in lay.values():
                if n_expert and et.n_expert != n_expert:
                    out.append(
                        Problem(
                            "expert_shape",
                            f"{self.path}: expert tensor {et.tensor.name} holds {et.n_expert} experts but "
                            f"{self.params.arch}.expert_count is {n_expert}",
                            tensor=et.tensor.name,
                        )
                    )
            if "gate_up" in lay and ("gate" in lay or "up" in lay):
                out.append(
                    Problem(
                        "expert_shape", f"layer {layer} has both fused gate_up and separate gate/up experts"
                    )
                )
        return out


def _check_split_set(
    path: Path, names: list[Path], opened_index: int, headers: dict[int, _ShardHeader]
) -> list[Problem]:
    """Every shard present must be of the set its name says (count, number, total tensors)."""
    out: list[Problem] = []
    count = len(names)
    totals = {}
    for i, h in headers.items():
        sc, sn, st = h.kv.get("split.count"), h.kv.get("split.no"), h.kv.get("split.tensors.count")
        if count == 1 and sc is None:
            continue
        if sc != count:
            out.append(
                Problem(
                    "foreign_shard",
                    f"{h.path} has split.count={sc} but its name says it is one of {count} shards "
                    "(a shard from another split set?)",
                    h.path,
                )
            )
            continue
        if sn != i:
            out.append(
                Problem(
                    "foreign_shard",
                    f"{h.path} has split.no={sn} but its name says it is shard {i + 1} (split.no {i})",
                    h.path,
                )
            )
        totals[i] = st
    if totals:
        ref_index = opened_index if opened_index in totals else min(totals)
        ref = totals[ref_index]
        for i, st in totals.items():
            if st != ref:
                out.append(
                    Problem(
                        "foreign_shard",
                        f"{headers[i].path} has split.tensors.count={st} but {headers[ref_index].path} has {ref} "
                        "(a shard from another split set?)",
                        headers[i].path,
                    )
                )
        if len(headers) == count and not out and isinstance(ref, int):
            have = sum(len(h.entries) for h in headers.values())
            if have != ref:
                out.append(
                    Problem(
                        "foreign_shard",
                        f"the {count} shards of {path} hold {have} tensors but split.tensors.count "
                        f"says {ref}",
                        path,
                    )
                )
    arch = headers[0].kv.get("general.architecture") if 0 in headers else None
    for h in headers.values():
        a = h.kv.get("general.architecture")
        if arch is not None and a is not None and a != arch:
            out.append(
                Problem("foreign_shard", f"{h.path} is a {a!r} model but the first shard is {arch!r}", h.path)
            )
    return out + _check_split_fingerprints(headers)


_FAMILY = {
    **{int(t): "float" for t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)},
    **{int(t): "legacy" for t in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                                  GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0)},
    **{int(t): "k-quant" for t in (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
                                   GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)},
    int(GGMLQuantizationType.MXFP4): "mxfp4",
}
"""Quantization family of a ggml type. llama.cpp's mixes (Q4_K_M: Q4_K with Q6_K on some
layers) vary the type of one tensor role from layer to layer, but within one family."""

# general.file_type (llama_ftype) of the pure quantizations -> the one type of their weights
_PURE_FTYPES = {2: GGMLQuantizationType.Q4_0, 3: GGMLQuantizationType.Q4_1, 7: GGMLQuantizationType.Q8_0,
                8: GGMLQuantizationType.Q5_0, 9: GGMLQuantizationType.Q5_1}
_LAYER_RE = re.compile(r"^blk\.\d+\.")


def split_fingerprint(h: _ShardHeader) -> str:
    """Fingerprint of the metadata a shard shares with the rest of its set: every key but
    ``split.no`` (sha256 of their sorted repr, 16 hex digits)."""
    import hashlib

    shared = sorted((k, repr(v)) for k, v in h.kv.items() if k != "split.no")
    return hashlib.sha256(repr(shared).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _check_split_fingerprints(headers: dict[int, _ShardHeader]) -> list[Problem]:
    """Shards of one split set must come from one conversion (not two quantizations of the same
    model that happen to split alike):

    - metadata keys two shards both carry must agree (the fingerprint of what they share;
      gguf-split writes the model metadata in the first shard only, other writers repeat it);
    - a layer tensor role (``blk.N.ffn_up_exps.weight`` for every N) must use one quantization
      family (float, legacy Q4_0..Q8_0, K-quants, MXFP4) in every shard;
    - with a pure ``general.file_type`` in the first shard (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) every
      quantized layer tensor of every shard must be of that type.
    """
    out: list[Problem] = []
    if len(headers) < 2:
        return out
    first_i = min(headers)
    first = headers[first_i]
    for i, h in sorted(headers.items()):
        if i == first_i:
            continue
        common = (set(first.kv) & set(h.kv)) - {"split.no"}
        differ = sorted(k for k in common if first.kv[k] != h.kv[k])
        if differ:
            k = differ[0]
            out.append(Problem(
                "foreign_shard",
                f"{h.path} does not match {first.path}: metadata fingerprint {split_fingerprint(h)} vs "
                f"{split_fingerprint(first)} ({k} is {_short(h.kv[k])} there and {_short(first.kv[k])} in the first "
                "shard): shards of different conversions or quantizations",
                h.path,
            ))
    families: dict[str, dict[int, set[str]]] = {}
    for i, h in headers.items():
        for e in h.entries:
            if _LAYER_RE.match(e.name) and e.type_id in _FAMILY:
                role = _LAYER_RE.sub("blk.N.", e.name)
                families.setdefault(role, {}).setdefault(i, set()).add(_FAMILY[e.type_id])
    mismatched: dict[int, list[tuple[str, int]]] = {}  # shard -> [(role, the shard it differs from)]
    for role, by_shard in families.items():
        shards = sorted(by_shard)
        for i in shards[1:]:
            if not by_shard[i] & by_shard[shards[0]]:
                mismatched.setdefault(i, []).append((role, shards[0]))
    for i, roles in sorted(mismatched.items()):
        role, ref = roles[0]
        fam = "/".join(sorted(families[role][i]))
        ref_fam = "/".join(sorted(families[role][ref]))
        out.append(Problem(
            "foreign_shard",
            f"{headers[i].path} is quantized differently from {headers[ref].path}: {len(roles)} layer tensor "
            f"role(s) use another quantization family (e.g. {role}: {fam} there, {ref_fam} in the other): "
            "shards of different quantizations",
            headers[i].path,
        ))
    pure = _PURE_FTYPES.get(first.kv.get("general.file_type")) if isinstance(first.kv.get("general.file_type"), int) else None
    if pure is not None:
        for _, h in sorted(headers.items()):
            odd = next((e for e in h.entries if _LAYER_RE.match(e.name) and _FAMILY.get(e.type_id) not in (None, "float")
                        and e.type_id != int(pure)), None)
            if odd is not None:
                out.append(Problem(
                    "foreign_shard",
                    f"{h.path}: tensor {odd.name} is {_type_name(odd.type_id)} but the set's general.file_type "
                    f"says {pure.name} throughout: shards of different quantizations",
                    h.path,
                    odd.name,
                ))
    return out


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _catalog_shard(
    h: _ShardHeader,
    index: int,
    supported: frozenset[int],
    tensors: dict[str, TensorInfo],
    where: dict[str, Path],
) -> list[Problem]:
    """Add shard ``h``'s tensors to ``tensors``; return the problems found in it."""
    out: list[Problem] = []
    unknown: dict[int, list[str]] = {}
    unsupported: dict[int, list[str]] = {}
    misaligned: list[str] = []
    beyond: list[TensorInfo] = []
    placed: list[TensorInfo] = []
    for e in h.entries:
        if e.name in where:
            out.append(
                Problem(
                    "duplicate",
                    f"tensor {e.name} appears twice: in {where[e.name]} and in {h.path}",
                    h.path,
                    e.name,
                )
            )
            continue
        type_name = _type_name(e.type_id)
        if type_name is None or GGMLQuantizationType(e.type_id) not in GGML_QUANT_SIZES:
            unknown.setdefault(e.type_id, []).append(e.name)
            continue
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(e.type_id)]
        ne = e.ne if e.ne else (1,)
        if any(n < 0 for n in ne):
            out.append(
                Problem(
                    "header",
                    f"tensor {e.name} in {h.path} has a negative dimension: ne={list(ne)}",
                    h.path,
                    e.name,
                )
            )
            continue
        if ne[0] % block_size:
            out.append(
                Problem(
                    "block_size",
                    f"tensor {e.name} in {h.path}: ne[0]={ne[0]} is not a multiple of {type_name}'s "
                    f"block size {block_size}",
                    h.path,
                    e.name,
                )
            )
        if e.type_id not in supported:
            unsupported.setdefault(e.type_id, []).append(e.name)
        if e.rel_offset % h.alignment:
            misaligned.append(e.name)
        row_bytes = ne[0] // block_size * type_size
        n_rows = math.prod(ne[1:])
        t = TensorInfo(
            name=e.name,
            shard=index,
            file_offset=h.data_offset + e.rel_offset,
            nbytes=row_bytes * n_rows,
            ggml_type=e.type_id,
            type_name=type_name,
            ne=tuple(ne),
            shape=tuple(reversed(ne)),
            block_size=block_size,
            type_size=type_size,
            row_bytes=row_bytes,
            n_rows=n_rows,
        )
        tensors[e.name] = t
        where[e.name] = h.path
        placed.append(t)
        if t.end_offset > h.size_bytes:
            beyond.append(t)
    for type_id, names in unknown.items():
        out.append(
            Problem(
                "unknown_type",
                f"{h.path}: unknown ggml type id {type_id} in {len(names)} tensor(s): {_few(names)}",
                h.path,
                names[0],
            )
        )
    for type_id, names in unsupported.items():
        out.append(
            Problem(
                "unsupported_type",
                f"{h.path}: ggml type {_type_name(type_id)} (id {type_id}) is not supported by "
                f"the engine, used by {len(names)} tensor(s): {_few(names)}",
                h.path,
                names[0],
            )
        )
    if misaligned:
        out.append(
            Problem(
                "alignment",
                f"{h.path}: {len(misaligned)} tensor offset(s) not aligned to {h.alignment} bytes: "
                f"{_few(misaligned)}",
                h.path,
                misaligned[0],
            )
        )
    if beyond:
        first = beyond[0]
        out.append(
            Problem(
                "truncated",
                f"{h.path} is truncated (incomplete download?): tensor {first.name} needs bytes up to "
                f"{first.end_offset} but the file has {h.size_bytes} bytes ({len(beyond)} tensor(s) end past the "
                "end of the file)",
                h.path,
                first.name,
            )
        )
    placed.sort(key=lambda t: t.file_offset)
    for a, b in zip(placed, placed[1:], strict=False):
        if b.file_offset < a.end_offset and a.nbytes and b.nbytes:
            out.append(
                Problem(
                    "overlap",
                    f"{h.path}: tensors {a.name} and {b.name} overlap at bytes {b.file_offset}.."
                    f"{a.end_offset}",
                    h.path,
                    b.name,
                )
            )
    return out


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# --------------------------------------------------------------------------------------------
# The report `moe-service check` prints


def changed_shards(model: GGUFModel) -> list[str]:
    """Shards whose file changed since the catalog read its header: one sentence each naming
    the file and what differs (replaced: another inode; rewritten: size or mtime), or that it
    is gone. Empty when every shard is as cataloged (shards without a recorded identity are
    skipped)."""
    out = []
    for sh in model.shards:
        if sh.identity is None:
            continue
        dev, ino, size, mtime_ns = sh.identity
        try:
            st = os.stat(sh.path)
        except OSError as e:
            out.append(f"{sh.path} can no longer be read ({e.strerror or e})")
            continue
        if (st.st_dev, st.st_ino) != (dev, ino):
            out.append(f"{sh.path} was replaced by another file (inode {ino} -> {st.st_ino})")
        elif st.st_size != size or st.st_mtime_ns != mtime_ns:
            out.append(f"{sh.path} was rewritten (size {size} -> {st.st_size} bytes, mtime changed by "
                       f"{(st.st_mtime_ns - mtime_ns) / 1e9:+.3f} s)")
    return out


def _printable(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes of the file, kept by surrogateescape)
    as backslash escapes, so printing it never raises UnicodeEncodeError."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class CatalogReport:
    """What ``moe-service check`` prints about the model files: ``summary`` lines (one fact
    each), ``problems`` (empty when the files are valid); ``ok`` when there are none."""

    path: Path
    summary: list[str]
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """Summary lines, then ``problem: ...`` lines, then the verdict line. Names from the file
        that are not valid UTF-8 are shown with backslash escapes (printable on any terminal)."""
        out = [_printable(line) for line in self.summary]
        out += [f"problem: {_printable(p.message)}" for p in self.problems]
        out.append("model files: OK" if self.ok else f"model files: {len(self.problems)} problem(s)")
        return out


def verdict(
    model_or_path: GGUFModel | str | os.PathLike, supported_types: frozenset[int] | None = None
) -> CatalogReport:
    """Catalog (non-strict) and summarise a model: architecture, layers, experts/top-k,
    tensors, bytes, a histogram of ggml types, then every problem. Never raises for a bad
    model file: a file that cannot be read at all is reported as a problem."""
    if isinstance(model_or_path, GGUFModel):
        model = model_or_path
    else:
        path = Path(model_or_path)
        try:
            model = GGUFModel.open(path, strict=False, supported_types=supported_types)
        except ModelFileError as e:
            return CatalogReport(path, [f"model: {path}"], [Problem("header", str(e), path)])
    p = model.params
    size = sum(s.size_bytes for s in model.shards)
    summary = [
        f"model: {model.path} ({len(model.shards)} shard(s), {gib_text(size)} on disk)",
        f"architecture: {p.arch or '?'}, {p.n_layer} layers, hidden {p.n_embd}, heads {p.n_head}/{p.n_head_kv} "
        f"(head_dim {p.head_dim}), vocab {p.n_vocab}, context {p.n_ctx_train}",
    ]
    if model.expert_layers:
        eb = model.expert_bytes
        summary.append(
            f"experts: {p.n_expert} per layer, top-{p.n_expert_used}, width {p.n_ff_exp}, "
            f"{len(model.expert_layers)} expert layers, {gib_text(eb)} in experts "
            f"({100 * eb / max(model.total_bytes, 1):.1f}% of the weights)"
        )
    else:
        summary.append("experts: none (dense model)")
    summary.append(f"tensors: {len(model.tensors)}, {gib_text(model.total_bytes)} ({model.total_bytes} bytes)")
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for t in model.tensors.values():
        counts[t.type_name] += 1
        nbytes[t.type_name] += t.nbytes
    hist = ", ".join(f"{name} {counts[name]} ({gib_text(nbytes[name])})" for name, _ in nbytes.most_common())
    summary.append(f"types: {hist}")
    return CatalogReport(model.path, summary, model.problems())
