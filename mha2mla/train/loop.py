"""``RecoveryRun``: the model being trained and what trains it, in the shape of a torchtune recipe (docs/recover.md):
``setup_training`` (AdamW over the trainable parameters, the learning-rate schedule, a resumed checkpoint's
optimizer and RNG state, everything placed by accelerate), ``train_step`` (the one optimizer step: forward, LM loss
mixed with distillation, backward, clip, AdamW, scheduler), ``train`` (the loop, top to bottom: an evaluation before
the first step, then each step with the evaluation and checkpoint due after it until the last step or the time
budget, then the last evaluation) and ``export`` (the merged model written to OUT). trainer.py builds it from what
the run loaded; benchmarks/recover_speed.py times ``train_step`` on any model made ready by ``setup_training``.

One process (CPU or GPU) or several through ``accelerate launch`` / ``torchrun`` (DDP or FSDP2: devices.py,
state/gather.py). Data is sharded by hand (under FSDP as under DDP): optimizer step ``s`` reads global rows
``[s*R, (s+1)*R)`` of the training rows' seeded order (R = accumulation x processes x batch), micro-batch ``m`` of
process ``p`` taking rows ``(m*P + p)*B ..`` (``rows_at``); the data position is the rows consumed, with the rows'
own ``state_dict()`` in every checkpoint, so a resumed run reads exactly the rows it would have read.

The schedule: the learning rate warms up and decays (``lr_multiplier``); the time budget (``--max-time 80m``,
``TimeBudget``) stops the loop before a step that would end past it, and the run ends as any run does (the last
evaluation, the model written). It counts the loop's wall time (steps, evaluations, checkpoints) summed over
resumptions (``wall_seconds`` in the trainer state); the final evaluation and the export come after it. The
setting's forms are read by config.duration_seconds."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from time import monotonic

import torch
from tqdm.auto import tqdm

from mha2mla.train.config import RecoverConfig
from mha2mla.train.data.packing import target_mask
from mha2mla.train.devices import Devices
from mha2mla.train.evaluate import packed_perplexity
from mha2mla.train.head_losses import micro_batch_losses
from mha2mla.train.model.merge import reloaded_model, write_recovered
from mha2mla.train.state import checkpoint as ckpt
from mha2mla.train.state.gather import gathered_state, gathered_trainable, restore_state
from mha2mla.train.state.run_log import append_log, log_evaluation, recovery_report

log = logging.getLogger(__name__)


def lr_multiplier(config: RecoverConfig, total_steps: int):
    """Linear warmup over ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` (or constant)."""
    warmup = config.warmup_steps

    def multiplier(step: int) -> float:  # step = optimizer steps already taken
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape

    return multiplier


class TimeBudget:
    """Checked before every optimizer step: ``spent()`` is True once the next step, as long as the last one, would end
    past the budget (None: no budget). Every process takes the same decision (the main process's clock counts)."""

    def __init__(self, seconds: float | None, state: dict):
        self.seconds, self.state = seconds, state
        self.stopped = False
        self._origin = monotonic() - state["wall_seconds"]
        self._last = monotonic()

    def spent(self, accelerator) -> bool:
        now = monotonic()
        self.state["wall_seconds"] = now - self._origin
        step_seconds, self._last = now - self._last, now
        if self.seconds is None:
            return False
        over = torch.tensor(float(self.state["wall_seconds"] + step_seconds > self.seconds), device=accelerator.device)
        if accelerator.num_processes > 1:
            over = accelerator.reduce(over, "max")
        self.stopped = bool(over.item())
        if self.stopped and accelerator.is_main_process:
            log.info("%s", stop_sentence(self.state["step"], self.state["wall_seconds"], self.seconds, step_seconds))
        return self.stopped


def stop_sentence(step: int, spent: float, budget: float, step_seconds: float) -> str:
    """Why the time budget ends the loop, in a sentence that reads right whether the time spent is under the budget
    (the next step would pass it) or already over it (a budget shorter than the first evaluation or step)."""
    where = "before the first step" if step == 0 else f"after step {step}"
    if spent >= budget:
        why = f"{seconds_text(spent)} spent, past the {seconds_text(budget)} budget"
    else:
        why = (f"{seconds_text(spent)} of the {seconds_text(budget)} budget spent, and one more step (about "
               f"{seconds_text(step_seconds)}) would end past it")
    return f"--max-time: stopping {where}: {why}; writing the model"


def seconds_text(seconds: float) -> str:
    """A duration for a log line: whole seconds for long ones, three significant digits for short ones, so that a
    budget under a second does not read as none."""
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.3g} s"


class RecoveryRun:
    """The model being trained on ``devices`` (devices.Devices) over ``total_steps`` optimizer steps:
    ``setup_training``, then ``train_step`` or ``train``, then ``export`` (with ``tokenizer``)."""

    def __init__(self, config: RecoverConfig, devices: Devices, total_steps: int, tokenizer=None):
        self.config, self.devices, self.total_steps = config, devices, total_steps
        self.accelerator, self.compute_dtype = devices.accelerator, devices.compute_dtype
        self.world, self.rank, self.is_main = devices.world, devices.rank, devices.is_main
        self.model = self.teacher = self.optimizer = self.scheduler = None
        self.params: list[torch.nn.Parameter] = []
        self.param_names: list[str] = []  # the trainable parameters' names, in the optimizer's order
        self.parameter_counts = (0, 0)  # trainable, total
        self.tokenizer = tokenizer  # written with the model by export()

    def setup_training(self, model, teacher=None, saved: dict | None = None) -> None:
        """Make ``model`` (its trainable parameters chosen, and on resume their values put back: trainable.py) and
        the optional frozen ``teacher`` ready for ``train_step``: AdamW over the trainable parameters, the
        learning-rate schedule, the optimizer, scheduler and RNG state of ``saved`` (a checkpoint), everything
        placed by accelerate."""
        config, accelerator = self.config, self.accelerator
        if teacher is not None:
            teacher.to(accelerator.device, dtype=self.devices.dtype)  # no grad: no master weights
        self.teacher = teacher
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in trainable]
        self.parameter_counts = (sum(p.numel() for _, p in trainable), sum(p.numel() for p in model.parameters()))
        # torch's fused AdamW on a CPU or a GPU: one kernel over each parameter instead of a dozen elementwise passes
        # (docs/benchmarks.md, "Speed and memory"); the plain one under FSDP (sharded parameters)
        fused = not self.devices.sharded and self.devices.device.type in ("cpu", "cuda")
        optimizer = torch.optim.AdamW([p for _, p in trainable], lr=config.learning_rate, weight_decay=config.weight_decay,
                                      fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, self.total_steps))
        if saved is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # FSDP replaces the parameters with sharded ones: clip what the prepared model trains
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if saved is not None:  # after prepare, which under FSDP swaps the optimizer's parameters for the shards
            restore_state(self.model, self.optimizer.optimizer, saved, self.param_names, accelerator)

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
                                      self.config.temperature, whole_logits=self.devices.sharded)

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
        norm = None  # the gradients' norm before clipping, logged: a loss spike shows there first
        if config.max_grad_norm is not None:
            norm = accelerator.clip_grad_norm_(self.params, config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        parts /= count
        if self.world > 1:
            parts = accelerator.reduce(parts.to(accelerator.device), "mean").cpu()
        result = {"loss": float(parts[0]), "lm_loss": float(parts[1]), "lr": self.scheduler.get_last_lr()[0]}
        if self.teacher is not None:
            result["distill_loss"] = float(parts[2])
        if norm is not None:
            result["grad_norm"] = float(norm)
        return result

    def train(self, train_rows, held_out, state: dict, resumed_from: Path | None = None,
              show_progress: bool = True) -> dict:
        """Steps from ``state`` (checkpoint.fresh_state(), or the checkpoint's at ``resumed_from``) until
        ``total_steps`` or the time budget, reading ``train_rows`` (``rows_at``; its ``state_dict()`` saved with every
        checkpoint), logging every step, evaluating on ``held_out`` before the first step, every ``eval_every`` steps
        and after the last, checkpointing every ``save_every`` steps. Returns the recovery report."""
        config, total = self.config, self.total_steps
        if state["data"] is not None:  # the rows' own position, as the checkpoint saved it
            train_rows.load_state_dict(state["data"])
        budget = TimeBudget(config.max_time_seconds, state)
        progress = tqdm(total=total, initial=state["step"], disable=not (self.is_main and show_progress), unit="step",
                        dynamic_ncols=True, desc="recover")
        self.model.train()
        with progress:
            if state["step"] == 0:
                self._evaluate(held_out, state)
            while state["step"] < total and not budget.spent(self.accelerator):
                line = self._step(train_rows, state)
                progress.update(1)
                progress.set_postfix_str(line)
                step = state["step"]
                if step < total and config.eval_every and step % config.eval_every == 0:
                    self._evaluate(held_out, state)
                if step < total and config.save_every and step % config.save_every == 0:
                    self._save_checkpoint(step, {**state, "data": train_rows.state_dict()})
            self._evaluate(held_out, state)
        return self._report(state, budget.stopped, resumed_from)

    def _step(self, train_rows, state: dict) -> str:
        """One optimizer step on the rows that follow ``state``'s data position: ``state`` moved on, the step's
        metrics logged; returns the progress bar's line."""
        config, rows = self.config, self.rows_per_step
        started = time.perf_counter()
        starts = [state["rows_consumed"] + (micro * self.world + self.rank) * config.batch_size
                  for micro in range(config.grad_accum)]
        result = self.train_step(train_rows.rows_at(starts, config.batch_size))
        elapsed, tokens = time.perf_counter() - started, rows * config.seq_len
        state.update(step=state["step"] + 1, rows_consumed=state["rows_consumed"] + rows,
                     tokens_trained=state["tokens_trained"] + tokens, train_seconds=state["train_seconds"] + elapsed)
        state["losses"].append(result["loss"])
        append_log(config.out_path, {"step": state["step"], "tokens": state["tokens_trained"], **result,
                                     "tokens_per_second": tokens / elapsed}, self.is_main)
        perplexity = f" | ppl {state['evaluations'][-1]['perplexity']:.2f}" if state["evaluations"] else ""
        return f"loss {result['loss']:.3f} | {tokens / elapsed:.0f} tok/s{perplexity}"

    def _evaluate(self, held_out, state: dict) -> None:
        """Held-out perplexity at ``state``'s step, once per step (none without held-out rows)."""
        evaluations, step = state["evaluations"], state["step"]
        if held_out is None or (evaluations and evaluations[-1]["step"] == step):
            return
        perplexity = packed_perplexity(self.model, held_out, self.config.batch_size, self.accelerator,
                                       self.devices.sharded)
        evaluations.append({"step": step, "tokens": state["tokens_trained"], "perplexity": perplexity})
        log_evaluation(self.config.out_path, evaluations[-1], self.is_main)

    def _report(self, state: dict, stopped_by_max_time: bool, resumed_from: Path | None) -> dict:
        """The recovery report (run_log.recovery_report), with whether the time budget ended the run and, on a GPU,
        this process's peak memory beside the --dry-run estimate."""
        report = {**recovery_report(state, self.parameter_counts, self.world, self.compute_dtype, resumed_from),
                  "stopped_by_max_time": stopped_by_max_time}
        if self.devices.device.type == "cuda":
            report["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(self.devices.device) / 1024**3, 3)
        return report

    def _save_checkpoint(self, step: int, trainer_state: dict) -> None:
        """Write ``OUT/checkpoints/step-NNNNNN`` (every process gathers, the main one writes): the peft adapter beside
        the tensors, ``trainer_state`` with the rows' own position. What was gathered is let go on return (on one
        process it is the live tensors, not copies)."""
        config, accelerator = self.config, self.accelerator
        trainable, optimizer_state, rng_states = gathered_state(self.model, self.optimizer.optimizer, self.param_names,
                                                                accelerator)
        if self.is_main:
            adapter = None if config.adapter is None else accelerator.unwrap_model(self.model)
            ckpt.save_checkpoint(config.out_path, step, trainable, optimizer_state, self.scheduler.state_dict(),
                                 trainer_state, rng_states, adapter, config.keep_checkpoints)
        accelerator.wait_for_everyone()

    def export(self, report: dict) -> None:
        """Merge the adapter and write the native DeepSeek-V3 checkpoint to OUT with ``report`` (main process; the
        others wait), then remove the resume checkpoints unless ``keep_checkpoints_after_run``: the finished OUT is
        the model."""
        config, accelerator = self.config, self.accelerator
        accelerator.wait_for_everyone()
        if self.devices.sharded:  # the trained model in one piece on the main process (None on the others)
            trainable = gathered_trainable(self.model, accelerator)
            self.model = self.optimizer = None  # the sharded model and optimizer let go before the model loads again
            self.params = []
            accelerator.free_memory()
            model = reloaded_model(config, trainable) if self.is_main else None
        else:
            model = accelerator.unwrap_model(self.model)
        if self.is_main:
            write_recovered(model, self.tokenizer, Path(config.model), config.out_path, config.model_dump(mode="json"),
                            report)
            if not config.keep_checkpoints_after_run:
                ckpt.remove_checkpoints(config.out_path)
        accelerator.wait_for_everyone()
