"""Lazy, tensor-at-a-time reading of a Hugging Face safetensors checkpoint (single file or sharded).

The one checkpoint reader of the package: ``convert`` reads its source through it (docs/convert.md) and the
latent-cache model its converted checkpoint (docs/generate.md), which asks for expected shapes and optional tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from mha2mla import UserError
from mha2mla.io.model_folder import INDEX_FILE, SINGLE_FILE, check_safetensors_file, read_config, read_index


class LazyCheckpoint:
    """Maps tensor names to the shard holding them and reads one tensor at a time with ``safe_open``.

    Peak memory while converting stays near one layer's tensors plus the embeddings.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: dict[str, object] = {}
        self.config = read_config(self.folder)
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = read_index(index)
            missing = sorted({f for f in weight_map.values() if not (self.folder / f).exists()})
            if missing:
                raise UserError(f"{self.folder} is missing shard {missing[0]} named in {INDEX_FILE}; re-download the model.")
        elif (self.folder / SINGLE_FILE).exists():
            weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            if list(self.folder.glob("*.bin")) or list(self.folder.glob("*.pt")):
                raise UserError(
                    f"{self.folder} holds only pickle weights (.bin/.pt), which are never loaded here; "
                    "convert them to safetensors first."
                )
            raise UserError(f"{self.folder} has no {SINGLE_FILE} or {INDEX_FILE}; point at a safetensors checkpoint folder.")
        return weight_map

    def _open(self, filename: str):
        if filename not in self._handles:
            path = self.folder / filename
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types for bad headers/truncation
                raise UserError(f"{path} is not a readable safetensors file ({error}); re-download the model.") from error
            self._check_complete(path, handle)
            self._handles[filename] = handle
        return self._handles[filename]

    @staticmethod
    def _check_complete(path: Path, handle) -> None:
        """A truncated shard is caught when opened, not halfway through a conversion."""
        check_safetensors_file(path)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def __contains__(self, name: str) -> bool:
        return self.has(name)

    def get(self, name: str, dtype: torch.dtype | None = torch.float32, shape: Sequence[int] | None = None) -> torch.Tensor:
        """The tensor ``name`` converted to ``dtype`` (None keeps the stored dtype). With ``shape``, a tensor of
        another shape is a UserError (the weights do not match config.json). NaN or infinite values are refused."""
        if name not in self.weight_map:
            raise UserError(f"tensor {name} is missing from {self.folder}; the checkpoint is incomplete or of another family.")
        try:
            tensor = self._open(self.weight_map[name]).get_tensor(name)
        except UserError:
            raise
        except Exception as error:
            raise UserError(f"could not read {name} from {self.folder / self.weight_map[name]} ({error}); re-download the model.") from error
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise UserError(f"tensor {name} in {self.folder} has shape {tuple(tensor.shape)} but its config.json implies "
                            f"{tuple(shape)}; the weights and the config do not belong together.")
        if dtype is not None:
            tensor = tensor.to(dtype)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(f"tensor {name} in {self.folder} contains NaN or infinite values; the checkpoint is corrupt.")
        return tensor

    def optional(self, name: str, dtype: torch.dtype | None = torch.float32,
                 shape: Sequence[int] | None = None) -> torch.Tensor | None:
        """:meth:`get` for a tensor the checkpoint may lack (a bias): None when it is absent."""
        return self.get(name, dtype, shape) if self.has(name) else None

    def stored_dtype(self, name: str) -> torch.dtype:
        return _DTYPES.get(self._open(self.weight_map[name]).get_slice(name).get_dtype(), torch.float32)


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
