"""``recover(config)``: the public entry point of recovery fine-tuning, the run read top to bottom: the devices and
compute dtype (devices.py), the checks (preflight.py, which also decides the activation checkpointing and reads the
checkpoint to resume), the tokenizer (io/loader.py) and teacher (model/teacher.py), the training and held-out rows
(data/rows.py), the memory estimate logged, the student and what trains of it (model/student.py,
model/trainable.py), the ``RecoveryRun`` that trains it (loop.py) in its run folder (state/run_log.py,
state/checkpoint.py), and the merged model written to OUT (model/merge.py)."""

from __future__ import annotations

import gc
import logging

import torch
from accelerate.utils import set_seed

from mha2mla.io.loader import load_tokenizer
from mha2mla.modeling.checkpointing import enable_checkpointing
from mha2mla.train import RunInterrupted
from mha2mla.train.config import RecoverConfig
from mha2mla.train.data.rows import prepare_rows
from mha2mla.train.devices import start_devices
from mha2mla.train.loop import RecoveryRun
from mha2mla.train.memory import log_estimate
from mha2mla.train.model.student import STUDENT_HINT, build_student
from mha2mla.train.model.teacher import load_teacher
from mha2mla.train.model.trainable import check_trainable_shapes, load_trainable_state, make_trainable
from mha2mla.train.preflight import preflight
from mha2mla.train.state.checkpoint import fresh_state, interrupted_sentence
from mha2mla.train.state.run_log import open_run_folder

log = logging.getLogger(__name__)


def recover(config: RecoverConfig, resume: str | None = None, show_progress: bool = True) -> dict:
    """Run recovery fine-tuning as ``config`` says and write the merged model to ``config.out``.

    ``resume``: None (fresh run; OUT must be new or empty), ``"auto"`` (continue from OUT's latest checkpoint
    if any) or a checkpoint folder. Returns the recovery report (also written to OUT/recovery_report.json). Ctrl-C
    is a :class:`RunInterrupted` saying what OUT keeps (its checkpoints stay: the run resumes from them)."""
    run = student = teacher = train_rows = held_out = None
    try:
        devices = start_devices(config)
        plan = preflight(config, resume, devices)
        config = plan.config  # activation checkpointing decided (auto resolved), once, by the preflight
        tokenizer = load_tokenizer(config.model, hint=f"{STUDENT_HINT}, which holds its tokenizer")  # written with the model
        vocab = plan.model_config.get("vocab_size")
        writes_text = not config.data and config.default_data == "generated"  # the teacher writes the text first
        teacher = load_teacher(config.teacher, config.attn_implementation, devices.dtype, vocab) if writes_text else None
        rows_needed = plan.total_steps * config.batch_size * config.grad_accum * devices.world
        train_rows, held_out = prepare_rows(config, tokenizer, rows_needed, teacher, devices.accelerator, show_progress)
        if teacher is None and config.teacher is not None:  # after the data, so that a bad --data is refused first
            teacher = load_teacher(config.teacher, config.attn_implementation, devices.dtype, vocab)
        log_estimate(plan.sized, devices)  # the inputs have read: the run is about to train
        set_seed(config.seed)  # before the LoRA weights are drawn
        student = build_student(config.model, plan.model_config, config.attn_implementation, torch.float32,
                                devices.device.type, devices.compute_dtype)
        enable_checkpointing(student, config.activation_checkpointing)  # per decoder layer (modeling/checkpointing.py)
        student = make_trainable(student, config.adapter, layers=config.full_layers)
        if plan.saved is not None:  # before sharding: every process holds the whole model
            check_trainable_shapes(plan.resume_from, plan.saved["trainable"], student)
            load_trainable_state(student, plan.saved["trainable"])
        run = RecoveryRun(config, devices, plan.total_steps, tokenizer)
        run.setup_training(student, teacher, plan.saved)
        state = fresh_state() if plan.saved is None else {**fresh_state(), **plan.saved["state"]}
        if plan.saved is not None:
            log.info("resuming from %s (step %d)", plan.resume_from, state["step"])
        open_run_folder(config.out_path, plan.settings, state["step"], devices.is_main)
        devices.accelerator.wait_for_everyone()
        report = run.train(train_rows, held_out, state, plan.resume_from, show_progress)
        run.export(report)
    except KeyboardInterrupt as interrupt:
        raise RunInterrupted(interrupted_sentence(config.out_path)) from interrupt
    finally:  # the models, optimizer and data let go (GPU memory returned), whatever ended the run
        run = student = teacher = train_rows = held_out = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report
