"""A recovery run's record: the run folder's settings and metrics log (``train_log.jsonl``). Each function takes the
values it writes; the loop (loop.py) holds the trainer state and writes the recovery report."""

from __future__ import annotations

import json
from pathlib import Path

from mha2mla.io.model_folder import RECOVER_CONFIG
from mha2mla.io.output import remove_stale, write_errors
from mha2mla.io.written import record_written

TRAIN_LOG = "train_log.jsonl"


def logged_until(log_path: Path, step: int) -> list[str]:
    """The lines of a run's metrics log up to ``step`` (lines a kill cut short are dropped)."""
    if not log_path.is_file():
        return []
    kept = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    return kept


def open_run_folder(out: Path, settings: dict, step: int, is_main: bool = True) -> None:
    """OUT gets the run's ``settings`` (``outcome_fields()``) and a metrics log holding what was logged up to
    ``step`` (what a killed run logged after its last checkpoint is dropped, a half-written last line with it);
    checkpoints come later. Main process only; a full disk is one sentence."""
    if not is_main:
        return
    kept = logged_until(out / TRAIN_LOG, step)
    with write_errors(out):
        out.mkdir(parents=True, exist_ok=True)
        remove_stale(out)  # a checkpoint save a killed run left half-written
        (out / RECOVER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
        (out / TRAIN_LOG).write_text("".join(line + "\n" for line in kept))
        record_written(out, {RECOVER_CONFIG: None, TRAIN_LOG: None})  # so --force knows the run's own files


def append_log(out: Path, record: dict, is_main: bool = True) -> None:
    """One line of the metrics log (main process only)."""
    if is_main:
        with open(out / TRAIN_LOG, "a") as handle:
            handle.write(json.dumps(record) + "\n")
