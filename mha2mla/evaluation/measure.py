"""Measurements taken on the model itself: KV-cache size from the cache it really builds, parameters, speed."""

from __future__ import annotations

import statistics
import time

import torch


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache holds: transformers 5 caches keep them in ``cache.layers[i].keys/values``."""
    if hasattr(cache, "layers"):
        tensors = []
        for layer in cache.layers:
            for value in vars(layer).values():
                if torch.is_tensor(value) and value.numel() > 0:
                    tensors.append(value)
        return tensors
    return [t for layer in cache for t in layer if torch.is_tensor(t)]  # legacy tuple of (keys, values)


@torch.inference_mode()
def kv_cache_size(model, input_ids: torch.Tensor) -> dict:
    """Run ``input_ids`` (B, T) with ``use_cache=True`` and measure the cache per token (summed over layers).

    Returns ``{"kv_cache_bytes_per_token", "kv_cache_values_per_token", "kv_cache_dtype"}``; values per token is
    dtype-free, so models stored in different dtypes compare on it.
    """
    input_ids = input_ids.to(model.device)
    batch, tokens = input_ids.shape  # (B, T)
    outputs = model(input_ids=input_ids, use_cache=True)
    cache = getattr(outputs, "cache", None)
    if cache is None:
        cache = outputs.past_key_values
    tensors = _cache_tensors(cache)
    if not tensors:
        raise RuntimeError(f"{type(model).__name__} returned an empty cache; can't measure its KV size.")
    total_bytes = sum(t.numel() * t.element_size() for t in tensors)
    total_values = sum(t.numel() for t in tensors)
    return {
        "kv_cache_bytes_per_token": total_bytes / (batch * tokens),
        "kv_cache_values_per_token": total_values / (batch * tokens),
        "kv_cache_dtype": str(tensors[0].dtype).replace("torch.", ""),
    }


def parameter_counts(model) -> dict:
    """Total parameters (tied weights once) and those inside attention blocks."""
    seen, total, attention = set(), 0, 0
    for name, param in model.named_parameters():  # named_parameters already skips tied duplicates
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if ".self_attn." in name or ".attention." in name:
            attention += param.numel()
    return {"parameters": total, "attention_parameters": attention}


@torch.inference_mode()
def forward_throughput(model, input_ids: torch.Tensor, repeats: int = 3) -> float:
    """Tokens per second of one full forward over ``input_ids`` (B, T), median of ``repeats`` after a warm-up."""
    input_ids = input_ids.to(model.device)
    tokens = input_ids.numel()
    model(input_ids=input_ids, use_cache=False)  # warm-up
    times = []
    for _ in range(repeats):
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=input_ids, use_cache=False)
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)
