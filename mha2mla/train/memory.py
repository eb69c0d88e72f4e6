"""How much memory a recovery run needs, from the model's shapes and the run's settings, before anything loads
(``mha2mla recover --dry-run``, and the first lines of every run; docs/recover.md, "Memory").

The parameter counts are exact (``meta_counts``): the student (and a teacher folder) are built on torch's ``meta``
device from their config.json and made trainable as the run makes them (LoRA, full attention or full layers), which
allocates nothing.
The rest is counted per process from what the run holds at its peak, the end of a training step's forward pass
or its backward pass:

- weights: every student parameter in float32 (frozen ones too: bf16 runs autocast over float32 weights);
- gradients: float32, trainable parameters; optimizer: AdamW's two float32 moments per trainable parameter;
- teacher: its parameters in the compute dtype (a GGUF teacher is counted as the student: same vocabulary and
  widths, only attention differs);
- activations: what autograd keeps per token and decoder layer (:func:`saved_per_token`) over the micro-batch (with
  activation checkpointing, each layer's input instead of the whole), and the gradient of the final hidden states,
  which the lm_head losses make in the forward pass: held from the forward pass to the end of the backward pass;
- backward: what the backward pass makes as it goes: the layer it recomputes (full checkpointing: the whole layer;
  selective: what the layer does not keep) and the gradients flowing through the residual stream;
- logit chunks: the lm_head losses' chunk temporaries (head_losses.py), made and freed at the end of the forward
  pass, so they never coexist with the backward pass's: the larger of the two counts;
- logits: under FSDP, whole logits (student, teacher, gradient) as ``logit_losses`` needs them, held through the
  backward pass;
- data: a streamed ``--data`` (or default healing text) at its peak, a block of rows being built and a tokenizer
  call (stream.peak_bytes), or every packed row of teacher-generated text (input ids and positions, int64); and the
  held-out rows.

The estimate is the sum of the parts, the larger of backward and logit chunks only; a run whose estimate exceeds
the memory the device has free is refused in one sentence. It leaves out what the process holds before the run
(torch, transformers, the tokenizer) and allocator slack.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.io.loader import meta_causal_lm
from mha2mla.io.model_folder import CONFIG_FILE
from mha2mla.train.config import RecoverConfig
from mha2mla.train.data.stream import peak_bytes
from mha2mla.train.losses import CHUNK_POSITIONS
from mha2mla.train.model.trainable import ParameterCounts, count_parameters, make_trainable

log = logging.getLogger(__name__)

GIB = 2**30
# float32 (positions x vocabulary) chunk temporaries the lm_head losses hold at once beside the chunk's logits (in
# the compute dtype) and their float32 copy: the softmax that becomes the gradient; with a teacher also the
# student's log-softmax at the temperature, the teacher's and its softmax (losses.chunk_losses)
CHUNK_COPIES = {False: 1, True: 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process, by what holds them."""

    weights: int
    gradients: int
    optimizer: int
    teacher: int
    activations: int
    backward: int
    logit_chunks: int
    logits: int
    data: int

    @property
    def total(self) -> int:
        """The peak: every part but the smaller of backward and logit chunks, which never coexist."""
        return sum(vars(self).values()) - min(self.backward, self.logit_chunks)

    def lines(self) -> list[str]:
        """One line per part and the total, in GiB."""
        parts = [f"  {name:<12} {value / GIB:8.3f} GiB" for name, value in vars(self).items()]
        return [*parts, f"  {'total':<12} {self.total / GIB:8.3f} GiB (backward and logit chunks: the larger only)"]


def meta_counts(config: RecoverConfig) -> ParameterCounts:
    """The parameter counts of ``config``'s run before anything loads: the student made trainable as the run makes
    it, and the teacher when it is a model folder (a GGUF or hub teacher is counted as the student by the estimate)."""
    teacher = None
    if config.teacher is not None and (Path(config.teacher) / CONFIG_FILE).is_file():
        teacher = sum(p.numel() for p in meta_causal_lm(config.teacher).parameters())
    student = meta_causal_lm(config.model)
    with warnings.catch_warnings():  # peft warns that meta tensors cannot be initialised: nothing to initialise
        warnings.simplefilter("ignore")
        student = make_trainable(student, config.adapter, layers=config.full_layers)
    return ParameterCounts(*count_parameters(student), teacher)


def _widths(model_config: dict) -> tuple[int, int, int, int, int, int, int]:
    """hidden, heads, qk_nope, qk_rope, v_head and kv_lora_rank dims, and heads x (nope + rope), of an MLA config."""
    hidden, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    nope, rope = model_config.get("qk_nope_head_dim", 0), model_config.get("qk_rope_head_dim", 0)
    value = model_config.get("v_head_dim", nope + rope)
    return hidden, heads, nope, rope, value, model_config.get("kv_lora_rank") or 0, heads * (nope + rope)


def selective_per_token(model_config: dict) -> int:
    """Elements a selectively checkpointed layer keeps per token (mha2mla/modeling/checkpointing.py): its input and
    the outputs of its matrix products (q, the latent with the rope key, the per-head keys and values, o_proj,
    gate, up, down) and of the fused attention (padded to the query's head dim)."""
    hidden, heads, nope, rope, value, latent, query = _widths(model_config)
    return 2 * hidden + query + latent + rope + heads * (nope + value) + query + 2 * hidden + 2 * model_config[
        "intermediate_size"]


def saved_per_token(model_config: dict, config: RecoverConfig) -> int:
    """Elements autograd keeps per token in one decoder layer of a converted (DeepSeek-V3 MLA) model: the two
    RMSNorms' inputs and outputs (3 x hidden each), the attention's projections (q, the latent and its norm, the
    per-head keys and values, the rotary copies, the padded value and the attention output SDPA saves) and the
    MLP's gate, up, activation and product (the product only when the MLP trains: a frozen down projection keeps
    no input); LoRA adds its rank per adapted projection."""
    hidden, heads, nope, rope, value, latent, query = _widths(model_config)
    intermediate = model_config["intermediate_size"]
    norms = 2 * 3 * hidden
    attention = 5 * query + heads * (nope + value) + heads * value + 3 * latent + 2 * rope
    mlp = (4 if config.full_layers else 3) * intermediate
    lora = 0 if config.adapter is None else 2 * config.adapter.rank * len(config.adapter.targets)
    return norms + attention + mlp + lora


def kept_and_recomputed(model_config: dict, mode: str, per_layer: int) -> tuple[int, int]:
    """Elements per token that activation checkpointing ``mode`` keeps over every decoder layer and that the backward
    pass recomputes of one layer at a time (``per_layer``: what a layer keeps without checkpointing). ``auto`` is
    decided before anything is estimated (resolve_checkpointing)."""
    if mode == "auto":
        raise ValueError("activation_checkpointing auto is decided by resolve_checkpointing before a run is estimated")
    layers, hidden, selective = model_config["num_hidden_layers"], model_config["hidden_size"], \
        selective_per_token(model_config)
    kept = {"none": layers * per_layer, "full": layers * hidden, "selective": layers * selective}[mode]
    recomputed = {"none": 0, "full": per_layer, "selective": max(0, per_layer - selective)}[mode]
    return kept, recomputed


def estimate(config: RecoverConfig, counts: ParameterCounts, total_steps: int, compute_dtype: str = "float32",
             world: int = 1, sharded: bool = False) -> MemoryEstimate:
    """The run's memory per process (``world`` processes; ``sharded``: FSDP, weights and states split over them),
    from the parameter counts (meta_counts) and the run's optimizer steps."""
    model_config = json.loads((Path(config.model) / CONFIG_FILE).read_text())
    trainable, total = counts.trainable, counts.total
    split = world if sharded else 1
    compute_bytes = 2 if compute_dtype == "bfloat16" else 4
    tokens = config.batch_size * config.seq_len  # one micro-batch
    hidden, vocab = model_config["hidden_size"], model_config["vocab_size"]
    per_layer = saved_per_token(model_config, config)
    kept, recomputed = kept_and_recomputed(model_config, config.activation_checkpointing, per_layer)
    backward = tokens * (recomputed + 4 * hidden) * compute_bytes
    teacher = 0
    if config.teacher is not None:
        teacher = (counts.teacher if counts.teacher is not None else total) * compute_bytes
    chunk = min(CHUNK_POSITIONS, tokens)
    activations = tokens * kept * compute_bytes + tokens * hidden * 4
    logits_copy = compute_bytes + (4 if compute_bytes != 4 else 0)  # the chunk's logits and their float32 copy
    logit_chunks = chunk * vocab * (logits_copy * (2 if config.teacher is not None else 1)
                                    + 4 * CHUNK_COPIES[config.teacher is not None])
    # whole logits under FSDP: the student's and its gradient, and the teacher's
    logits = tokens * vocab * compute_bytes * (3 if config.teacher is not None else 2) if sharded else 0
    # --data and the default healing text are streamed (stream.peak_bytes); teacher-generated rows are all held
    streamed = bool(config.data) or config.default_data == "general"
    held = peak_bytes(config.data, config.seq_len) if streamed else total_steps * config.batch_size * \
        config.grad_accum * world * config.seq_len * 16
    data = held + config.eval_sequences * config.seq_len * 16
    return MemoryEstimate(weights=total * 4 // split, gradients=trainable * 4 // split, optimizer=trainable * 8 // split,
                          teacher=teacher, activations=activations, backward=backward, logit_chunks=logit_chunks,
                          logits=logits, data=data)


def free_memory(device: torch.device) -> int | None:
    """Bytes the device has free now: a GPU's free memory, or the host's MemAvailable (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else None
    return pages * os.sysconf("SC_PAGE_SIZE") if pages else None


def check_fits(memory: MemoryEstimate, device: torch.device, free: int | None = None) -> None:
    """Refuse in one sentence a run that needs more than the device has free."""
    free = free_memory(device) if free is None else free
    if free is not None and memory.total > free:
        raise UserError(f"this run needs about {memory.total / GIB:.1f} GiB per process on {device} but only "
                        f"{free / GIB:.1f} GiB is free; lower --batch-size or --seq-len (raise --grad-accum to keep "
                        "the tokens per step), train LoRA instead of full layers, or use a larger device.")


@dataclass(frozen=True)
class SizedRun:
    """A run's settings with its activation checkpointing decided (``auto`` resolved), their estimate, and why that
    checkpointing, in a few words."""

    config: RecoverConfig
    memory: MemoryEstimate
    why: str

    @property
    def checkpointing_line(self) -> str:
        return f"activation checkpointing: {self.config.activation_checkpointing} ({self.why})"


def resolve_checkpointing(config: RecoverConfig, counts: ParameterCounts, total_steps: int,
                          compute_dtype: str = "float32", world: int = 1, sharded: bool = False,
                          free: int | None = None) -> SizedRun:
    """``config``'s activation checkpointing decided once, for the whole run: a mode given stays; ``auto`` is full
    when every decoder layer trains (full_layers: there it lowers the peak most, for about one more forward per
    step), else none, or the least of selective and full that brings the estimate under ``free`` bytes (None:
    unknown, so none). Where nothing fits, full: check_fits then refuses the run."""
    def sized(mode: str, why: str) -> SizedRun:
        resolved = config.model_copy(update={"activation_checkpointing": mode})
        return SizedRun(resolved, estimate(resolved, counts, total_steps, compute_dtype, world, sharded), why)

    if config.activation_checkpointing != "auto":
        return sized(config.activation_checkpointing, "as set")
    if config.full_layers:
        return sized("full", "auto: every decoder layer trains, where keeping only each layer's input saves the most "
                             "memory for about one more forward per step; --activation-checkpointing none turns it off")
    plain = sized("none", "auto: only part of the model trains and the estimate fits the free memory without it")
    if free is None or plain.memory.total <= free:
        return plain
    why = (f"auto: without it the estimate, {plain.memory.total / GIB:.1f} GiB, would not fit the {free / GIB:.1f} "
           "GiB free")
    selective = sized("selective", why)
    return selective if selective.memory.total <= free else sized("full", why)


def least_free(devices) -> int | None:
    """The free memory of the most crowded of the run's processes (devices.Devices), so that every process decides
    its checkpointing and its refusal alike (None: unknown)."""
    free = free_memory(devices.device)
    if devices.world == 1:
        return free
    unknown = 2**62
    gathered = devices.accelerator.gather(torch.tensor([unknown if free is None else free], device=devices.device))
    least = int(gathered.min())
    return None if least == unknown else least


def planned(config: RecoverConfig) -> tuple[SizedRun, torch.device, str]:
    """The estimate of ``config``'s run on the device it would run on, without starting it (``--dry-run``): the
    run sized (its checkpointing decided), the device and the compute dtype, resolved as the run resolves them
    (devices.py)."""
    from mha2mla.compute import resolve_compute_dtype
    from mha2mla.train.devices import run_device

    device = run_device()
    compute_dtype = resolve_compute_dtype(config.compute_dtype, device.type, cpu_bf16=config.adapter is None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharded = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")
    sized = resolve_checkpointing(config, meta_counts(config), config.total_steps(world), compute_dtype, world,
                                  sharded and world > 1, free_memory(device))
    return sized, device, compute_dtype


def check_run_memory(config: RecoverConfig, counts: ParameterCounts, total_steps: int, devices) -> SizedRun:
    """The run sized on ``devices`` (devices.Devices): its checkpointing decided and its estimate, refused in one
    sentence if it does not fit. Nothing is logged here: log_estimate states it once the run's inputs have read."""
    free = least_free(devices)
    sized = resolve_checkpointing(config, counts, total_steps, devices.compute_dtype, devices.world, devices.sharded,
                                  free)
    check_fits(sized.memory, devices.device, free)
    return sized


def log_estimate(sized: SizedRun, devices) -> None:
    """The estimate's lines and the checkpointing line, logged by the main process as the run starts training."""
    if devices.is_main:
        log.info("memory per process, estimated (%s, %s; docs/recover.md, \"Memory\"):\n%s", devices.device,
                 devices.compute_dtype, "\n".join(sized.memory.lines()))
        log.info("%s", sized.checkpointing_line)
