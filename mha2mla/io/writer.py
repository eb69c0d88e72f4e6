"""Sharded safetensors writer, capped in bytes per shard, with the Hugging Face index json.

Tensors are streamed to a spool file as they arrive (memory stays near one tensor, whatever the
model size); :meth:`ShardedWriter.finish` lays the shards out from the spool: each shard is the
safetensors header (8-byte little-endian length + JSON, padded to 8 bytes) followed by the raw
tensor bytes in the order they were added.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2mla.io.model_folder import INDEX_FILE, SINGLE_FILE

SPOOL_FILE = ".tensors.spool"

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: list[int]
    spool_offset: int
    nbytes: int


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor (bf16 through an int16 view, which numpy lacks)."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def _header(entries: list[_Entry]) -> bytes:
    """The safetensors header of ``entries`` laid out back to back in their order: 8-byte little-endian length, then
    the JSON padded with spaces to 8 bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in entries:
        header[entry.name] = {"dtype": entry.dtype, "shape": entry.shape, "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded


def write_safetensors(handle, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as one safetensors file into the open binary file ``handle``, a tensor at a time: memory holds at
    most one tensor's bytes beside the tensors (safetensors' own ``save`` builds the whole file in memory first)."""
    entries = [_Entry(name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape), 0, tensor.numel() * tensor.element_size())
               for name, tensor in tensors.items()]
    handle.write(_header(entries))
    for tensor in tensors.values():
        handle.write(tensor_bytes(tensor))


class ShardedWriter:
    """``add`` tensors one by one; ``finish`` writes ``model.safetensors`` (one shard) or
    ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``."""

    def __init__(self, folder: str | Path, max_shard_bytes: int = 2 * 1024**3, dtype: torch.dtype | None = None):
        self.folder = Path(folder)
        self.dtype = dtype  # every floating tensor is written in this dtype (None: as given)
        self.max_shard_bytes = max_shard_bytes
        self._spool = open(self.folder / SPOOL_FILE, "wb")
        self._shards: list[list[_Entry]] = [[]]
        self._shard_bytes = 0
        self._names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self._names, f"duplicate tensor {name}"
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        data = tensor_bytes(tensor)
        if self._shards[-1] and self._shard_bytes + len(data) > self.max_shard_bytes:
            self._shards.append([])
            self._shard_bytes = 0
        entry = _Entry(name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape), self._spool.tell(), len(data))
        self._spool.write(data)
        self._shards[-1].append(entry)
        self._shard_bytes += len(data)
        self._names.add(name)
        self.total_bytes += len(data)

    def _write_shard(self, entries: list[_Entry], path: Path, spool) -> None:
        with open(path, "wb") as out:
            out.write(_header(entries))
            for entry in entries:
                spool.seek(entry.spool_offset)
                remaining = entry.nbytes
                while remaining:
                    chunk = spool.read(min(remaining, 64 * 1024**2))
                    out.write(chunk)
                    remaining -= len(chunk)

    def finish(self) -> list[str]:
        self._spool.close()
        shards = [entries for entries in self._shards if entries]
        count = len(shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        with open(self.folder / SPOOL_FILE, "rb") as spool:
            for entries, filename in zip(shards, names):
                self._write_shard(entries, self.folder / filename, spool)
                weight_map.update({entry.name: filename for entry in entries})
        os.remove(self.folder / SPOOL_FILE)
        # always an index, one shard too: loaders that find none glob every *.safetensors in the folder
        # (vLLM, SGLang) and would take other files, such as absorbed.safetensors, for model weights
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names

