"""WeightStore.load_simple: every tensor's bytes as in the file, and a file that ends early
named with the offset (the same read loop as fastload: moe_service.memory.pread_full)."""

from __future__ import annotations

import pytest

from moe_service.errors import ModelFileError
from moe_service.gguf_model import GGUFModel
from moe_service.weights import WeightStore
from tests.support.gguf_factory import write_moe_gguf


def test_load_simple_reads_every_tensor_of_every_shard(tmp_path):
    paths = write_moe_gguf(tmp_path / "m.gguf", split_max_tensors=7, extra_tensors=3)
    assert len(paths) > 1
    cat = GGUFModel.open(paths[0])
    store = WeightStore.load_simple(cat)
    for t in cat.tensors.values():
        with open(cat.shards[t.shard].path, "rb") as f:
            f.seek(t.file_offset)
            assert store.tensor(t.name).tobytes() == f.read(t.nbytes), t.name


def test_load_simple_names_a_file_that_ends_early(tmp_path):
    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    cat = GGUFModel.open(path)
    last = list(cat.tensors.values())[-1]
    with open(path, "r+b") as f:
        f.truncate(last.file_offset + 10)  # cut after the catalog was read
    with pytest.raises(ModelFileError, match=rf"{path}: file ends at byte {last.file_offset + 10} but "
                                             rf"{last.nbytes - 10} more bytes were expected"):
        WeightStore.load_simple(cat)
