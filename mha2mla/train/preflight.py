"""Everything a user can get wrong about a recovery run, checked before anything loads or OUT is touched, in one
place: the model folder (and the teacher: a folder, a ``.gguf`` file or a hub id), OUT (not an input, not above the
current folder, writable), the run folder's state and the checkpoint to resume (state/resume.py), and the memory the
run needs on its device (memory.py), which decides its activation checkpointing once (``auto``). What the checks read
comes back as the run's ``Plan``; its estimate is logged (``log_estimate``) once the run's data has read, so that a
bad input is the only line a refused run prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import check_model_folder, source_kind
from mha2mla.io.output import check_destination
from mha2mla.train.config import RecoverConfig
from mha2mla.train.devices import Devices
from mha2mla.train.memory import SizedRun, check_run_memory, meta_counts
from mha2mla.train.model.student import STUDENT_HINT
from mha2mla.train.model.teacher import TEACHER_HINT
from mha2mla.train.model.trainable import ParameterCounts
from mha2mla.train.state.resume import restore


@dataclass(frozen=True)
class Plan:
    """What the checks found: the model's config.json, the run's optimizer steps (over every process), its
    outcome settings (what a resumed run must share), the checkpoint it resumes from and what that holds (None:
    a fresh run), the parameter counts of the estimate, and the run sized: its settings with the activation
    checkpointing decided (``sized.config``, what the run trains with), the estimate and why."""

    model_config: dict
    total_steps: int
    settings: dict
    resume_from: Path | None
    saved: dict | None
    counts: ParameterCounts
    sized: SizedRun

    @property
    def config(self) -> RecoverConfig:
        return self.sized.config


def preflight(config: RecoverConfig, resume: str | None, devices: Devices) -> Plan:
    """Check ``config``'s inputs, OUT and the resume point (``resume``: None, ``"auto"`` or a checkpoint folder)
    and refuse, in one sentence, a run that would fail or not fit on ``devices``; nothing is logged."""
    total_steps = config.total_steps(devices.world)
    settings = config.outcome_fields()
    model_config = check_model_folder(config.model, hint=STUDENT_HINT)
    if config.teacher is not None:  # a folder, a .gguf file or a hub id (downloaded when it loads)
        try:
            teacher_kind = source_kind(config.teacher)
        except UserError as error:
            raise UserError(f"--teacher: {error}") from None
        if teacher_kind == "folder":
            check_model_folder(config.teacher, hint=TEACHER_HINT)
    inputs = [("the model being recovered", config.model), ("the teacher", config.teacher)]
    inputs += [("the training data", spec) for spec in config.data or []]
    inputs += [("the held-out data", spec) for spec in config.eval_data or []]
    check_destination(config.out_path, inputs, name="--out")  # refused before any training, not at export
    resume_from, saved = restore(config, resume, settings, total_steps, devices.rank)
    counts = meta_counts(config)
    sized = check_run_memory(config, counts, total_steps, devices)
    return Plan(model_config, total_steps, settings, resume_from, saved, counts, sized)
