"""Evaluation: lm-evaluation-harness tasks (hub and bundled offline ones), token perplexity of text files,
the KV-cache size a model really allocates, reports.

Library first: ``evaluate_model(model, tokenizer, tasks)`` works on any causal LM in memory, ``run_eval(EvalConfig(...))``
is what ``mha2mla eval`` calls. Everything but ``EvalConfig`` loads on first use, so reading the settings (a recipe,
``mha2mla eval --help``) needs neither torch nor the eval extra (lm-eval).
"""

from __future__ import annotations

import importlib

from mha2mla.evaluation.config import EvalConfig

_LAZY = {
    "evaluate_loaded": "run", "run_eval": "run",
    "evaluate_model": "harness",
    "LoadedModel": "loading", "load_model": "loading",
    "forward_throughput": "measure", "kv_cache_size": "measure", "parameter_counts": "measure",
    "batch_nll": "perplexity", "held_out_perplexity": "perplexity", "text_perplexity": "perplexity",
    "window_perplexity": "perplexity",
    "BUNDLED_TASKS": "tasks", "available_bundled_tasks": "tasks", "bundled_task_dir": "tasks", "check_tasks": "tasks",
    "is_offline": "tasks", "task_manager": "tasks",
}

__all__ = ["EvalConfig", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"mha2mla.evaluation.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
