"""Activation checkpointing of the decoder layers, whole or selective (``recover --activation-checkpointing``).

- ``full``: each decoder layer keeps only its input; the backward pass runs the layer's forward again (one more
  forward per step).
- ``selective``: each layer keeps the outputs of its matrix products and of PyTorch's fused attention, the work
  that costs, and recomputes the rest in the backward pass: the RMSNorms, autocast's dtype copies of activations
  and weights, the rotary embedding, the MLP's activation and product, the residual adds. Those hold most of a
  layer's saved bytes (float32 norm inputs and outputs, one bf16 copy of a normalised input per projection, the
  gate's activation and the product) for little of its time. An attention computed by our Triton kernel
  (``mha2mla_triton``) is not an ATen operation and is recomputed.

Both give the gradients of no checkpointing: the recomputation repeats the same operations on the same inputs
(with the random state of the first pass, so LoRA's dropout masks match); tests/train/test_recover_checkpointing.py
checks it. What each keeps is counted by mha2mla/train/memory.py; their peak and speed: docs/benchmarks.md,
"Speed and memory" (benchmarks/recover_memory.py).
"""

from __future__ import annotations

import functools

import torch

MODES = ("none", "selective", "full")


@functools.cache
def _saved_operations() -> frozenset:
    """The ATen operations whose outputs a selectively checkpointed layer keeps."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def _policy(context, operation, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if operation in _saved_operations():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def enable_checkpointing(model, mode: str) -> None:
    """Checkpoint every decoder layer of ``model`` (a transformers causal LM) as ``mode`` says (see MODES)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing is one of {', '.join(MODES)}, not {mode!r}")
    if mode == "none":
        return
    settings = {"use_reentrant": False}
    if mode == "selective":
        settings["context_fn"] = _selective_contexts
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=settings)
