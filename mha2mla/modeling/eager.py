"""Eager attention on demand: transformers' eager softmax returns the attention probabilities, which sdpa does not."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def eager_attention(*configs):
    """Run the attention of these configs' modules with eager softmax (it returns the probabilities)."""
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = "eager"
        yield
    finally:
        for config, implementation in zip(configs, saved):
            config._attn_implementation = implementation
