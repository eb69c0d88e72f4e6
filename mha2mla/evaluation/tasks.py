"""Which lm-evaluation-harness tasks we can run, and the bundled ones that always run offline.

Bundled tasks are plain lm-eval YAML tasks (``dataset_path: json`` over local files), written into
``$MHA2MLA_CACHE/eval_tasks/`` at run time so their ``data_files`` can be absolute paths:

- ``kjv_ppl`` / ``python_docs_ppl``: rolling log-likelihood (perplexity) on held-out slices of the King James
  Bible and the Python 3.11 documentation, cut into documents of whole lines starting one third of the way into
  each text -- the same start point as the project's benchmarks. The texts are not shipped: ``make assets``
  fetches them into the cache (``mha2mla.io.cache``), and these two tasks exist only when they are there;
- ``mmlu_dev_mc``: the 281 MMLU dev questions shipped in ``mha2mla/data/tasks/mmlu_dev.jsonl`` (MIT licence),
  scored like lm-eval's ``mmlu``: the answer letter after the four lettered choices;
- ``mmlu_dev_cloze``: the same questions scored on the full answer text (``acc`` and ``acc_norm``), which moves
  more smoothly than letter accuracy for small models;
- the unseen-domain yardstick, on texts whose domains no healing text reads (``mha2mla.io.cache.UNSEEN_TEXTS``):
  ``fortunes_ppl`` / ``debian_policy_ppl`` cut like ``kjv_ppl``, and ``fortunes_mc`` / ``debian_policy_mc``, four-way
  "which passage continues this one" items built from the text's last third with a fixed seed
  (``continuation_items``); each exists only when its text is cached.

Each task row is labelled in-domain (it scores a text the healing text reads, ``mha2mla.io.assets.HEALING_TEXTS``)
or unseen (everything else) by ``task_domain``. The tag ``mha2mla_offline`` names the available bundled tasks. Point lm-eval's own CLI at the same tasks with
``--include_path $(python -c "from mha2mla.evaluation import bundled_task_dir; print(bundled_task_dir())")``.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import socket
from pathlib import Path

import yaml

from mha2mla import UserError
from mha2mla.evaluation.continuation_items import continuation_items
from mha2mla.io.assets import HEALING_TEXTS
from mha2mla.io.cache import CACHED_TEXTS, cache_dir, cached_held_out_text, held_out_text_path

# the MMLU dev items shipped with the package (rebuilt from lm-eval's copy by scripts/mmlu_items.py)
MMLU_DEV_FILE = Path(__file__).resolve().parent.parent / "data" / "tasks" / "mmlu_dev.jsonl"

log = logging.getLogger(__name__)

OFFLINE_TAG = "mha2mla_offline"
PERPLEXITY_TASKS = {
    "kjv_ppl": "kjv",
    "python_docs_ppl": "python_docs",
    "fortunes_ppl": "fortunes",
    "debian_policy_ppl": "debian_policy",
}
CONTINUATION_TASKS = {"fortunes_mc": "fortunes", "debian_policy_mc": "debian_policy"}
TEXT_TASKS = {**PERPLEXITY_TASKS, **CONTINUATION_TASKS}  # task -> the cached text it needs
MULTIPLE_CHOICE_TASKS = ("mmlu_dev_mc", "mmlu_dev_cloze")
BUNDLED_TASKS = (*PERPLEXITY_TASKS, *CONTINUATION_TASKS, *MULTIPLE_CHOICE_TASKS)
IN_DOMAIN, UNSEEN = "in-domain", "unseen"

# Held-out documents: whole lines, at least DOC_CHARS characters each (about 1k tokens for a 49k-vocab BPE).
NUM_DOCS = 16
DOC_CHARS = 4096
START_FRACTION = 1 / 3

_TRUE = {"1", "true", "yes", "on"}


def held_out_documents(name: str, num_docs: int = NUM_DOCS, doc_chars: int = DOC_CHARS) -> list[str]:
    """``num_docs`` documents of whole lines from held-out text ``name``, from ``START_FRACTION`` of the way in."""
    text = cached_held_out_text(name).read_text(encoding="utf-8")
    start = text.find("\n", int(len(text) * START_FRACTION)) + 1  # begin on a line boundary
    lines = text[start:].splitlines(keepends=True)
    docs, current = [], ""
    for line in lines:
        current += line
        if len(current) >= doc_chars:
            docs.append(current.rstrip("\n"))
            current = ""
            if len(docs) == num_docs:
                return docs
    raise UserError(
        f"held-out text {name!r} is too short for {num_docs} documents of {doc_chars} characters."
    )


def _json_task(task: str, data_file: Path, output_type: str) -> dict:
    """What every bundled task shares: its name, the offline tag and one JSON-lines file as the test split."""
    return {"task": task, "tag": [OFFLINE_TAG], "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data_file)}}, "test_split": "test", "output_type": output_type,
            "metadata": {"version": 1.0}}


def _perplexity_task(task: str, data_file: Path) -> dict:
    return {
        **_json_task(task, data_file, "loglikelihood_rolling"),
        "doc_to_text": "",
        "doc_to_target": "text",
        "metric_list": [  # aggregation and direction spelt out: lm-eval warns about each one left to its default
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
    }


def _continuation_task(task: str, data_file: Path) -> dict:
    return {
        **_json_task(task, data_file, "multiple_choice"),
        "doc_to_text": "context",  # field names: the passage and its four candidate continuations
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "target_delimiter": " ",  # the space the passage was cut at
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }


def _multiple_choice_task(task: str, data_file: Path) -> dict:
    common = {**_json_task(task, data_file, "multiple_choice"), "doc_to_target": "answer"}
    if task == "mmlu_dev_mc":  # lm-eval's mmlu prompt: lettered choices, the letter is scored
        return {
            **common,
            "doc_to_text": "The following are multiple choice questions (with answers) about "
            "{{subject.replace('_', ' ')}}.\n\n{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\n"
            "C. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
            "doc_to_choice": ["A", "B", "C", "D"],
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
    return {  # cloze: the question alone, each full answer text scored as a continuation
        **common,
        "doc_to_text": "Question: {{question.strip()}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }


def _write_if_changed(path: Path, content: str) -> None:
    if path.exists() and path.read_text(encoding="utf-8") == content:
        return  # unchanged: keep the mtime so the datasets cache stays valid
    part = path.with_suffix(path.suffix + ".part")
    part.write_text(content, encoding="utf-8")
    os.replace(part, path)


def available_bundled_tasks() -> list[str]:
    """The bundled tasks this machine can run: the MMLU ones always, a text's tasks when that text is cached."""
    return [task for task in BUNDLED_TASKS if task not in TEXT_TASKS or held_out_text_path(TEXT_TASKS[task]).is_file()]


def task_domain(task: str) -> str:
    """``IN_DOMAIN`` for a task scoring a text the healing text reads (``HEALING_TEXTS``), ``UNSEEN`` for any other
    task (the unseen-domain texts, MMLU, hub tasks), "" for a row that is not a task (a --text file, the model)."""
    if task in TEXT_TASKS:
        return IN_DOMAIN if TEXT_TASKS[task] in HEALING_TEXTS else UNSEEN
    return "" if task == "model" or task.startswith("text:") else UNSEEN


def missing_text_message(task: str) -> str:
    """One sentence: task ``task`` can't run because its held-out text is not in the cache."""
    name = TEXT_TASKS[task]
    return (
        f"task {task!r} needs {CACHED_TEXTS[name]} text in {held_out_text_path(name)}, which is not there; "
        "run `make assets` in the mha2mla checkout to fetch it, or score your own text with --text FILE."
    )


def bundled_task_dir() -> Path:
    """Write the available bundled task YAMLs (and held-out documents) into the cache; return the folder for lm-eval.

    A task whose text is not cached gets no files (stale ones are removed), so lm-eval never sees it.
    """
    folder = cache_dir() / "eval_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    available = available_bundled_tasks()
    for task, text_name in TEXT_TASKS.items():
        data_file, task_file = folder / f"{task}.jsonl", folder / f"{task}.yaml"
        if task not in available:
            task_file.unlink(missing_ok=True)
            data_file.unlink(missing_ok=True)
            continue
        if task in PERPLEXITY_TASKS:
            rows, config = [{"text": doc} for doc in held_out_documents(text_name)], _perplexity_task(task, data_file)
        else:
            text = cached_held_out_text(text_name).read_text(encoding="utf-8")
            rows, config = continuation_items(text), _continuation_task(task, data_file)
        _write_if_changed(data_file, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        _write_if_changed(task_file, yaml.safe_dump(config, sort_keys=False))
    for task in MULTIPLE_CHOICE_TASKS:
        config = _multiple_choice_task(task, MMLU_DEV_FILE)
        _write_if_changed(folder / f"{task}.yaml", yaml.safe_dump(config, sort_keys=False))
    return folder


def is_offline() -> bool:
    """True when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set or the Hugging Face Hub can't be reached."""
    if any(
        os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return True
    return not _hub_reachable()


@functools.lru_cache(maxsize=1)
def _hub_reachable() -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=3):
            return True
    except OSError:
        return False


def task_manager():
    """An lm-eval TaskManager that knows lm-eval's own tasks and the available bundled ones (built once per folder
    and set of bundled tasks)."""
    folder = bundled_task_dir()
    return _task_manager_for(str(folder), tuple(available_bundled_tasks()))


@functools.lru_cache(maxsize=4)
def _task_manager_for(include_path: str, bundled: tuple[str, ...]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)  # indexing ~15k task configs takes seconds: reuse it


def default_tasks() -> list[str]:
    """The bundled tasks that run here; a task whose text is not cached is left out with a warning."""
    available = available_bundled_tasks()
    missing = [task for task in TEXT_TASKS if task not in available]
    if missing:
        log.warning(
            "skipping %s: the held-out texts are not in %s (run `make assets` to fetch them, "
            "or score your own text with --text FILE)",
            ", ".join(missing),
            cache_dir() / "text",
        )
    return available


def parse_task_list(tasks: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Task names from a comma-separated string or a list (each item may itself hold commas); None gives the
    default: every bundled task available on this machine (see ``available_bundled_tasks``)."""
    if tasks is None:
        return default_tasks()
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [name.strip() for item in items for name in item.split(",") if name.strip()]
    if not names:
        raise UserError("no task names given; pass e.g. --tasks kjv_ppl,mmlu_dev_mc.")
    return list(dict.fromkeys(names))


def check_tasks(names: list[str], manager, offline: bool | None = None) -> None:
    """Raise UserError for an unknown task name, or for a hub task when the machine is offline."""
    known = set(manager.all_tasks)
    for name in names:
        if name in TEXT_TASKS and not held_out_text_path(TEXT_TASKS[name]).is_file():
            raise UserError(missing_text_message(name))
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = (
                f"did you mean {', '.join(close)}?"
                if close
                else f"bundled offline tasks: {', '.join(BUNDLED_TASKS)}."
            )
            raise UserError(f"unknown task {name!r}; {hint}")
    hub = [name for name in names if name not in BUNDLED_TASKS and name != OFFLINE_TAG]
    if hub and (is_offline() if offline is None else offline):
        raise UserError(
            f"task {hub[0]!r} downloads its data from the Hugging Face Hub but this machine is offline; "
            f"run it online or choose bundled tasks ({', '.join(BUNDLED_TASKS)})."
        )
