"""``recover(config)``: the public entry point of recovery fine-tuning. It runs a ``RecoveryRun``
(mha2mla/train/run.py): setup, the training loop, the merged model written to OUT, cleanup."""

from __future__ import annotations

from mha2mla.train import RunInterrupted
from mha2mla.train.config import RecoverConfig
from mha2mla.train.resume import interrupted_sentence
from mha2mla.train.run import RecoveryRun


def recover(config: RecoverConfig, resume: str | None = None, show_progress: bool = True) -> dict:
    """Run recovery fine-tuning as ``config`` says and write the merged model to ``config.out``.

    ``resume``: None (fresh run; OUT must be new or empty), ``"auto"`` (continue from OUT's latest checkpoint
    if any) or a checkpoint folder. Returns the recovery report (also written to OUT/recovery_report.json). Ctrl-C
    is a :class:`RunInterrupted` saying what OUT keeps (its checkpoints stay: the run resumes from them)."""
    recipe = RecoveryRun(config, resume=resume, show_progress=show_progress)
    try:
        recipe.setup()
        report = recipe.train()
        recipe.export(report)
    except KeyboardInterrupt as interrupt:
        raise RunInterrupted(interrupted_sentence(config.out_path)) from interrupt
    finally:
        recipe.cleanup()
    return report
