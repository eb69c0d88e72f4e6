"""Evaluation: lm-evaluation-harness tasks (hub and bundled offline ones), token perplexity of text files,
measured KV-cache size, reports.

Library first: ``evaluate_model(model, tokenizer, tasks)`` works on any causal LM in memory, ``run_eval`` is
what ``mha2mla eval`` calls.
"""

from mha2mla.evaluation.compare import evaluate_loaded, measure, run_eval
from mha2mla.evaluation.harness import evaluate_model
from mha2mla.evaluation.loading import LoadedModel, load_model
from mha2mla.evaluation.measure import forward_throughput, kv_cache_size, parameter_counts
from mha2mla.evaluation.perplexity import batch_nll, held_out_perplexity, text_perplexity, window_perplexity
from mha2mla.evaluation.tasks import (
    BUNDLED_TASKS,
    available_bundled_tasks,
    bundled_task_dir,
    check_tasks,
    is_offline,
    task_manager,
)

__all__ = [
    "BUNDLED_TASKS",
    "LoadedModel",
    "available_bundled_tasks",
    "batch_nll",
    "bundled_task_dir",
    "check_tasks",
    "evaluate_loaded",
    "evaluate_model",
    "forward_throughput",
    "held_out_perplexity",
    "is_offline",
    "kv_cache_size",
    "load_model",
    "measure",
    "parameter_counts",
    "run_eval",
    "task_manager",
    "text_perplexity",
    "window_perplexity",
]
