"""The recovery loop: ``recover(config)`` trains the converted model on packed text (LM loss, optionally mixed
with distillation from its source), evaluates held-out perplexity, checkpoints, and writes the merged model.

One process (CPU or GPU) or several through ``accelerate launch`` (DDP). Data is sharded by hand: optimizer
step ``s`` of a run reads global rows ``[s*R, (s+1)*R)`` of a seeded order (R = accumulation x processes x
batch), micro-batch ``m`` of process ``p`` taking rows ``(m*P + p)*B ..``; so the data position is one integer
and a resumed run reads exactly the rows it would have read."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.train import checkpoint as ckpt
from mha2mla.train.config import RecoverConfig
from mha2mla.train.data import PackedSequences, RowOrder, build_packed, target_mask
from mha2mla.train.export import RECOVER_CONFIG, write_recovered
from mha2mla.train.losses import distillation_loss, lm_loss, nll_sum
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
    trainable_state,
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


def _resume_point(config: RecoverConfig, resume: str | None) -> Path | None:
    """The checkpoint to continue from (None: a fresh run), after checking OUT is usable."""
    out = config.out_path
    finished = (out / "config.json").is_file()
    if resume is None:
        if out.exists() and any(out.iterdir()):
            if finished:
                raise UserError(f"{out} already holds a recovered model; choose another --out.")
            if ckpt.list_checkpoints(out):
                raise UserError(f"{out} holds checkpoints of an unfinished run; pass --resume auto to continue it.")
            raise UserError(f"{out} exists and is not empty; choose another --out, or pass --resume auto to restart the run there.")
        return None
    if resume == "auto":
        if finished:
            raise UserError(f"the run in {out} has already finished; choose another --out.")
        return ckpt.latest_checkpoint(out)
    path = Path(resume).expanduser()
    if not (path / ckpt.STATE_FILE).is_file():
        raise UserError(f"--resume {resume} is not a checkpoint folder (OUT/step-NNNNNN); use --resume auto.")
    return path


def _check_same_run(config: RecoverConfig, folder: Path) -> None:
    saved_path = folder / RECOVER_CONFIG
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    current = config.outcome_fields()
    changed = sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key) and key in current)
    if changed:
        raise UserError(f"cannot resume: settings differ from the interrupted run ({', '.join(changed)}); use the same options.")


def _prepare_data(config: RecoverConfig, tokenizer, rows_needed: int) -> tuple[PackedSequences, PackedSequences | None]:
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
def evaluate_perplexity(model, rows: PackedSequences, batch_size: int, accelerator) -> float:
    """Perplexity over the held-out rows (each process takes every P-th row; sums are reduced)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    indices = torch.arange(accelerator.process_index, len(rows), accelerator.num_processes)
    for start in range(0, len(indices), batch_size):
        batch = {k: v.to(accelerator.device) for k, v in rows.rows(indices[start : start + batch_size]).items()}
        with accelerator.autocast():
            logits = model(**batch, use_cache=False).logits
        nll, count = nll_sum(logits, batch["input_ids"], target_mask(batch["position_ids"]))
        total += torch.tensor([nll, count], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(total, "sum") if accelerator.num_processes > 1 else total
    model.train(was_training)
    return math.exp(total[0].item() / max(1.0, total[1].item()))


def recover(config: RecoverConfig, resume: str | None = None, show_progress: bool = True) -> dict:
    """Run recovery fine-tuning as ``config`` says and write the merged model to ``config.out``.

    ``resume``: None (fresh run; OUT must be new or empty), ``"auto"`` (continue from OUT's latest checkpoint
    if any) or a checkpoint folder. Returns the recovery report (also written to OUT/recovery_report.json)."""
    from accelerate import Accelerator, DistributedType
    from accelerate.utils import gather_object, set_seed
    from tqdm.auto import tqdm

    out = config.out_path
    # ---- everything a user can get wrong is checked before OUT is touched
    read_model_config(config.model)
    if config.teacher is not None:
        check_teacher_path(config.teacher)
    resume_from = _resume_point(config, resume)
    if resume_from is not None:
        _check_same_run(config, out)

    mixed = config.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=mixed)
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        raise UserError(
            f"recover supports one device or DDP (accelerate multi-GPU/CPU), not {accelerator.distributed_type.value}; "
            "use recipes/accelerate/multi_gpu.yaml."
        )
    world, rank = accelerator.num_processes, accelerator.process_index
    main = accelerator.is_main_process
    total_steps = config.total_steps(world)
    rows_per_step = config.batch_size * config.grad_accum * world

    tokenizer = load_tokenizer(config.model)
    train_rows, held_out = _prepare_data(config, tokenizer, total_steps * rows_per_step)
    order = RowOrder(len(train_rows), config.seed)

    set_seed(config.seed)
    model = make_trainable(load_student(config.model, config.attn_implementation), config)
    teacher = None
    if config.teacher is not None:
        teacher = load_teacher(config.teacher, config.attn_implementation)
        check_teacher_matches(model, teacher)
        teacher.to(accelerator.device, dtype=torch.bfloat16 if mixed == "bf16" else torch.float32)
    trainable_count, total_count = count_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, total_steps))

    state = {"step": 0, "rows_consumed": 0, "tokens_trained": 0, "train_seconds": 0.0, "losses": [], "evaluations": []}
    restored_rng = None
    if resume_from is not None:
        saved = ckpt.load_checkpoint(resume_from, rank)
        load_trainable_state(model, saved["trainable"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state.update(saved["state"])
        restored_rng = saved["rng"]
        log.info("resuming from %s (step %d)", resume_from, state["step"])

    model, optimizer = accelerator.prepare(model, optimizer)
    if restored_rng is not None:
        ckpt.set_rng_state(restored_rng)

    # ---- the run folder: settings, a metrics log; checkpoints come later
    settings = config.model_dump(mode="json")
    log_path = out / TRAIN_LOG
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / RECOVER_CONFIG).write_text(json.dumps(config.outcome_fields(), indent=2) + "\n")
        kept = []
        if log_path.is_file():  # drop what the killed run logged after its last checkpoint
            kept = [line for line in log_path.read_text().splitlines() if json.loads(line).get("step", 0) <= state["step"]]
        log_path.write_text("".join(line + "\n" for line in kept))
    accelerator.wait_for_everyone()

    def write_log(record: dict) -> None:
        if main:
            with open(log_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def run_eval(step: int) -> None:
        if held_out is None:
            return
        perplexity = evaluate_perplexity(model, held_out, config.batch_size, accelerator)
        state["evaluations"].append({"step": step, "tokens": state["tokens_trained"], "perplexity": perplexity})
        write_log({"step": step, "tokens": state["tokens_trained"], "eval_perplexity": perplexity})
        if main:
            log.info("step %d: held-out perplexity %.3f", step, perplexity)

    def save(step: int) -> None:
        unwrapped = accelerator.unwrap_model(model)
        rng_states = gather_object([ckpt.rng_state()]) if world > 1 else [ckpt.rng_state()]
        if main:
            ckpt.save_checkpoint(
                out, step, trainable_state(unwrapped), optimizer.state_dict(), scheduler.state_dict(), dict(state),
                rng_states, adapter_model=None if config.full_attention else unwrapped, keep=config.keep_checkpoints,
            )
        accelerator.wait_for_everyone()

    if state["step"] == 0 and not state["evaluations"]:
        run_eval(0)

    model.train()
    progress = tqdm(total=total_steps, initial=state["step"], disable=not (main and show_progress), unit="step",
                    dynamic_ncols=True, desc="recover")
    while state["step"] < total_steps:
        started = time.perf_counter()
        parts = torch.zeros(3, dtype=torch.float64)  # loss, lm loss, distillation loss (summed over micro-batches)
        for micro in range(config.grad_accum):
            first = state["rows_consumed"] + (micro * world + rank) * config.batch_size
            batch = {k: v.to(accelerator.device) for k, v in train_rows.rows(order.rows(first, config.batch_size)).items()}
            mask = target_mask(batch["position_ids"])
            last = micro == config.grad_accum - 1
            sync = contextlib.nullcontext() if last or world == 1 else accelerator.no_sync(model)
            with sync:
                with accelerator.autocast():
                    logits = model(**batch, use_cache=False).logits
                    language = lm_loss(logits, batch["input_ids"], mask)
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_logits = teacher(**batch, use_cache=False).logits
                        distill = distillation_loss(logits, teacher_logits, mask, config.temperature)
                        loss = (1 - config.distill_weight) * language + config.distill_weight * distill
                    else:
                        distill = torch.zeros(())
                        loss = language
                accelerator.backward(loss / config.grad_accum)
            parts += torch.tensor([loss.item(), language.item(), distill.item()], dtype=torch.float64)
        if config.max_grad_norm is not None:
            accelerator.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        parts /= config.grad_accum
        if world > 1:
            parts = accelerator.reduce(parts.to(accelerator.device), "mean").cpu()
        state["step"] += 1
        state["rows_consumed"] += rows_per_step
        state["tokens_trained"] += rows_per_step * config.seq_len
        elapsed = time.perf_counter() - started
        state["train_seconds"] += elapsed
        loss_value = float(parts[0])
        state["losses"].append(loss_value)
        record = {"step": state["step"], "tokens": state["tokens_trained"], "loss": loss_value, "lm_loss": float(parts[1]),
                  "lr": scheduler.get_last_lr()[0], "tokens_per_second": rows_per_step * config.seq_len / elapsed}
        if teacher is not None:
            record["distill_loss"] = float(parts[2])
        write_log(record)
        progress.update(1)
        progress.set_postfix_str(
            f"loss {loss_value:.3f} | {record['tokens_per_second']:.0f} tok/s"
            + (f" | ppl {state['evaluations'][-1]['perplexity']:.2f}" if state["evaluations"] else "")
        )

        step = state["step"]
        if config.eval_every and step % config.eval_every == 0 and step < total_steps:
            run_eval(step)
        if config.save_every and step % config.save_every == 0 and step < total_steps:
            save(step)
    progress.close()
    if not state["evaluations"] or state["evaluations"][-1]["step"] != state["step"]:
        run_eval(state["step"])

    report = {
        "steps": state["step"],
        "tokens_trained": state["tokens_trained"],
        "final_loss": state["losses"][-1] if state["losses"] else None,
        "losses": state["losses"],
        "evaluations": state["evaluations"],
        "seconds": state["train_seconds"],
        "tokens_per_second": state["tokens_trained"] / max(state["train_seconds"], 1e-9),
        "trainable_parameters": trainable_count,
        "total_parameters": total_count,
        "num_processes": world,
        "mixed_precision": mixed,
        "resumed_from": str(resume_from) if resume_from is not None else None,
    }
    accelerator.wait_for_everyone()
    if main:
        write_recovered(accelerator.unwrap_model(model), tokenizer, Path(config.model), out, settings, report)
    accelerator.wait_for_everyone()
    return report
