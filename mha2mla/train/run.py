"""``RecoveryRun``: one recovery run as a recipe object (the shape of a torchtune recipe, docs/recover.md).

``setup()`` checks the inputs, starts accelerate and builds the teacher, the data (the teacher's own text when there
is no ``data``: generated.py), the student (LoRA, full attention or full layers), the optimizer and, on resume, restores the
checkpoint; ``train()`` loops over ``train_step`` (the one optimizer step: forward, LM loss mixed with
distillation, backward, clip, AdamW, scheduler) with periodic ``evaluate()`` (held-out perplexity) and
``save_checkpoint()``; ``export()`` writes the merged model and ``cleanup()`` lets go of everything.
``setup_training(model, teacher)`` is the part of ``setup`` that turns any model into something ``train_step`` can
train (benchmarks/recover_speed.py times the source model with it).

One process (CPU or GPU) or several through ``accelerate launch`` / ``torchrun`` (DDP or FSDP2: distributed.py). Data
is sharded by hand (under FSDP as under DDP):
optimizer step ``s`` reads global rows ``[s*R, (s+1)*R)`` of a seeded order (R = accumulation x processes x
batch), micro-batch ``m`` of process ``p`` taking rows ``(m*P + p)*B ..``; so the data position is one integer
and a resumed run reads exactly the rows it would have read."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from mha2mla.compute import resolve_compute_dtype, torch_dtype
from mha2mla.train import checkpoint as ckpt
from mha2mla.train.budget import TimeBudget
from mha2mla.train.config import RecoverConfig
from mha2mla.train.data import PackedSequences, RowOrder, target_mask
from mha2mla.train.distributed import (
    gathered_optimizer_state,
    gathered_trainable,
    is_sharded,
    load_optimizer_state,
    run_device,
    start_accelerator,
)
from mha2mla.train.evaluate import packed_perplexity
from mha2mla.train.generated import prepare_rows
from mha2mla.train.head_losses import micro_batch_losses
from mha2mla.train.log import evaluate_and_log, open_run_folder, record_step
from mha2mla.train.memory import check_run_memory
from mha2mla.train.merge import check_out_folder, gathered_model, recovery_report, write_recovered
from mha2mla.train.model import (
    check_teacher_matches,
    check_teacher_path,
    count_parameters,
    load_student,
    load_teacher,
    load_tokenizer,
    load_trainable_state,
    make_trainable,
    read_model_config,
)
from mha2mla.train.resume import check_same_run, restore_point, resume_point
from mha2mla.train.schedule import lr_multiplier

log = logging.getLogger(__name__)

def fresh_state() -> dict:
    """What a checkpoint's ``trainer_state.json`` holds: the step, the data position, and the curves so far."""
    return {"step": 0, "rows_consumed": 0, "tokens_trained": 0, "train_seconds": 0.0, "losses": [], "evaluations": []}


class RecoveryRun:
    """One recovery run: ``setup()``, ``train()``, ``export(report)``, ``cleanup()`` (``recover()`` runs them)."""

    def __init__(self, config: RecoverConfig, resume: str | None = None, show_progress: bool = True):
        self.config = config
        self.resume = resume
        self.show_progress = show_progress
        self.state = fresh_state()
        self.resume_from: Path | None = None
        self._saved: dict | None = None  # what the checkpoint resumed from holds, read back in setup()
        self.accelerator: Accelerator | None = None
        self.compute_dtype = "float32"  # resolved from config.compute_dtype when accelerate starts
        self.world, self.rank, self.is_main = 1, 0, True
        self.model = self.teacher = self.optimizer = self.scheduler = self.tokenizer = None
        self.params: list[torch.nn.Parameter] = []
        self.param_names: list[str] = []  # the trainable parameters' names, in the optimizer's order
        self.parameter_counts = (0, 0)  # trainable, total
        self.train_rows: PackedSequences | None = None
        self.held_out: PackedSequences | None = None
        self.order: RowOrder | None = None
        self._progress = None

    # ------------------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Everything a user can get wrong is checked before OUT is touched; then the teacher, data, student, optimizer,
        the restored checkpoint (on resume) and the run folder (settings, metrics log)."""
        config = self.config
        model_config = read_model_config(config.model)
        if config.teacher is not None:
            check_teacher_path(config.teacher)
        check_out_folder(config)  # refused before any training, not at export
        if resume_point(config, self.resume) is not None:
            check_same_run(config, config.out_path)
        self.start_accelerator()
        # a damaged checkpoint is one sentence before the estimate's lines
        self.resume_from, self._saved = restore_point(config, self.resume, self.rank, self.world)
        check_run_memory(config, self.compute_dtype, self.world, is_sharded(self.accelerator), self.accelerator.device,
                         self.is_main)
        self.tokenizer = load_tokenizer(config.model)
        teacher = None
        if config.teacher is not None:  # before the data: without --data the teacher writes it (generated.py)
            teacher = load_teacher(config.teacher, config.attn_implementation, torch_dtype(self.compute_dtype))
            check_teacher_matches(model_config.get("vocab_size"), teacher)
        rows_needed = config.total_steps(self.world) * self.rows_per_step
        self.train_rows, self.held_out = prepare_rows(config, self.tokenizer, rows_needed, teacher, self.accelerator,
                                                      self.show_progress)
        self.order = RowOrder(len(self.train_rows), config.seed)
        set_seed(config.seed)  # before the LoRA weights are drawn
        student = load_student(config.model, config.attn_implementation, device_type=run_device().type,
                               compute_dtype=self.compute_dtype)
        if config.activation_checkpointing:  # non-reentrant torch.utils.checkpoint per decoder layer
            student.activation_checkpointing_enable()
        student = make_trainable(student, config.adapter, layers=config.full_layers)
        self.setup_training(student, teacher)
        open_run_folder(self)

    def start_accelerator(self) -> Accelerator:
        """accelerate for one device, DDP or FSDP2 (distributed.py), and the run's compute dtype, decided here once
        from ``compute_dtype`` and the device (mha2mla.compute). bfloat16 is accelerate's bf16 autocast, the same
        on CPU and GPU: the student's weights stay float32 (the trainable ones are AdamW's master weights, the
        merge reads them), the matmuls and attention of every forward and backward run in bf16, the losses in
        float32 (losses.py). float32 is no autocast at all."""
        # auto on a CPU with native bf16: bf16 when parameters train in full, float32 with LoRA (docs/benchmarks.md)
        full = self.config.adapter is None
        self.compute_dtype = resolve_compute_dtype(self.config.compute_dtype, run_device().type, cpu_bf16=full)
        accelerator = start_accelerator("bf16" if self.compute_dtype == "bfloat16" else "no")
        self.accelerator = accelerator
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.is_main = accelerator.is_main_process
        return accelerator

    def setup_training(self, model, teacher=None) -> None:
        """Make ``model`` (its trainable parameters already chosen, e.g. by ``make_trainable``) and the optional
        frozen ``teacher`` ready for ``train_step``: AdamW over the trainable parameters, the learning-rate
        schedule, the resumed checkpoint's state if any, everything placed by accelerate."""
        config = self.config
        accelerator = self.accelerator or self.start_accelerator()
        if teacher is not None:
            teacher.to(accelerator.device, dtype=torch_dtype(self.compute_dtype))  # no grad: no master weights
        self.teacher = teacher
        self.parameter_counts = count_parameters(model)
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in trainable]
        optimizer = torch.optim.AdamW([p for _, p in trainable], lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, config.total_steps(self.world)))
        saved, self._saved = self._saved, None
        if saved is not None:
            ckpt.check_trainable_shapes(self.resume_from, saved["trainable"], model)
            load_trainable_state(model, saved["trainable"])  # before sharding: every process holds the whole model
            self.scheduler.load_state_dict(saved["scheduler"])
            self.state.update(saved["state"])
            log.info("resuming from %s (step %d)", self.resume_from, self.state["step"])
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # FSDP replaces the parameters with sharded ones: clip what the prepared model trains
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if saved is not None:  # after prepare, which under FSDP swaps the optimizer's parameters for the shards
            load_optimizer_state(self.model, self.optimizer.optimizer, saved["optimizer"], self.param_names, accelerator)
            ckpt.set_rng_state(saved["rng"])

    # ------------------------------------------------------------------------------------------ one step

    @property
    def rows_per_step(self) -> int:
        """Packed rows one optimizer step consumes over all processes."""
        return self.config.batch_size * self.config.grad_accum * self.world

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss to minimise, LM loss, logit distillation loss) of one micro-batch already on the device:
        ``(1 - w) LM + w KL`` (w ``distill_weight``), against the lm_head chunk by chunk (head_losses.py); under
        FSDP from the whole logits (the sharded lm_head weight is whole only inside the model's forward)."""
        mask = target_mask(batch["position_ids"])
        unwrapped = self.accelerator.unwrap_model(self.model)
        with self.accelerator.autocast():
            return micro_batch_losses(self.model, unwrapped, self.teacher, batch, mask, self.config.distill_weight,
                                      self.config.temperature, whole_logits=is_sharded(self.accelerator))

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this process's rows of the step: ``batch`` holds (grad_accum x B, L) tensors,
        cut into ``grad_accum`` micro-batches. Forward, loss (LM, mixed with distillation when there is a
        teacher), backward (gradients synchronised across processes on the last micro-batch only), clipping,
        AdamW and the scheduler. Returns the step's losses (averaged over micro-batches and processes) and the
        learning rate the scheduler moved to."""
        config, accelerator = self.config, self.accelerator
        count = config.grad_accum
        if batch["input_ids"].shape[0] % count:
            raise ValueError(f"a step's batch of {batch['input_ids'].shape[0]} rows does not split into {count} micro-batches")
        micro_batches = [dict(zip(batch, parts)) for parts in zip(*(value.chunk(count) for value in batch.values()))]
        parts = torch.zeros(3, dtype=torch.float64)  # loss, lm and distillation losses (summed over micro-batches)
        for index, micro in enumerate(micro_batches):
            micro = {key: value.to(accelerator.device) for key, value in micro.items()}
            last = index == count - 1
            with contextlib.nullcontext() if last or self.world == 1 else accelerator.no_sync(self.model):
                losses = self._losses(micro)
                accelerator.backward(losses[0] / count)
            parts += torch.tensor([part.item() for part in losses], dtype=torch.float64)
        if config.max_grad_norm is not None:
            accelerator.clip_grad_norm_(self.params, config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        parts /= count
        if self.world > 1:
            parts = accelerator.reduce(parts.to(accelerator.device), "mean").cpu()
        result = {"loss": float(parts[0]), "lm_loss": float(parts[1]), "lr": self.scheduler.get_last_lr()[0]}
        if self.teacher is not None:
            result["distill_loss"] = float(parts[2])
        return result

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This process's rows of the next step, micro-batch after micro-batch (see the module docstring)."""
        config, consumed = self.config, self.state["rows_consumed"]
        size = config.batch_size
        starts = [consumed + (micro * self.world + self.rank) * size for micro in range(config.grad_accum)]
        return self.train_rows.rows(torch.cat([self.order.rows(start, size) for start in starts]))

    # ------------------------------------------------------------------------------------------ the loop

    def evaluate(self) -> float | None:
        """Held-out perplexity of the model being trained (None when nothing is held out)."""
        if self.held_out is None:
            return None
        return packed_perplexity(self.model, self.held_out, self.config.batch_size, self.accelerator)

    def save_checkpoint(self, step: int) -> None:
        """``OUT/checkpoints/step-NNNNNN/``: trainable weights (+ the peft adapter), optimizer, scheduler, the trainer state and
        every process's RNG state; gathered from every process under FSDP, written by the main process."""
        config, accelerator = self.config, self.accelerator
        trainable = gathered_trainable(self.model, accelerator)
        optimizer_state = gathered_optimizer_state(self.model, self.optimizer.optimizer, self.param_names, accelerator)
        rng_states = gather_object([ckpt.rng_state()]) if self.world > 1 else [ckpt.rng_state()]
        if self.is_main:
            ckpt.save_checkpoint(
                config.out_path, step, trainable, optimizer_state, self.scheduler.state_dict(), dict(self.state),
                rng_states, adapter_model=None if config.adapter is None else accelerator.unwrap_model(self.model),
                keep=config.keep_checkpoints,
            )
        self.accelerator.wait_for_everyone()

    def train(self) -> dict:
        """Steps until ``total_steps``, evaluating and checkpointing every ``eval_every`` / ``save_every`` steps and
        evaluating before the first and after the last step. Returns the recovery report."""
        config, state = self.config, self.state
        total = config.total_steps(self.world)
        if state["step"] == 0 and not state["evaluations"]:
            evaluate_and_log(self, 0)
        self.model.train()
        self._progress = tqdm(total=total, initial=state["step"], disable=not (self.is_main and self.show_progress),
                              unit="step", dynamic_ncols=True, desc="recover")
        budget = TimeBudget(config.max_time_seconds, state)
        while state["step"] < total and not budget.spent(self.accelerator):
            started = time.perf_counter()
            result = self.train_step(self.next_batch())
            record_step(self, result, time.perf_counter() - started)
            step = state["step"]
            if config.eval_every and step % config.eval_every == 0 and step < total:
                evaluate_and_log(self, step)
            if config.save_every and step % config.save_every == 0 and step < total:
                self.save_checkpoint(step)
        self._progress.close()
        if not state["evaluations"] or state["evaluations"][-1]["step"] != state["step"]:
            evaluate_and_log(self, state["step"])
        return {**recovery_report(self), "stopped_by_max_time": budget.stopped}

    # ------------------------------------------------------------------------------------------ the end

    def export(self, report: dict) -> None:
        """Merge the adapter and write the native DeepSeek-V3 checkpoint to OUT (main process; the others wait), then
        remove the resume checkpoints unless ``keep_checkpoints_after_run``: the finished OUT is the model."""
        accelerator, config = self.accelerator, self.config
        accelerator.wait_for_everyone()
        model = gathered_model(self) if is_sharded(accelerator) else accelerator.unwrap_model(self.model)
        if self.is_main:
            settings = config.model_dump(mode="json")
            write_recovered(model, self.tokenizer, Path(config.model), config.out_path, settings, report)
            if not config.keep_checkpoints_after_run:
                ckpt.remove_checkpoints(config.out_path)
        accelerator.wait_for_everyone()

    def cleanup(self) -> None:
        """Close the progress bar and drop the models, optimizer and data (GPU memory is returned)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        self.model = self.teacher = self.optimizer = self.scheduler = None
        self.params, self.train_rows, self.held_out = [], None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
