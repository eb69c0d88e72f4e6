"""A recovery run's record: its settings and metrics log in the run folder (``train_log.jsonl``, what a killed run
logged after its last checkpoint dropped on resume), the step counters and the progress bar's line. Functions of
the run (``RecoveryRun``, run.py), which holds the state."""

from __future__ import annotations

import json
import logging

from mha2mla.io.model_folder import RECOVER_CONFIG
from mha2mla.io.output import remove_stale, write_errors
from mha2mla.train.resume import logged_until

log = logging.getLogger(__name__)

TRAIN_LOG = "train_log.jsonl"


def open_run_folder(run) -> None:
    """OUT gets the run's settings and a metrics log (what a killed run logged after its last checkpoint is
    dropped, a half-written last line with it); checkpoints come later. A full disk is one sentence."""
    out, log_path = run.config.out_path, run.config.out_path / TRAIN_LOG
    if run.is_main:
        with write_errors(out):
            out.mkdir(parents=True, exist_ok=True)
            remove_stale(out)  # a checkpoint save a killed run left half-written
            (out / RECOVER_CONFIG).write_text(json.dumps(run.config.outcome_fields(), indent=2) + "\n")
            kept = logged_until(log_path, run.state["step"])
            log_path.write_text("".join(line + "\n" for line in kept))
    run.accelerator.wait_for_everyone()

def record_step(run, result: dict[str, float], elapsed: float) -> None:
    state, tokens = run.state, run.rows_per_step * run.config.seq_len
    state["step"] += 1
    state["rows_consumed"] += run.rows_per_step
    state["tokens_trained"] += tokens
    state["train_seconds"] += elapsed
    state["losses"].append(result["loss"])
    record = {"step": state["step"], "tokens": state["tokens_trained"], "loss": result["loss"],
              "lm_loss": result["lm_loss"], "lr": result["lr"], "tokens_per_second": tokens / elapsed}
    record.update({key: result[key] for key in ("distill_loss",) if key in result})
    write_log(run, record)
    run._progress.update(1)
    perplexity = f" | ppl {state['evaluations'][-1]['perplexity']:.2f}" if state["evaluations"] else ""
    run._progress.set_postfix_str(f"loss {result['loss']:.3f} | {record['tokens_per_second']:.0f} tok/s{perplexity}")

def evaluate_and_log(run, step: int) -> None:
    perplexity = run.evaluate()
    if perplexity is None:
        return
    tokens = run.state["tokens_trained"]
    run.state["evaluations"].append({"step": step, "tokens": tokens, "perplexity": perplexity})
    write_log(run, {"step": step, "tokens": tokens, "eval_perplexity": perplexity})
    if run.is_main:
        log.info("step %d: held-out perplexity %.3f", step, perplexity)

def write_log(run, record: dict) -> None:
    if run.is_main:
        with open(run.config.out_path / TRAIN_LOG, "a") as handle:
            handle.write(json.dumps(record) + "\n")
