"""``mha2mla eval`` as a function: evaluate models (and a baseline) with the same settings, then report."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import lm_eval
import torch

from mha2mla import UserError, __version__
from mha2mla.evaluation.harness import evaluate_model, normalize_limit
from mha2mla.evaluation.loading import LoadedModel, check_model_spec, default_device, load_model
from mha2mla.evaluation.measure import forward_throughput, kv_cache_size, parameter_counts
from mha2mla.evaluation.report import write_report
from mha2mla.evaluation.tasks import check_tasks, parse_task_list, task_manager

log = logging.getLogger(__name__)

PROMPT_TOKENS = 512  # tokens of held-out KJV text used for the KV-cache and throughput measurements
CONVERSION_REPORT = "conversion_report.json"


def measurement_prompt(tokenizer, model, num_tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    """(1, T) token ids of held-out KJV text, T capped by the model's context length."""
    from mha2mla.data.assets import held_out_token_ids

    limit = getattr(model.config, "max_position_embeddings", None) or num_tokens
    ids = held_out_token_ids(tokenizer, "kjv", num_tokens=min(num_tokens, limit))
    return torch.tensor([ids], dtype=torch.long)


def measure(model, tokenizer, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """KV cache per token, parameter counts, forward throughput and dtype of a loaded model."""
    prompt = measurement_prompt(tokenizer, model, prompt_tokens)
    return {
        **kv_cache_size(model, prompt),
        **parameter_counts(model),
        "tokens_per_second": forward_throughput(model, prompt),
        "prompt_tokens": prompt.shape[1],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def read_conversion_report(path: str | Path) -> dict | None:
    """The ``conversion_report.json`` next to a converted checkpoint, or None (absent or unreadable)."""
    file = Path(path) / CONVERSION_REPORT
    if not file.is_file():
        return None
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        log.warning("ignoring %s: %s", file, error)
        return None
    if not isinstance(report, dict) or not isinstance(report.get("layers"), list):
        log.warning("ignoring %s: it has no list of layers", file)
        return None
    return report


def evaluate_loaded(
    loaded: LoadedModel,
    tasks: list[str],
    role: str = "model",
    limit: float | None = None,
    batch_size: int = 1,
    seed: int = 1234,
    manager=None,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict:
    """Tasks plus measurements for one loaded model, as a result dict for ``report.write_report``."""
    evaluation = evaluate_model(
        loaded.model,
        loaded.tokenizer,
        tasks,
        limit=limit,
        batch_size=batch_size,
        seed=seed,
        task_manager=manager,
    )
    result = {
        "name": loaded.name,
        "path": loaded.path,
        "kind": loaded.kind,
        "role": role,
        "measurements": measure(loaded.model, loaded.tokenizer, prompt_tokens),
        "tasks": evaluation["results"],
        "shown": evaluation["shown"],
        "n_samples": evaluation["n_samples"],
    }
    report = read_conversion_report(loaded.path) if loaded.kind == "folder" else None
    if report is not None:
        result["conversion_report"] = report
    return result


def _unique_names(results: list[dict]) -> None:
    seen: dict[str, int] = {}
    for result in results:
        count = seen.get(result["name"], 0)
        seen[result["name"]] = count + 1
        if count:
            result["name"] = f"{result['name']} ({count + 1})"


def run_eval(
    models: list[str],
    baseline: str | None = None,
    tasks: str | list[str] | None = None,
    limit: float | None = None,
    out: str | Path = "eval",
    device: str | None = None,
    batch_size: int = 1,
    seed: int = 1234,
    dtype: str = "auto",
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict:
    """Evaluate ``models`` and the optional ``baseline`` on the same tasks, limit and seed; write the report to ``out``.

    Models are loaded one at a time (folder, ``.gguf`` file, ``"default"`` or hub id). Returns the report dict
    (``settings``, ``models``, ``table``, ``plots``, ``markdown``).
    """
    if not models:
        raise UserError("no model given; pass a model folder or a .gguf file.")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}.")
    task_names = parse_task_list(tasks)
    limit = normalize_limit(limit)
    specs = ([(baseline, "source")] if baseline else []) + [(spec, "model") for spec in models]
    for spec, _ in specs:  # fail on a bad path before the slow parts
        check_model_spec(spec)
    manager = task_manager()
    check_tasks(task_names, manager)  # fail on a bad task name before loading any model
    device = device or default_device()
    results = []
    for index, (spec, role) in enumerate(specs, start=1):
        loaded = load_model(spec, dtype=dtype, device=device)
        log.info("[%d/%d] evaluating %s on %s", index, len(specs), loaded.name, ", ".join(task_names))
        results.append(
            evaluate_loaded(
                loaded,
                task_names,
                role=role,
                limit=limit,
                batch_size=batch_size,
                seed=seed,
                manager=manager,
                prompt_tokens=prompt_tokens,
            )
        )
        del loaded
        gc.collect()
    _unique_names(results)
    settings = {
        "tasks": task_names,
        "limit": limit,
        "seed": seed,
        "batch_size": batch_size,
        "device": device,
        "dtype": dtype,
        "include_path": str(manager.include_path),
        "mha2mla_version": __version__,
        "lm_eval_version": lm_eval.__version__,
    }
    return write_report(results, settings, Path(out))
