"""``mha2mla eval`` as a function: evaluate models (and a baseline) with the same settings, then report."""

from __future__ import annotations

import gc
import logging
from importlib import resources
from pathlib import Path

import lm_eval
import torch

from mha2mla import UserError, __version__
from mha2mla.data.held_out import text_token_ids
from mha2mla.devices import resolve_device
from mha2mla.evaluation.config import PROMPT_TOKENS, EvalConfig
from mha2mla.evaluation.harness import evaluate_model, normalize_limit
from mha2mla.evaluation.loading import LoadedModel, check_model_spec, load_model
from mha2mla.evaluation.measure import forward_throughput, kv_cache_size, parameter_counts
from mha2mla.evaluation.perplexity import text_perplexity
from mha2mla.evaluation.report import check_report_folder, write_report
from mha2mla.evaluation.tasks import check_tasks, parse_task_list, task_manager
from mha2mla.io import model_folder
from mha2mla.io.model_folder import CONVERSION_REPORT
from mha2mla.io.output import user_path, what_it_is, write_errors

log = logging.getLogger(__name__)


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
    path = user_path(path)
    if not path.is_file():
        what = f"is {what_it_is(path)}" if path.exists() else "does not exist"
        raise UserError(f"--text {path} {what}; pass the path of a UTF-8 text file.")
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
    """The conversion report next to a converted checkpoint, as the dict the results carry, or None (absent or
    unreadable: a warning then)."""
    if not (Path(path) / CONVERSION_REPORT).is_file():
        return None
    report = model_folder.read_conversion_report(path)
    if report is None:
        log.warning("ignoring %s: unreadable or without a list of layers", Path(path) / CONVERSION_REPORT)
        return None
    return report.to_dict()


def evaluate_loaded(loaded: LoadedModel, tasks: list[str], config: EvalConfig, role: str = "model", manager=None,
                    text: Path | None = None) -> dict:
    """Tasks, the optional ``text`` perplexity and measurements for one loaded model under ``config``'s limit,
    batch size and seed, as a result dict for ``report.write_report``. ``tasks`` may be empty when only ``text``
    is scored."""
    evaluation = {"results": {}, "shown": [], "n_samples": {}}
    if tasks:
        evaluation = evaluate_model(
            loaded.model,
            loaded.tokenizer,
            tasks,
            limit=normalize_limit(config.limit),
            batch_size=config.batch_size,
            seed=config.seed,
            task_manager=manager,
        )
    if text is not None:
        name = text_task_name(text)
        scored = text_perplexity(loaded.model, loaded.tokenizer, text, max_tokens=config.text_tokens,
                                 batch_size=config.batch_size)
        evaluation["results"][name] = {"token_perplexity": scored["token_perplexity"]}
        evaluation["shown"].append(name)
        evaluation["n_samples"][name] = scored["tokens"]
    result = {
        "name": loaded.name,
        "path": loaded.path,
        "kind": loaded.kind,
        "role": role,
        "measurements": measure(loaded.model, loaded.tokenizer, config.prompt_tokens),
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
    check_report_folder(out)


def _unique_names(results: list[dict]) -> None:
    seen: dict[str, int] = {}
    for result in results:
        count = seen.get(result["name"], 0)
        seen[result["name"]] = count + 1
        if count:
            result["name"] = f"{result['name']} ({count + 1})"


def run_eval(config: EvalConfig) -> dict:
    """Evaluate ``config.models`` and the optional baseline on the same tasks, limit and seed; write the report to
    ``config.out``.

    Models are loaded one at a time (folder, ``.gguf`` file, ``"default"`` or hub id). No tasks means the bundled
    tasks available here, or none when ``text`` (a text file scored for token perplexity) is given.
    Returns the report dict (``settings``, ``models``, ``table``, ``plots``, ``markdown``).
    """
    text = None if config.text is None else check_text_file(config.text)
    device = resolve_device(config.device)
    check_eval_out(config.out)
    task_names = [] if config.tasks is None and text is not None else parse_task_list(config.tasks)
    specs = ([(config.baseline, "source")] if config.baseline else []) + [(spec, "model") for spec in config.models]
    for spec, _ in specs:  # fail on a bad path before the slow parts
        check_model_spec(spec)
    manager = task_manager() if task_names else None
    if task_names:
        check_tasks(task_names, manager)  # fail on a bad task name before loading any model
    results = []
    for index, (spec, role) in enumerate(specs, start=1):
        loaded = load_model(spec, dtype=config.dtype, device=device)
        scored = ", ".join(task_names + ([text_task_name(text)] if text else []))
        log.info("[%d/%d] evaluating %s on %s", index, len(specs), loaded.name, scored)
        results.append(evaluate_loaded(loaded, task_names, config, role=role, manager=manager, text=text))
        del loaded
        gc.collect()
    _unique_names(results)
    settings = {
        "tasks": task_names,
        "text": None if text is None else str(text.resolve()),
        "text_tokens": None if text is None else config.text_tokens,
        "limit": normalize_limit(config.limit),
        "seed": config.seed,
        "batch_size": config.batch_size,
        "device": device,
        "dtype": config.dtype,
        "include_path": None if manager is None else str(manager.include_path),
        "mha2mla_version": __version__,
        "lm_eval_version": lm_eval.__version__,
    }
    with write_errors(user_path(config.out)):
        return write_report(results, settings, user_path(config.out))
