"""lm-evaluation-harness over a model object in memory (``HFLM(pretrained=model)``)."""

from __future__ import annotations

import logging
from unittest import mock

from mha2mla import UserError

log = logging.getLogger(__name__)

# lm-eval's closed-form stderr (acc) needs no bootstrap; 1000 draws keep perplexity stderrs cheap.
BOOTSTRAP_ITERS = 1000


def normalize_limit(limit: float | None):
    """lm-eval reads a limit below 1 as a fraction of each task, else as a number of documents."""
    if limit is None:
        return None
    if limit <= 0:
        raise UserError(f"--limit must be positive, got {limit}.")
    return float(limit) if limit < 1 else int(limit)


def clean_metrics(entry: dict) -> dict:
    """``{"acc,none": 0.3, "acc_stderr,none": 0.1, "alias": ...}`` -> ``{"acc": 0.3, "acc_stderr": 0.1}``."""
    metrics = {}
    for key, value in entry.items():
        if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
            continue
        metric, _, filter_name = key.partition(",")
        metrics[metric if filter_name in ("", "none") else key] = float(value)
    return metrics


def evaluate_model(
    model,
    tokenizer,
    tasks: list[str],
    limit: float | None = None,
    batch_size: int = 1,
    seed: int = 1234,
    task_manager=None,
    offline: bool | None = None,
) -> dict:
    """Evaluate a loaded causal LM on lm-eval ``tasks`` (names, groups or tags; bundled ones included).

    Returns ``{"results": {task: {metric: value}}, "shown": [task, ...], "n_samples": {task: n},
    "lm_eval_version": str}``; ``shown`` lists the top-level rows (a group's subtasks are folded into it).
    The same ``seed`` is used for every random source lm-eval has, so a baseline sees identical prompts.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from mha2mla.evaluation.tasks import check_tasks
    from mha2mla.evaluation.tasks import task_manager as make_task_manager

    manager = task_manager or make_task_manager()
    check_tasks(tasks, manager, offline=offline)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    # lm-eval records the git commit of the current folder by running `git describe`, whose "fatal: not a git
    # repository" reaches the user's terminal outside a repository; the results here never use that hash.
    with mock.patch("lm_eval.evaluator.get_git_commit_hash", lambda: None):
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            limit=normalize_limit(limit),
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=BOOTSTRAP_ITERS,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    return summarize(output)


def summarize(output: dict) -> dict:
    """The parts of an lm-eval result dict we keep (also used on a direct ``simple_evaluate`` output)."""
    import lm_eval

    results = {task: clean_metrics(entry) for task, entry in output["results"].items()}
    subtasks = {
        sub for group, subs in output.get("group_subtasks", {}).items() if group in results for sub in subs
    }
    shown = [task for task in results if task not in subtasks]
    n_samples = {
        task: int(n.get("effective", n.get("original", 0))) for task, n in output.get("n-samples", {}).items()
    }
    return {
        "results": results,
        "shown": shown,
        "n_samples": n_samples,
        "lm_eval_version": getattr(lm_eval, "__version__", "unknown"),
    }
