"""The sharded writer and the lazy reader."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mha2mla import UserError
from mha2mla.io.reader import LazyCheckpoint
from mha2mla.io.writer import ShardedWriter


@pytest.mark.parametrize("cap", [10**9, 300])
def test_writer_round_trips_every_dtype(tmp_path, cap):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.randn(2, 2, 2).to(torch.float16),
        "d": torch.arange(6, dtype=torch.int64).view(2, 3),
        "e": torch.randn(40, 4, dtype=torch.float64),
    }
    writer = ShardedWriter(tmp_path, max_shard_bytes=cap)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    names = writer.finish()
    assert (len(names) == 1) == (cap == 10**9)
    loaded = {}
    for name in names:
        loaded.update(load_file(str(tmp_path / name)))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    if len(names) > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
    assert not list(tmp_path.glob(".*spool"))


def test_reader_reads_sharded_checkpoints_lazily(tmp_path):
    writer = ShardedWriter(tmp_path, max_shard_bytes=100)
    tensors = {f"t{i}": torch.randn(10) for i in range(5)}
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.finish()
    (tmp_path / "config.json").write_text("{}")
    checkpoint = LazyCheckpoint(tmp_path)
    assert set(checkpoint.weight_map) == set(tensors)
    assert torch.equal(checkpoint.get("t3"), tensors["t3"])
    with pytest.raises(UserError, match="missing"):
        checkpoint.get("nope")


def test_reader_checks_shapes_and_reads_optional_tensors(tmp_path):
    writer = ShardedWriter(tmp_path)
    writer.add("w", torch.randn(4, 3).to(torch.bfloat16))
    writer.add("bad", torch.tensor([1.0, float("nan")]))
    writer.finish()
    (tmp_path / "config.json").write_text("{}")
    checkpoint = LazyCheckpoint(tmp_path)
    assert "w" in checkpoint and "b" not in checkpoint
    assert checkpoint.get("w", shape=(4, 3)).dtype == torch.float32
    assert checkpoint.get("w", dtype=None, shape=[4, 3]).dtype == torch.bfloat16  # None keeps the stored dtype
    with pytest.raises(UserError, match=r"has shape \(4, 3\) but its config.json implies \(3, 4\)"):
        checkpoint.get("w", shape=(3, 4))
    assert checkpoint.optional("b", shape=(4,)) is None
    assert torch.equal(checkpoint.optional("w", dtype=None), checkpoint.get("w", dtype=None))
    with pytest.raises(UserError, match=r"shape"):
        checkpoint.optional("w", shape=(12,))
    with pytest.raises(UserError, match="NaN"):
        checkpoint.get("bad")


def test_reader_refuses_pickles(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UserError, match="pickle"):
        LazyCheckpoint(tmp_path)
