"""Layer-wise reconstruction (docs/calibration.md, "reconstruction"): the converted layer's attention
parameters fitted by gradient descent so that its output matches the source layer's on the calibration
sequences — the keys and the softmax included, where the closed forms stop.

One layer at a time, as post-training quantisation reconstructs blocks: the inputs x come from the
converted stream, the targets y from the source stream — the source layer's attention output plus the
drift h_source − h_converted that the earlier converted layers left in the residual stream, so that the
converted residual after this attention matches the source's where the attention can make it (the target
chosen over the attention output alone and over whole blocks: docs/benchmarks.md) — except at attention
sinks (``MASSIVE_NORM_RATIO``), whose drift is left out. Adam on a relative squared error,
E‖f(x) − y‖² / E‖y‖²; every parameter's step size is relative to its own RMS, warmed up over
``WARMUP_STEPS`` and decayed to zero by a cosine over ``MAX_STEPS``. A part of the sequences is held out:
its loss is evaluated every ``EVAL_EVERY`` steps, the best point is kept (the initial one included, so reconstruction never makes the held-out
error worse) and the loop stops after ``PATIENCE`` measurements without a gain. What the profile must
keep fixed stays fixed: in the exact profile the constant channel (its kv_a row and bias) and the
neutralised kv_a_layernorm.

In the compute dtype (mha2mla/compute.py) as mixed precision: the module given holds the float32 master
weights that Adam updates; the forward and backward run on a copy in the compute dtype, refreshed from the
masters after every step, on inputs kept in that dtype; the loss and the targets are float32.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch

from mha2mla.convert.steps.records import LayerWork
from mha2mla.convert.steps.registry import register

MAX_STEPS = 160
WARMUP_STEPS = 10
EVAL_EVERY = 40
PATIENCE = 1
BATCH_SEQUENCES = 4
# peak step size relative to each parameter's RMS, and the step count: the schedule chosen on SmolLM2
# (docs/benchmarks.md, "reconstruction")
# Fused Adam keeps its step counts on the parameters' device, so a GPU is not synced once per step; on the CPU the
# plain Adam stays, whose rounding the quality figures have (docs/benchmarks.md; fused rounds differently).
FUSED_ADAM_DEVICES = ("cuda",)
LEARNING_RATE = 8e-3
HELD_OUT_FRACTION = 0.125
# a token whose source residual norm passes this multiple of the layer's median token norm carries a massive
# activation (an attention sink): its drift is left out of the target, since the attention cannot cancel it and
# it would dominate the loss (docs/calibration.md, "reconstruction"; where SmolLM2 has them: docs/benchmarks.md)
MASSIVE_NORM_RATIO = 20.0


@dataclass
class ReconstructionData:
    x: torch.Tensor  # (N, L, D): the converted stream's attention inputs
    y: torch.Tensor  # (N, L, D): the targets (the source layer's attention outputs, plus the residual drift)
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # the target rope (cos, sin) for L positions
    attention_mask: torch.Tensor | None = None  # the causal mask, for eager attention (None: the module's sdpa is causal)


@torch.no_grad()
def massive_tokens(source_hidden: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """(N, L) bool: the tokens of the source stream ``source_hidden`` (N, L, D) whose norm passes
    ``MASSIVE_NORM_RATIO`` times the median token norm."""
    norms = torch.cat([source_hidden[i : i + chunk].norm(dim=-1) for i in range(0, source_hidden.shape[0], chunk)])
    return norms > MASSIVE_NORM_RATIO * norms.median()


def _trainable(module: torch.nn.Module, exact: bool) -> tuple[list[torch.nn.Parameter], dict[str, torch.Tensor]]:
    """The parameters to fit and, per parameter name, a 0/1 mask of the entries that may move."""
    params, masks = [], {}
    for name, param in module.named_parameters():
        frozen = exact and (name.startswith("kv_a_layernorm") or name.startswith("q_a_layernorm")
                            or name in ("kv_a_proj_with_mqa.bias", "q_a_proj.bias", "q_a_proj.weight"))
        param.requires_grad_(not frozen)
        if frozen:
            continue
        if exact and name == "kv_a_proj_with_mqa.weight":  # the constant channel's row stays zero
            mask = torch.ones_like(param)
            mask[module.kv_lora_rank - 1] = 0
            masks[name] = mask
        params.append(param)
    return params, masks


def _loss(module: torch.nn.Module, data: ReconstructionData, index: slice | torch.Tensor) -> torch.Tensor:
    """The relative squared error of ``module`` (the compute-dtype copy) on sequences ``index``, in float32."""
    x, y = data.x[index], data.y[index]
    out = module(x, position_embeddings=data.position_embeddings, attention_mask=data.attention_mask)[0]
    return (out.float() - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30)


class _Worker:
    """The copy of the master ``module`` that runs forward and backward in ``dtype`` (the module itself in
    float32): ``grads()`` hands its gradients to the masters, ``refresh()`` copies the updated masters back."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.master = module
        self.module = module if dtype == torch.float32 else copy.deepcopy(module).to(dtype)
        self.pairs = [(m, w) for m, w in zip(module.parameters(), self.module.parameters()) if m is not w]
        for m, w in self.pairs:
            w.requires_grad_(m.requires_grad)

    def grads(self) -> None:
        for m, w in self.pairs:
            if w.grad is not None:
                m.grad = w.grad.float()
                w.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        for m, w in self.pairs:
            w.copy_(m)


@torch.no_grad()
def _held_out_error(module, data, held_out: range) -> float:
    """The relative error on the held-out sequences: summed on the data's device, read back once (one host sync)."""
    wide = torch.float32 if data.y.device.type == "mps" else torch.float64  # MPS has no float64
    num = torch.zeros((), dtype=wide, device=data.y.device)
    den = torch.zeros((), dtype=wide, device=data.y.device)
    for start in range(held_out.start, held_out.stop, BATCH_SEQUENCES):
        index = slice(start, min(start + BATCH_SEQUENCES, held_out.stop))
        out = module(data.x[index], position_embeddings=data.position_embeddings, attention_mask=data.attention_mask)[0]
        num += (out.float() - data.y[index]).pow(2).sum()
        den += data.y[index].pow(2).sum()
    return float((num / den.clamp_min(1e-30)).sqrt())


def _batches(num_train: int, seed: int) -> torch.Tensor:
    """(MAX_STEPS, BATCH_SEQUENCES) training sequence indices, drawn up front: each step's a random subset."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_train, generator=generator)[:BATCH_SEQUENCES] for _ in range(MAX_STEPS)])


def reconstruct(module: torch.nn.Module, data: ReconstructionData, exact: bool, seed: int = 0,
                compute_dtype: torch.dtype = torch.float32) -> dict:
    """Fit ``module`` (a float32 DeepseekV3Attention holding the converted layer) in place, its forwards and
    backwards in ``compute_dtype`` (the dtype of ``data.x``); returns the report: held-out relative error before
    and after, steps taken, seconds."""
    started = time.time()
    N = data.x.shape[0]
    held = max(1, round(N * HELD_OUT_FRACTION))
    train, held_out = range(0, N - held), range(N - held, N)
    params, masks = _trainable(module, exact)
    scales = [float(p.detach().pow(2).mean().sqrt().clamp_min(1e-8)) for p in params]
    fused = data.x.device.type in FUSED_ADAM_DEVICES
    optimizer = torch.optim.Adam([{"params": [p], "lr": LEARNING_RATE * s} for p, s in zip(params, scales)], fused=fused)
    peaks = [group["lr"] for group in optimizer.param_groups]
    named = dict(module.named_parameters())
    worker = _Worker(module, compute_dtype)
    best_error = before = _held_out_error(worker.module, data, held_out)
    curve = [before]  # the held-out error at each measurement
    best_state = {name: p.detach().clone() for name, p in named.items()}
    batches = _batches(len(train), seed).to(data.x.device)  # (MAX_STEPS, BATCH_SEQUENCES): one copy to the device
    steps, waited = 0, 0
    module.train(False)
    while steps < MAX_STEPS and waited < PATIENCE:
        for _ in range(EVAL_EVERY):
            batch = batches[steps]
            factor = min(1.0, (steps + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * steps / MAX_STEPS))
            for group, peak in zip(optimizer.param_groups, peaks):
                group["lr"] = peak * factor
            optimizer.zero_grad()
            _loss(worker.module, data, batch).backward()
            worker.grads()
            for name, mask in masks.items():
                named[name].grad.mul_(mask)
            optimizer.step()
            worker.refresh()
            steps += 1
        error = _held_out_error(worker.module, data, held_out)
        curve.append(error)
        if error < best_error:
            best_error, waited = error, 0
            best_state = {name: p.detach().clone() for name, p in named.items()}
        else:
            waited += 1
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(best_state[name])
            p.requires_grad_(False)
    return {"reconstruction_error": before, "reconstruction_error_after": best_error, "reconstruction_steps": steps,
            "reconstruction_curve": [round(error, 5) for error in curve], "reconstruction_seconds": round(time.time() - started, 2)}


@register("reconstruct", "gradient", needs_activations=True)
def gradient_reconstruction(work: LayerWork) -> None:
    """The converted layer fitted by gradient descent (:func:`reconstruct`) on the inputs of the stream being
    calibrated, towards the source stream's residual after the attention: the source layer's attention output
    plus the drift h_source − h_converted the earlier converted layers left, except at attention sinks. Without
    a second stream there is no drift to take up."""
    activations, tensors = work.activations, work.tensors
    target = activations.target_attention(tensors, dtype=torch.float32)  # the master weights
    hidden, source_hidden = activations.hidden, activations.source_hidden
    with torch.no_grad():
        x = torch.cat([activations.normed(hidden[batch]) for batch in activations.batches()])
        heads = activations.source_heads()
        # an attention sink's drift is left out: the attention cannot cancel it, and it would dominate the loss
        massive = None if source_hidden is None else massive_tokens(source_hidden).to(activations.device)
        targets = []
        for batch in activations.batches():
            y = activations.source_output(None, heads[batch])
            if massive is not None:
                y += (source_hidden[batch] - hidden[batch]) * ~massive[batch, :, None]
            targets.append(y)
        y = torch.cat(targets)
    # the stream's attention choice: on a CPU the eager softmax with the explicit causal mask, on a GPU causal sdpa
    stream = activations.stream
    data = ReconstructionData(x, y, stream.target_rope, stream.target_mask)
    report = reconstruct(target, data, exact=work.plan.profile == "exact", compute_dtype=activations.compute)
    report["reconstruction_massive_tokens"] = 0 if massive is None else int(massive.sum())
    state = target.state_dict()
    work.tensors = {name: state[name].to(tensor.dtype).cpu() for name, tensor in tensors.items()}
    work.report.update(report)
