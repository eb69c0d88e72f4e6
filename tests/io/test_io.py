"""The sharded writer, the lazy reader and the GGUF cache."""

import fcntl
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mha2mla import UserError
from mha2mla.io.output import staging_path
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


def _index_folder(tmp_path, weight_map) -> Path:
    writer = ShardedWriter(tmp_path)
    writer.add("w", torch.randn(2, 2))
    writer.finish()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/passwd", "sub/model.safetensors", ".."])
def test_index_shards_stay_inside_the_source_folder(tmp_path, shard):
    with pytest.raises(UserError, match="outside"):
        LazyCheckpoint(_index_folder(tmp_path, {"w": shard}))


@pytest.mark.parametrize("index", ["{not json", "[1, 2]", '{"weight_map": {"w": 3}}'])
def test_an_unreadable_index_is_one_sentence(tmp_path, index):
    folder = _index_folder(tmp_path, {})
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(UserError, match="index"):
        LazyCheckpoint(folder)


class _FakeSaved:
    """Stands in for a dequantised model or tokenizer: ``save_pretrained`` writes one file (and can run a hook)."""

    def __init__(self, name: str, hook=None):
        self.name, self.hook = name, hook

    def save_pretrained(self, folder):
        if self.hook is not None:
            self.hook()
        (Path(folder) / self.name).write_text("{}")


@pytest.fixture
def gguf_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_gguf_cache_keeps_a_concurrent_winner_and_cleans_stale_staging(gguf_file, monkeypatch):
    from mha2mla.io import source

    target = source._gguf_cache_folder(gguf_file)
    target.parent.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parts = staging_path(target).name.split(".")
    stale = target.parent / ".".join([*parts[:-3], str(dead.pid), *parts[-2:]])
    stale.mkdir()  # what a dequantisation killed with SIGKILL leaves

    def another_process_wins():
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(source, "load_gguf_model", lambda path: (_FakeSaved("config.json", another_process_wins),
                                                                 _FakeSaved("tokenizer.json")))
    assert source.gguf_to_folder(gguf_file) == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in target.parent.iterdir() if "mha2mla-" in p.name) == []  # ours and the stale one


def test_gguf_cache_fills_once_under_a_lock(gguf_file, monkeypatch):
    from mha2mla.io import source

    calls = []
    monkeypatch.setattr(source, "load_gguf_model", lambda path: calls.append(path) or (_FakeSaved("config.json"),
                                                                                      _FakeSaved("tokenizer.json")))
    target = source._gguf_cache_folder(gguf_file)
    target.parent.mkdir(parents=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process is dequantising
        waiting = threading.Thread(target=source.gguf_to_folder, args=(gguf_file,))
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and not calls  # it waits instead of dequantising a second time
        target.mkdir()
        (target / "config.json").write_text("{}")
    waiting.join(10)
    assert not waiting.is_alive() and not calls
    assert source.gguf_to_folder(gguf_file) == target and not calls


def test_write_safetensors_streams_a_file_safetensors_reads_back(tmp_path):
    """The checkpoints' writer: every dtype it names, a scalar and an empty tensor, read back by safetensors itself."""
    from safetensors.torch import load_file

    from mha2mla.io.writer import write_safetensors

    torch.manual_seed(0)
    tensors = {"b.weight": torch.randn(5, 3, dtype=torch.bfloat16), "a.float": torch.randn(7),
               "c.half": torch.randn(2, 2).half(), "d.double": torch.randn(3, dtype=torch.float64),
               "e.long": torch.arange(4), "f.mask": torch.tensor([True, False, True]), "g.scalar": torch.tensor(2.5),
               "h.empty": torch.zeros(0, 4)}
    with open(tmp_path / "t.safetensors", "wb") as handle:
        write_safetensors(handle, tensors)
    back = load_file(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
