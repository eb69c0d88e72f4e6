"""``RecoveryRecipe``: one recovery run as a recipe object (the shape of a torchtune recipe, docs/recover.md).

``setup()`` checks the inputs, starts accelerate and builds the data, the student (LoRA or full attention), the
teacher, the optimizer and, on resume, restores the checkpoint; ``train()`` loops over ``train_step`` (the one
optimizer step: forward, LM loss mixed with distillation, backward, clip, AdamW, scheduler) with periodic
``evaluate()`` (held-out perplexity) and ``save_checkpoint()``; ``export()`` writes the merged model and
``cleanup()`` lets go of everything. ``setup_training(model, teacher)`` is the part of ``setup`` that turns any
model into something ``train_step`` can train (benchmarks/recover_speed.py times the source model with it).

One process (CPU or GPU) or several through ``accelerate launch`` / ``torchrun`` (DDP or FSDP2: distributed.py). Data
is sharded by hand (under FSDP as under DDP):
optimizer step ``s`` reads global rows ``[s*R, (s+1)*R)`` of a seeded order (R = accumulation x processes x
batch), micro-batch ``m`` of process ``p`` taking rows ``(m*P + p)*B ..``; so the data position is one integer
and a resumed run reads exactly the rows it would have read."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, parse_flag_from_env, set_seed
from tqdm.auto import tqdm

from mha2mla import UserError
from mha2mla.evaluation.perplexity import batch_nll
from mha2mla.io.output import remove_stale, write_errors
from mha2mla.train import checkpoint as ckpt
from mha2mla.train.config import RecoverConfig, flat_settings
from mha2mla.train.data import PackedSequences, RowOrder, build_packed, target_mask
from mha2mla.train.distributed import (
    gathered_optimizer_state,
    gathered_trainable,
    is_sharded,
    load_optimizer_state,
    start_accelerator,
)
from mha2mla.train.export import RECOVER_CONFIG, RECOVERY_REPORT, check_out_folder, write_recovered
from mha2mla.train.losses import distillation_loss, lm_loss
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

log = logging.getLogger(__name__)

TRAIN_LOG = "train_log.jsonl"


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


def _check_run_folder(out: Path) -> None:
    """An existing, non-empty --out must be a recover run folder (its settings or checkpoints) or a finished one."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    if (out / RECOVERY_REPORT).is_file() or (out / RECOVER_CONFIG).is_file() or ckpt.list_checkpoints(out):
        return
    raise UserError(f"--out {out} is not empty and was not written by mha2mla recover; choose a new or empty --out.")


def resume_point(config: RecoverConfig, resume: str | None) -> Path | None:
    """The checkpoint to continue from (None: a fresh run), after checking OUT is usable. A checkpoint is only
    named here; :func:`restore_point` reads it back."""
    out = config.out_path
    _check_run_folder(out)
    finished = (out / "config.json").is_file()
    if resume is None:
        if out.exists() and any(out.iterdir()):
            if finished:
                raise UserError(f"{out} already holds a recovered model; choose another --out.")
            if ckpt.list_checkpoints(out):
                raise UserError(f"{out} holds checkpoints of an unfinished run; pass --resume auto to continue it.")
            raise UserError(f"{out} holds an unfinished run without checkpoints; choose another --out, or pass "
                            "--resume auto to restart the run there.")
        return None
    if resume == "auto":
        if finished:
            raise UserError(f"the run in {out} has already finished; choose another --out.")
        return ckpt.latest_checkpoint(out)
    path = Path(resume).expanduser()
    if not path.is_dir() or not ckpt.STEP_PATTERN.match(path.resolve().name):
        raise UserError(f"--resume {resume} is not a checkpoint folder (OUT/step-NNNNNN); use --resume auto.")
    return path


def restore_point(config: RecoverConfig, resume: str | None, rank: int = 0) -> tuple[Path | None, dict | None]:
    """The checkpoint a run continues from and what it holds, every file read back: ``--resume auto`` takes the
    newest complete checkpoint (saying which damaged ones it passed over), a named checkpoint must be complete."""
    chosen = resume_point(config, resume)
    if chosen is None:
        return None, None
    if resume == "auto":
        found = ckpt.newest_complete(config.out_path, rank)
        return found if found is not None else (None, None)
    try:
        return chosen, ckpt.load_checkpoint(chosen, rank)
    except ckpt.DamagedCheckpoint as error:
        raise UserError(f"{str(error).removesuffix('.')}; resume from an earlier checkpoint, or use --resume auto "
                        "to take the newest complete one.") from None


def check_same_run(config: RecoverConfig, folder: Path) -> None:
    """Refuse to resume the run in ``folder`` with settings that change what it computes (named as their flags)."""
    saved_path = folder / RECOVER_CONFIG
    if not saved_path.is_file():
        return
    try:
        saved = flat_settings(json.loads(saved_path.read_text()))
    except (ValueError, AttributeError, TypeError) as error:
        raise UserError(f"{saved_path} is damaged ({type(error).__name__}); it records the run's settings: restore it, "
                        "or delete it to resume without checking that the settings are the same.") from None
    current = flat_settings(config.outcome_fields())
    changed = sorted(key for key in current if saved.get(key) != current[key])
    if changed:
        raise UserError(f"cannot resume: settings differ from the interrupted run ({', '.join(changed)}); use the same options.")


def prepare_data(config: RecoverConfig, tokenizer, rows_needed: int) -> tuple[PackedSequences, PackedSequences | None]:
    """The training rows and the held-out rows (``eval_data``, or the first rows of the training data; None when
    ``eval_sequences`` is 0)."""
    if config.eval_data:
        train = build_packed(tokenizer, config.data, config.seq_len, config.text_field, rows_needed, "training data")
        held_out = build_packed(
            tokenizer, config.eval_data, config.seq_len, config.text_field, config.eval_sequences or None, "evaluation data"
        )
        return train, held_out
    packed = build_packed(
        tokenizer, config.data, config.seq_len, config.text_field, rows_needed + config.eval_sequences, "training data"
    )
    if config.eval_sequences == 0:
        return packed, None
    if len(packed) <= config.eval_sequences:
        raise UserError(
            f"the training data fills only {len(packed)} sequences of {config.seq_len} tokens, not enough to hold out "
            f"{config.eval_sequences} for evaluation and train on the rest; give more text, --eval-data, or a smaller "
            "--eval-sequences."
        )
    held_out, train = packed.split(config.eval_sequences)
    return train, held_out


@torch.no_grad()
def packed_perplexity(model, rows: PackedSequences, batch_size: int, accelerator: Accelerator) -> float:
    """Perplexity of ``model`` over packed ``rows`` (segment starts are not targets), scored with the project's
    ``batch_nll``: each process takes every P-th row and the sums are reduced across processes. Under FSDP a
    forward gathers weights from every process, so all run the same number of batches: one whose rows have run out
    scores row 0 again and leaves it out of the sums."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    indices = torch.arange(accelerator.process_index, len(rows), accelerator.num_processes)
    busiest = -(-len(rows) // accelerator.num_processes) if is_sharded(accelerator) else len(indices)
    for start in range(0, busiest, batch_size):
        chosen = indices[start : start + batch_size]
        batch = {k: v.to(accelerator.device) for k, v in rows.rows(chosen if len(chosen) else indices.new_zeros(1)).items()}
        with accelerator.autocast():
            nll, count = batch_nll(model, batch, target_mask(batch["position_ids"]))
        if len(chosen):
            total += torch.tensor([nll, count], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, "sum")
    model.train(was_training)
    return math.exp(total[0].item() / max(1.0, total[1].item()))


def _logged_until(log_path: Path, step: int) -> list[str]:
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


def fresh_state() -> dict:
    """What a checkpoint's ``trainer_state.json`` holds: the step, the data position, and the curves so far."""
    return {"step": 0, "rows_consumed": 0, "tokens_trained": 0, "train_seconds": 0.0, "losses": [], "evaluations": []}


class RecoveryRecipe:
    """One recovery run: ``setup()``, ``train()``, ``export(report)``, ``cleanup()`` (``recover()`` runs them)."""

    def __init__(self, config: RecoverConfig, resume: str | None = None, show_progress: bool = True):
        self.config = config
        self.resume = resume
        self.show_progress = show_progress
        self.state = fresh_state()
        self.resume_from: Path | None = None
        self._saved: dict | None = None  # what the checkpoint resumed from holds, read back in setup()
        self.accelerator: Accelerator | None = None
        self.mixed_precision = "no"
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
        """Everything a user can get wrong is checked before OUT is touched; then data, models, optimizer,
        the restored checkpoint (on resume) and the run folder (settings, metrics log)."""
        config = self.config
        read_model_config(config.model)
        if config.teacher is not None:
            check_teacher_path(config.teacher)
        check_out_folder(config)  # refused before any training, not at export
        if resume_point(config, self.resume) is not None:
            check_same_run(config, config.out_path)
        self.start_accelerator()
        self.resume_from, self._saved = restore_point(config, self.resume, self.rank)
        self.tokenizer = load_tokenizer(config.model)
        rows_needed = config.total_steps(self.world) * self.rows_per_step
        self.train_rows, self.held_out = prepare_data(config, self.tokenizer, rows_needed)
        self.order = RowOrder(len(self.train_rows), config.seed)
        set_seed(config.seed)  # before the LoRA weights are drawn
        student = load_student(config.model, config.attn_implementation)
        student = make_trainable(student, None if config.full_attention else config.lora)
        teacher = None
        if config.teacher is not None:
            teacher = load_teacher(config.teacher, config.attn_implementation)
            check_teacher_matches(student, teacher)
        self.setup_training(student, teacher)
        self._open_run_folder()

    def start_accelerator(self) -> Accelerator:
        """accelerate for one device, DDP or FSDP2 (distributed.py; ``mixed_precision`` auto: bf16 on a GPU, none
        on CPU)."""
        mixed = self.config.mixed_precision
        if mixed == "auto":
            mixed = "bf16" if torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU") else "no"
        accelerator = start_accelerator(mixed)
        self.accelerator, self.mixed_precision = accelerator, mixed
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
            teacher.to(accelerator.device, dtype=torch.bfloat16 if self.mixed_precision == "bf16" else torch.float32)
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

    def _open_run_folder(self) -> None:
        """OUT gets the run's settings and a metrics log (what a killed run logged after its last checkpoint is
        dropped, a half-written last line with it); checkpoints come later. A full disk is one sentence."""
        out, log_path = self.config.out_path, self.config.out_path / TRAIN_LOG
        if self.is_main:
            with write_errors(out):
                out.mkdir(parents=True, exist_ok=True)
                remove_stale(out)  # a checkpoint save a killed run left half-written
                (out / RECOVER_CONFIG).write_text(json.dumps(self.config.outcome_fields(), indent=2) + "\n")
                kept = _logged_until(log_path, self.state["step"])
                log_path.write_text("".join(line + "\n" for line in kept))
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------------------------------ one step

    @property
    def rows_per_step(self) -> int:
        """Packed rows one optimizer step consumes over all processes."""
        return self.config.batch_size * self.config.grad_accum * self.world

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss to minimise, LM loss, distillation loss) of one micro-batch already on the device."""
        config = self.config
        mask = target_mask(batch["position_ids"])
        with self.accelerator.autocast():
            logits = self.model(**batch, use_cache=False).logits
            language = lm_loss(logits, batch["input_ids"], mask)
            if self.teacher is None:
                return language, language, torch.zeros(())
            with torch.no_grad():
                teacher_logits = self.teacher(**batch, use_cache=False).logits
            distill = distillation_loss(logits, teacher_logits, mask, config.temperature)
            return (1 - config.distill_weight) * language + config.distill_weight * distill, language, distill

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
        parts = torch.zeros(3, dtype=torch.float64)  # loss, lm loss, distillation loss (summed over micro-batches)
        for index, micro in enumerate(micro_batches):
            micro = {key: value.to(accelerator.device) for key, value in micro.items()}
            last = index == count - 1
            with contextlib.nullcontext() if last or self.world == 1 else accelerator.no_sync(self.model):
                loss, language, distill = self._losses(micro)
                accelerator.backward(loss / count)
            parts += torch.tensor([loss.item(), language.item(), distill.item()], dtype=torch.float64)
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
        """``OUT/step-NNNNNN/``: trainable weights (+ the peft adapter), optimizer, scheduler, the trainer state and
        every process's RNG state; gathered from every process under FSDP, written by the main process."""
        config, accelerator = self.config, self.accelerator
        trainable = gathered_trainable(self.model, accelerator)
        optimizer_state = gathered_optimizer_state(self.model, self.optimizer.optimizer, self.param_names, accelerator)
        rng_states = gather_object([ckpt.rng_state()]) if self.world > 1 else [ckpt.rng_state()]
        if self.is_main:
            ckpt.save_checkpoint(
                config.out_path, step, trainable, optimizer_state, self.scheduler.state_dict(), dict(self.state),
                rng_states, adapter_model=None if config.full_attention else accelerator.unwrap_model(self.model),
                keep=config.keep_checkpoints,
            )
        self.accelerator.wait_for_everyone()

    def train(self) -> dict:
        """Steps until ``total_steps``, evaluating and checkpointing every ``eval_every`` / ``save_every`` steps and
        evaluating before the first and after the last step. Returns the recovery report."""
        config, state = self.config, self.state
        total = config.total_steps(self.world)
        if state["step"] == 0 and not state["evaluations"]:
            self._evaluate_and_log(0)
        self.model.train()
        self._progress = tqdm(total=total, initial=state["step"], disable=not (self.is_main and self.show_progress),
                              unit="step", dynamic_ncols=True, desc="recover")
        while state["step"] < total:
            started = time.perf_counter()
            result = self.train_step(self.next_batch())
            self._record(result, time.perf_counter() - started)
            step = state["step"]
            if config.eval_every and step % config.eval_every == 0 and step < total:
                self._evaluate_and_log(step)
            if config.save_every and step % config.save_every == 0 and step < total:
                self.save_checkpoint(step)
        self._progress.close()
        if not state["evaluations"] or state["evaluations"][-1]["step"] != state["step"]:
            self._evaluate_and_log(state["step"])
        return self.report()

    def _record(self, result: dict[str, float], elapsed: float) -> None:
        state, tokens = self.state, self.rows_per_step * self.config.seq_len
        state["step"] += 1
        state["rows_consumed"] += self.rows_per_step
        state["tokens_trained"] += tokens
        state["train_seconds"] += elapsed
        state["losses"].append(result["loss"])
        record = {"step": state["step"], "tokens": state["tokens_trained"], "loss": result["loss"],
                  "lm_loss": result["lm_loss"], "lr": result["lr"], "tokens_per_second": tokens / elapsed}
        if "distill_loss" in result:
            record["distill_loss"] = result["distill_loss"]
        self._write_log(record)
        self._progress.update(1)
        perplexity = f" | ppl {state['evaluations'][-1]['perplexity']:.2f}" if state["evaluations"] else ""
        self._progress.set_postfix_str(f"loss {result['loss']:.3f} | {record['tokens_per_second']:.0f} tok/s{perplexity}")

    def _evaluate_and_log(self, step: int) -> None:
        perplexity = self.evaluate()
        if perplexity is None:
            return
        tokens = self.state["tokens_trained"]
        self.state["evaluations"].append({"step": step, "tokens": tokens, "perplexity": perplexity})
        self._write_log({"step": step, "tokens": tokens, "eval_perplexity": perplexity})
        if self.is_main:
            log.info("step %d: held-out perplexity %.3f", step, perplexity)

    def _write_log(self, record: dict) -> None:
        if self.is_main:
            with open(self.config.out_path / TRAIN_LOG, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------------------------------ the end

    def report(self) -> dict:
        """The recovery report (``OUT/recovery_report.json``): curves, throughput, what trained, how it ran."""
        state = self.state
        trainable, total = self.parameter_counts
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
            "num_processes": self.world,
            "mixed_precision": self.mixed_precision,
            "resumed_from": str(self.resume_from) if self.resume_from is not None else None,
        }

    def export(self, report: dict) -> None:
        """Merge the adapter and write the native DeepSeek-V3 checkpoint to OUT (main process; the others wait)."""
        accelerator, config = self.accelerator, self.config
        accelerator.wait_for_everyone()
        model = self.whole_model() if is_sharded(accelerator) else accelerator.unwrap_model(self.model)
        if self.is_main:
            settings = config.model_dump(mode="json")
            write_recovered(model, self.tokenizer, Path(config.model), config.out_path, settings, report)
        accelerator.wait_for_everyone()

    def whole_model(self):
        """Under FSDP: the trained model in one piece on the main process (None on the others). The trainable
        tensors are gathered, the sharded model and optimizer let go, and the main process loads the input model
        again with the same trainable parameters and the gathered values (the frozen weights never changed)."""
        config = self.config
        trainable = gathered_trainable(self.model, self.accelerator)
        self.model = self.optimizer = None
        self.params = []
        self.accelerator.free_memory()
        if not self.is_main:
            return None
        model = make_trainable(load_student(config.model, config.attn_implementation),
                               None if config.full_attention else config.lora)
        load_trainable_state(model, trainable)
        return model

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
