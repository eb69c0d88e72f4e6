"""Sharded safetensors writer capped in bytes per shard, with the Hugging Face index json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


class ShardedWriter:
    """Collects tensors and flushes a shard whenever ``max_shard_bytes`` would be exceeded.

    Shards are written under provisional names and renamed to ``model-0000i-of-0000N.safetensors``
    by :meth:`finish`, which also writes the index (a single shard is named ``model.safetensors``).
    """

    def __init__(self, folder: str | Path, max_shard_bytes: int = 2 * 1024**3):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self._pending, f"duplicate tensor {name}"
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards)
        save_file(self._pending, str(self.folder / f"shard-{index}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self._flush()
        count = len(self._shards)
        names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for i, (tensor_names, filename) in enumerate(zip(self._shards, names)):
            os.replace(self.folder / f"shard-{i}.tmp", self.folder / filename)
            weight_map.update({name: filename for name in tensor_names})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names
