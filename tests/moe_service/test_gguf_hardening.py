"""Issue 15 (hardening): model files. The GGUF reader and `moe-service check` never show a
traceback, hang or balloon for a bad file (known crashers, then 10,000 fuzzed headers of real
files), a split set mixing quantizations is refused, and a file replaced during the load is
detected."""

from __future__ import annotations

import contextlib
import io
import shutil
import struct
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from moe_service.cli import main as cli_main
from moe_service.errors import ModelFileError
from moe_service.gguf_model import GGUFModel, verdict
from tests.support.gguf_factory import write_moe_gguf


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _gguf(kvs: list[tuple[str, int, bytes]]) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for key, vtype, value in kvs:
        out += _s(key.encode()) + struct.pack("<I", vtype) + value
    return out


_BASE = [("general.architecture", 8, _s(b"llama")), ("llama.block_count", 4, struct.pack("<I", 2)),
         ("llama.embedding_length", 4, struct.pack("<I", 64)), ("llama.attention.head_count", 4, struct.pack("<I", 4))]


def _without(key):
    return [kv for kv in _BASE if kv[0] != key]


def _check(path) -> tuple[int, str]:
    """`moe-service check --model PATH` in this process: exit code and everything printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["check", "--model", str(path)])
    return code, out.getvalue() + err.getvalue()


def _nested(depth: int) -> bytes:
    v = struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    for _ in range(depth):
        v = struct.pack("<IQ", 9, 1) + v
    return v


@pytest.mark.parametrize("name,raw,words", [
    ("nested.gguf", _gguf(_BASE + [("x.nested", 9, _nested(1000))]), "nested deeper than"),
    ("nan.gguf", _gguf(_without("llama.block_count") + [("llama.block_count", 6, struct.pack("<f", float("nan")))]),
     "llama.block_count is nan: not a finite number"),
    ("inf.gguf", _gguf(_without("llama.block_count") + [("llama.block_count", 12, struct.pack("<d", float("inf")))]),
     "not a finite number"),
    ("frac.gguf", _gguf(_without("llama.embedding_length") + [("llama.embedding_length", 6, struct.pack("<f", 2.5))]),
     "not an integer"),
    ("count.gguf", _gguf(_BASE + [("x.arr", 9, struct.pack("<IQ", 0, 1 << 40))]), "metadata array of"),
    ("x-00001-of-00000.gguf", _gguf(_BASE), "shard 1 of 0"),
    ("x-00003-of-00002.gguf", _gguf(_BASE), "shard 3 of 2"),
])
def test_known_crashers_are_a_sentence_and_exit_3(tmp_path, name, raw, words):
    path = tmp_path / name
    path.write_bytes(raw)
    rep = verdict(path)
    assert not rep.ok and any(words in p.message for p in rep.problems), [p.message for p in rep.problems]
    code, text = _check(path)
    assert code == 3 and words in text and "Traceback" not in text


def test_a_directory_or_an_unreadable_file_is_a_sentence(tmp_path, monkeypatch):
    (tmp_path / "model.gguf").mkdir()
    code, text = _check(tmp_path / "model.gguf")
    assert code == 3 and "is a directory, not a GGUF file" in text
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    import moe_service.gguf_model as gm

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gm, "open", denied, raising=False)  # root reads anything: simulate the refusal
    code, text = _check(path)
    assert code == 3 and "permission denied" in text and "Traceback" not in text


def test_a_tensor_name_running_into_the_data_is_refused_fast(tmp_path):
    """A name length corrupted to the size of the data section made one 80 MB name that every
    overlap message repeated (minutes, gigabytes)."""
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    raw = bytearray(path.read_bytes())
    i = raw.index(b"token_embd.weight") - 8
    raw[i:i + 8] = struct.pack("<Q", len(raw) - i - 100)
    path.write_bytes(bytes(raw))
    rep = verdict(path)
    assert not rep.ok and "tensor name of" in rep.problems[0].message


def test_split_shards_of_different_quantizations_are_refused(tmp_path):
    (tmp_path / "q8").mkdir()
    (tmp_path / "q4k").mkdir()
    q8 = write_moe_gguf(tmp_path / "q8" / "m.gguf", split_max_tensors=8, n_embd=256, n_ff_exp=256)
    q4k = write_moe_gguf(tmp_path / "q4k" / "m.gguf", split_max_tensors=8, n_embd=256, n_ff_exp=256,
                         qtype=GGMLQuantizationType.Q4_K)
    assert verdict(q8[0]).ok and verdict(q4k[0]).ok
    shutil.copy(q4k[2], q8[2])  # same names, same counts: only the quantization differs
    rep = verdict(q8[0])
    msgs = [p.message for p in rep.problems if p.kind == "foreign_shard"]
    assert len(msgs) == 1 and "shards of different quantizations" in msgs[0] and "m-00003-of-00003" in msgs[0]
    with pytest.raises(ModelFileError, match="different quantizations"):
        GGUFModel.open(q8[0])


def _insert_kv(path: Path, key: str, vtype: int, value: bytes) -> None:
    raw = bytearray(path.read_bytes())
    (n_kv,) = struct.unpack_from("<Q", raw, 16)
    raw[24:24] = _s(key.encode()) + struct.pack("<I", vtype) + value
    struct.pack_into("<Q", raw, 16, n_kv + 1)
    path.write_bytes(bytes(raw))


def test_split_shards_whose_shared_metadata_differ_are_refused(tmp_path):
    """Writers that repeat metadata in every shard: a key both carry must agree (here the
    quantization, general.file_type 7 = Q8_0 against 15 = Q4_K_M)."""
    shards = write_moe_gguf(tmp_path / "m.gguf", split_max_tensors=8)
    _insert_kv(shards[0], "general.file_type", 4, struct.pack("<I", 7))
    _insert_kv(shards[1], "general.file_type", 4, struct.pack("<I", 15))
    _insert_kv(shards[2], "general.file_type", 4, struct.pack("<I", 7))
    rep = verdict(shards[0])
    msgs = [p.message for p in rep.problems if p.kind == "foreign_shard"]
    assert len(msgs) == 1 and "m-00002-of-00003.gguf does not match" in msgs[0]
    assert "general.file_type is 15 there and 7 in the first shard" in msgs[0] and "fingerprint" in msgs[0]


def test_the_catalog_records_each_shards_identity(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    m = GGUFModel.open(path)
    st = path.stat()
    assert m.shards[0].identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def test_fuzzed_headers_never_crash_hang_or_balloon(tmp_path):
    """10,000 mutated headers of real files through the `check` logic, in this process (module
    tests/support/gguf_fuzz.py); the case count, time and exit codes are printed (-s shows them)."""
    from tests.support.gguf_fuzz import default_seeds, run_fuzz

    seeds, weights = default_seeds(tmp_path / "seeds")
    rep = run_fuzz(seeds, 10_000, seed=15, workdir=tmp_path / "cases", weights=weights)
    print(f"gguf fuzz: {rep.cases} cases in {rep.seconds:.1f} s ({rep.cpu_seconds:.1f} s CPU) over "
          f"{[s.name for s in seeds]}; exit codes {rep.exit_codes}; slowest {rep.slowest_s:.3f} s")
    assert rep.cases == 10_000
    assert not rep.failures, "\n".join(rep.failures[:20])
    assert set(rep.exit_codes) <= {0, 3, 4} and rep.exit_codes.get(0, 0) > 0 and rep.exit_codes.get(3, 0) > 0


def test_the_fuzz_finds_the_old_crashers():
    """The mutator produces the known crasher shapes (so a regression would be found)."""
    import random

    from tests.support.gguf_fuzz import Seed, mutate, walk_header

    (path,) = write_moe_gguf(Path(__import__("tempfile").mkdtemp()) / "m.gguf")
    raw = path.read_bytes()
    fields, end = walk_header(raw)
    seed = Seed("m", raw[:end], len(raw), fields)
    kinds = {mutate(seed, random.Random(i))[1].split("@")[0] for i in range(400)}
    assert {"nest1000", "float_value", "array_count", "name_len", "n_dims", "truncate"} <= kinds
