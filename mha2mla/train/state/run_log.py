"""A recovery run's record: the run folder's settings and metrics log (``train_log.jsonl``) and the recovery report.
Each function takes the values it writes; the loop (loop.py) holds the trainer state."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mha2mla.io.model_folder import RECOVER_CONFIG
from mha2mla.io.output import remove_stale, write_errors
from mha2mla.io.written import record_written

log = logging.getLogger(__name__)

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


def log_evaluation(out: Path, evaluation: dict, is_main: bool = True) -> None:
    """An evaluation (step, tokens, perplexity) in the metrics log and the run's log."""
    append_log(out, {"step": evaluation["step"], "tokens": evaluation["tokens"],
                     "eval_perplexity": evaluation["perplexity"]}, is_main)
    if is_main:
        log.info("step %d: held-out perplexity %.3f", evaluation["step"], evaluation["perplexity"])


def recovery_report(state: dict, parameter_counts: tuple[int, int], world: int, compute_dtype: str,
                    resumed_from: Path | None) -> dict:
    """The recovery report (``OUT/recovery_report.json``): curves, throughput, what trained, how it ran."""
    trainable, total = parameter_counts
    return {
        "steps": state["step"],
        "tokens_trained": state["tokens_trained"],
        "final_loss": state["losses"][-1] if state["losses"] else None,
        "losses": state["losses"],
        "evaluations": state["evaluations"],
        "seconds": state["train_seconds"],
        "tokens_per_second": state["tokens_trained"] / max(state["train_seconds"], 1e-9),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "num_processes": world,
        "compute_dtype": compute_dtype,  # as resolved for the device (bfloat16: bf16 autocast)
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
    }
