"""Exports of a converted checkpoint into formats other engines read (docs/engines.md)."""

from mha2mla.export.gguf import TENSOR_TYPES, export_gguf

__all__ = ["TENSOR_TYPES", "export_gguf"]
