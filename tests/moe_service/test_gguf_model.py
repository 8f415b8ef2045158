"""The GGUF catalog: shards, tensors, expert slabs, and every validation error, on tiny GGUFs
written by the tests with gguf.GGUFWriter."""

from __future__ import annotations

import shutil
import struct

import gguf
import numpy as np
import pytest

from moe_service.errors import ModelFileError
from moe_service.gguf_model import GGUFModel, verdict
from tests.support.gguf_factory import patch_tensor_info, write_moe_gguf
from tests.support.smollm2 import needs_smollm2


def _kinds(problems, kind):
    return [p for p in problems if p.kind == kind]


def test_single_file_matches_gguf_reader(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf", n_layer=3, n_expert=4, n_ff_exp=32, n_embd=64)
    m = GGUFModel.open(path)
    r = gguf.GGUFReader(path)
    assert list(m.tensors) == [t.name for t in r.tensors]
    for rt in r.tensors:
        t = m.tensors[rt.name]
        assert (t.file_offset, t.nbytes, t.ggml_type, t.ne) == (
            rt.data_offset,
            rt.n_bytes,
            int(rt.tensor_type),
            tuple(rt.shape.tolist()),
        )
        assert t.shape == tuple(reversed(t.ne)) and t.shard == 0
        assert t.row_bytes * t.n_rows == t.nbytes
    assert [s.index for s in m.shards] == [0] and m.shards[0].data_offset == r.data_offset
    assert m.metadata["llama.block_count"] == 3
    assert m.metadata["tokenizer.ggml.tokens"][:2] == ["tok0", "tok1"]
    p = m.params
    assert (p.arch, p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim) == ("llama", 3, 64, 4, 2, 16)
    assert (p.n_expert, p.n_expert_used, p.n_ff_exp, p.n_vocab, p.n_ctx_train) == (4, 2, 32, 40, 256)
    assert p.rope_freq_base == 10000.0 and p.rms_eps == pytest.approx(1e-5)
    assert m.total_bytes == sum(t.n_bytes for t in r.tensors)
    assert m.problems() == []


def test_expert_slabs_are_each_experts_bytes(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf", n_layer=2, n_expert=4)
    m = GGUFModel.open(path)
    r = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert sorted(m.expert_layers) == [0, 1]
    raw = path.read_bytes()
    for layer, lay in m.expert_layers.items():
        assert sorted(lay) == ["down", "gate", "up"] and lay.n_expert == 4
        for kind, et in lay.items():
            assert et.tensor.name == f"blk.{layer}.ffn_{kind}_exps.weight"
            assert et.slab_bytes * 4 == et.tensor.nbytes
            data = r[et.tensor.name].data  # [E, rows, row_bytes] uint8
            for e in range(4):
                shard, off, n = et.slab(e)
                assert shard == 0 and raw[off : off + n] == data[e].tobytes()
            with pytest.raises(IndexError):
                et.slab(4)


def test_fused_gate_up(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf", fused_gate_up=True, n_ff_exp=32)
    m = GGUFModel.open(path)
    et = m.expert_tensor(0, "gate_up")
    assert et.tensor.ne == (64, 64, 4) and sorted(m.expert_layers[0]) == ["down", "gate_up"]


def test_three_shards_found_from_shard_two(tmp_path):
    paths = write_moe_gguf(tmp_path / "m.gguf", split_max_tensors=8, n_layer=2)
    assert len(paths) == 3 and paths[1].name == "m-00002-of-00003.gguf"
    m = GGUFModel.open(paths[1])
    assert [s.path for s in m.shards] == paths and [s.index for s in m.shards] == [0, 1, 2]
    assert sum(s.n_tensors for s in m.shards) == len(m.tensors)
    assert m.metadata["general.architecture"] == "llama"  # from the first shard, not the opened one
    for t in m.tensors.values():  # each tensor's bytes are where the catalog says
        rt = next(x for x in gguf.GGUFReader(paths[t.shard]).tensors if x.name == t.name)
        assert rt.data_offset == t.file_offset
    assert {t.shard for t in m.tensors.values()} == {0, 1, 2}


def test_missing_shard_is_named(tmp_path):
    paths = write_moe_gguf(tmp_path / "m.gguf", split_max_tensors=8)
    paths[2].unlink()
    with pytest.raises(ModelFileError, match="m-00003-of-00003.gguf"):
        GGUFModel.open(paths[0])
    m = GGUFModel.open(paths[0], strict=False)
    (miss,) = m.problems()
    assert miss.kind == "missing_shard" and miss.path == paths[2]
    assert [s.index for s in m.shards] == [0, 1]


def test_file_cut_by_one_byte_names_tensor_and_shard(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    m = GGUFModel.open(path)
    last = max(m.tensors.values(), key=lambda t: t.end_offset)
    with open(path, "r+b") as f:  # the writer pads the file: cut right into the last tensor
        f.truncate(last.end_offset - 1)
    with pytest.raises(ModelFileError) as ei:
        GGUFModel.open(path)
    assert last.name in str(ei.value) and str(path) in str(ei.value) and "truncated" in str(ei.value)
    (p,) = ei.value.problems
    assert (p.kind, p.tensor, p.path) == ("truncated", last.name, path)


def test_unknown_type_id_reported_other_tensors_listed(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    n = len(GGUFModel.open(path).tensors)
    patch_tensor_info(path, "blk.1.attn_q.weight", type_id=77)
    with pytest.raises(ModelFileError, match=r"unknown ggml type id 77 .*blk\.1\.attn_q\.weight"):
        GGUFModel.open(path)
    m = GGUFModel.open(path, strict=False)
    (p,) = m.problems()
    assert p.kind == "unknown_type" and p.tensor == "blk.1.attn_q.weight"
    assert len(m.tensors) == n - 1 and "blk.1.attn_q.weight" not in m.tensors
    assert "blk.1.attn_k.weight" in m.tensors and m.expert_layers[1]["down"].n_expert == 4


def test_unsupported_known_type(tmp_path):
    (path,) = write_moe_gguf(
        tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.TQ1_0, n_embd=256, n_ff_exp=256
    )
    m = GGUFModel.open(path, strict=False)
    (p,) = m.problems()
    assert p.kind == "unsupported_type" and "TQ1_0 (id 34)" in p.message
    assert GGUFModel.open(path, supported_types=frozenset({0, 34})).problems() == []


def test_duplicate_names_in_one_file_and_across_shards(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "one.gguf", extra_tensors=2)
    patch_tensor_info(path, "extra.1", new_name="extra.0")
    m = GGUFModel.open(path, strict=False)
    assert [p.kind for p in m.problems()] == ["duplicate"] and "extra.0" in m.problems()[0].message

    paths = write_moe_gguf(tmp_path / "set.gguf", split_max_tensors=8)
    names = [n for n, t in GGUFModel.open(paths[0]).tensors.items() if t.shard == 0]
    later = [n for n, t in GGUFModel.open(paths[0]).tensors.items() if t.shard == 2]
    victim = next(b for b in later if any(len(a) == len(b) and a != b for a in names))
    twin = next(a for a in names if len(a) == len(victim))
    patch_tensor_info(paths[2], victim, new_name=twin)
    with pytest.raises(ModelFileError, match=f"{twin} appears twice"):
        GGUFModel.open(paths[1])
    (p,) = _kinds(GGUFModel.open(paths[1], strict=False).problems(), "duplicate")
    assert str(paths[0]) in p.message and str(paths[2]) in p.message


def test_shard_from_another_set(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_moe_gguf(tmp_path / "a" / "m.gguf", split_max_tensors=8)
    b = write_moe_gguf(tmp_path / "b" / "m.gguf", split_max_tensors=8, extra_tensors=1)
    assert len(a) == len(b) == 3
    shutil.copy(b[1], a[1])  # same name, same count, different total tensor count
    with pytest.raises(ModelFileError, match="split.tensors.count"):
        GGUFModel.open(a[0])
    probs = GGUFModel.open(a[0], strict=False).problems()
    assert probs and all(p.kind == "foreign_shard" for p in probs) and any(p.path == a[1] for p in probs)

    (tmp_path / "c").mkdir()
    c = write_moe_gguf(tmp_path / "c" / "m.gguf", split_max_tensors=14)  # a set of 2
    assert len(c) == 2
    shutil.copy(c[1], b[2])  # a shard of a 2-set posing as shard 3 of 3
    with pytest.raises(ModelFileError, match=r"split.count=2 but its name says it is one of 3"):
        GGUFModel.open(b[0])


def test_not_gguf_bad_version_header_cut(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFModel.open(bad)
    bad.write_bytes(b"GG")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFModel.open(bad)
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 1)
    path.write_bytes(raw)
    with pytest.raises(ModelFileError, match="unsupported GGUF version 1"):
        GGUFModel.open(path)
    raw[4:8] = struct.pack("<I", 3)
    path.write_bytes(raw[:500])  # inside the metadata
    with pytest.raises(ModelFileError, match="header cut short"):
        GGUFModel.open(path)
    with pytest.raises(ModelFileError, match="not found"):
        GGUFModel.open(tmp_path / "nope.gguf")


def test_alignment_problems(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "a.gguf", alignment=48)
    m = GGUFModel.open(path, strict=False)
    assert [p.kind for p in m.problems()] == ["alignment"] and "not a power of two" in m.problems()[0].message
    (path,) = write_moe_gguf(tmp_path / "b.gguf", alignment=64)
    assert GGUFModel.open(path).shards[0].alignment == 64
    patch_tensor_info(path, "output.weight", offset_delta=8)
    (p,) = _kinds(GGUFModel.open(path, strict=False).problems(), "alignment")
    assert "output.weight" in p.message and "64" in p.message


def test_ne0_not_multiple_of_block(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    patch_tensor_info(path, "blk.0.attn_v.weight", ne0=40)
    m = GGUFModel.open(path, strict=False)
    (p,) = m.problems()
    assert p.kind == "block_size" and "ne[0]=40" in p.message and "Q8_0" in p.message


def test_verdict_report(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf", n_layer=2)
    rep = verdict(path)
    text = "\n".join(rep.lines())
    assert rep.ok and "architecture: llama, 2 layers" in text and "experts: 4 per layer, top-2" in text
    assert "Q8_0" in text and "F32" in text and text.endswith("model files: OK")
    patch_tensor_info(path, "output.weight", type_id=99)
    rep = verdict(path)
    assert not rep.ok and "problem: " in "\n".join(rep.lines()) and "99" in rep.lines()[-2]
    (tmp_path / "junk.gguf").write_bytes(b"hello world, not a model at all")
    assert not verdict(tmp_path / "junk.gguf").ok


@needs_smollm2
def test_real_file_parity_with_gguf_reader():
    from moe_service.demo_model import smollm2_gguf_path

    smollm2 = smollm2_gguf_path()  # found the way demo_model.py finds it (importlib.metadata), no machine path
    m = GGUFModel.open(smollm2)
    r = gguf.GGUFReader(smollm2)
    got = [(t.name, t.file_offset, t.nbytes) for t in m.tensors.values()]
    assert got == [(t.name, t.data_offset, int(t.n_bytes)) for t in r.tensors]
    for key, fld in r.fields.items():
        if not key.startswith("GGUF."):
            assert np.all(np.asarray(m.metadata[key]) == np.asarray(fld.contents())), key
    assert m.params.n_vocab == 49152 and m.params.n_layer == 30 and not m.expert_layers
