"""``mha2mla eval`` as a function: evaluate models (and a baseline) with the same settings, then report."""

from __future__ import annotations

import gc
import json
import logging
from importlib import resources
from pathlib import Path

import lm_eval
import torch

from mha2mla import UserError, __version__
from mha2mla.data.held_out import text_token_ids
from mha2mla.devices import resolve_device
from mha2mla.evaluation.harness import evaluate_model, normalize_limit
from mha2mla.evaluation.loading import LoadedModel, check_model_spec, load_model
from mha2mla.evaluation.measure import forward_throughput, kv_cache_size, parameter_counts
from mha2mla.evaluation.perplexity import text_perplexity
from mha2mla.evaluation.report import write_report
from mha2mla.evaluation.tasks import check_tasks, parse_task_list, task_manager
from mha2mla.io.output import check_results_folder, write_errors

log = logging.getLogger(__name__)

PROMPT_TOKENS = 512  # tokens of the bundled sample text used for the KV-cache and throughput measurements
TEXT_TOKENS = 16384  # tokens of a --text file scored for perplexity (from its start)
CONVERSION_REPORT = "conversion_report.json"
DEFAULT_OUT = "eval"


def measurement_prompt(tokenizer, model, num_tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    """(1, T) token ids from the start of the bundled sample text (shipped, so it works on every machine),
    T capped by the model's context length. KV size and speed don't depend on which text it is."""
    limit = getattr(model.config, "max_position_embeddings", None) or num_tokens
    sample = Path(str(resources.files("mha2mla.data").joinpath("calibration_sample.txt")))
    ids = text_token_ids(tokenizer, sample, min(num_tokens, limit))
    return torch.tensor([ids], dtype=torch.long)


def text_task_name(path: str | Path) -> str:
    """The table row of a --text file: ``text:<file name>``."""
    return f"text:{Path(path).name}"


def check_text_file(path: str | Path) -> Path:
    """Fail early on a --text path that is not a readable file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--text {path} is not a file; pass the path of a UTF-8 text file.")
    return path


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
    text: str | Path | None = None,
    text_tokens: int = TEXT_TOKENS,
) -> dict:
    """Tasks, the optional --text perplexity and measurements for one loaded model, as a result dict for
    ``report.write_report``. ``tasks`` may be empty when only ``text`` is scored."""
    evaluation = {"results": {}, "shown": [], "n_samples": {}}
    if tasks:
        evaluation = evaluate_model(
            loaded.model,
            loaded.tokenizer,
            tasks,
            limit=limit,
            batch_size=batch_size,
            seed=seed,
            task_manager=manager,
        )
    if text is not None:
        name = text_task_name(text)
        scored = text_perplexity(loaded.model, loaded.tokenizer, text, max_tokens=text_tokens, batch_size=batch_size)
        evaluation["results"][name] = {"token_perplexity": scored["token_perplexity"]}
        evaluation["shown"].append(name)
        evaluation["n_samples"][name] = scored["tokens"]
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


def check_eval_out(out: str | Path) -> None:
    """Refuse an --out that cannot take the report before any model is evaluated."""
    check_results_folder(out, "results.json, results.md and the plots")


def _unique_names(results: list[dict]) -> None:
    seen: dict[str, int] = {}
    for result in results:
        count = seen.get(result["name"], 0)
        seen[result["name"]] = count + 1
        if count:
            result["name"] = f"{result['name']} ({count + 1})"


def _check_settings(models: list[str], batch_size: int, text, text_tokens: int) -> Path | None:
    if not models:
        raise UserError("no model given; pass a model folder or a .gguf file.")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}.")
    if text_tokens < 2:
        raise UserError(f"--text-tokens must be at least 2, got {text_tokens}.")
    return None if text is None else check_text_file(text)


def run_eval(
    models: list[str],
    baseline: str | None = None,
    tasks: str | list[str] | None = None,
    limit: float | None = None,
    out: str | Path = DEFAULT_OUT,
    device: str | None = None,
    batch_size: int = 1,
    seed: int = 1234,
    dtype: str = "auto",
    prompt_tokens: int = PROMPT_TOKENS,
    text: str | Path | None = None,
    text_tokens: int = TEXT_TOKENS,
) -> dict:
    """Evaluate ``models`` and the optional ``baseline`` on the same tasks, limit and seed; write the report to ``out``.

    Models are loaded one at a time (folder, ``.gguf`` file, ``"default"`` or hub id). ``tasks`` None means the
    bundled tasks available here, or none when ``text`` (a text file scored for token perplexity) is given.
    Returns the report dict (``settings``, ``models``, ``table``, ``plots``, ``markdown``).
    """
    text = _check_settings(models, batch_size, text, text_tokens)
    device = resolve_device(device)
    check_eval_out(out)
    task_names = [] if tasks is None and text is not None else parse_task_list(tasks)
    limit = normalize_limit(limit)
    specs = ([(baseline, "source")] if baseline else []) + [(spec, "model") for spec in models]
    for spec, _ in specs:  # fail on a bad path before the slow parts
        check_model_spec(spec)
    manager = task_manager() if task_names else None
    if task_names:
        check_tasks(task_names, manager)  # fail on a bad task name before loading any model
    results = []
    for index, (spec, role) in enumerate(specs, start=1):
        loaded = load_model(spec, dtype=dtype, device=device)
        scored = ", ".join(task_names + ([text_task_name(text)] if text else []))
        log.info("[%d/%d] evaluating %s on %s", index, len(specs), loaded.name, scored)
        results.append(
            evaluate_loaded(
                loaded, task_names, role=role, limit=limit, batch_size=batch_size, seed=seed, manager=manager,
                prompt_tokens=prompt_tokens, text=text, text_tokens=text_tokens,
            )
        )
        del loaded
        gc.collect()
    _unique_names(results)
    settings = {
        "tasks": task_names,
        "text": None if text is None else str(text.resolve()),
        "text_tokens": None if text is None else text_tokens,
        "limit": limit,
        "seed": seed,
        "batch_size": batch_size,
        "device": device,
        "dtype": dtype,
        "include_path": None if manager is None else str(manager.include_path),
        "mha2mla_version": __version__,
        "lm_eval_version": lm_eval.__version__,
    }
    with write_errors(Path(out)):
        return write_report(results, settings, Path(out))
