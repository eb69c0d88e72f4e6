"""The K-FAC Gauss-Newton solver of benchmarks/recon_solvers.py (a measured arm, not in the product): a converted
layer fitted to its reconstruction target in a few curvature-scaled steps, with the signature and report of
``mha2mla.convert.steps.reconstruct.reconstruct``. What each step does: recon_solvers.py's docstring."""

from __future__ import annotations

import time

from arms.problem import forward, split

STEPS, STEP_SEQUENCES, FACTOR_SEQUENCES, MODEL_SEQUENCES, CHUNK = 8, 64, 8, 16, 8
DAMPING = 0.1  # each factor's damping, as a fraction of its mean eigenvalue
MODEL_DAMPING = 0.1  # the step-size system's Levenberg-Marquardt damping, relative to its diagonal
PROBE = 1e-3  # the finite-difference step, relative to each map's weight norm


class _Taps:
    """Forward and backward hooks on every linear map of ``module``: its inputs and output gradients, while on."""

    def __init__(self, module):
        import torch

        self.maps = {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad}
        self.inputs, self.grads, self.on = {}, {}, False
        for name, linear in self.maps.items():
            linear.register_forward_hook(lambda mod, inp, out, name=name: self._keep(self.inputs, name, inp[0]))
            linear.register_full_backward_hook(lambda mod, gin, gout, name=name: self._keep(self.grads, name, gout[0]))

    def _keep(self, where: dict, name: str, tensor) -> None:
        if self.on:
            where[name] = tensor.detach().reshape(-1, tensor.shape[-1]).float()


def _output_factors(worker, taps, data, index, generator) -> dict:
    """Σ g gᵀ per map for one backward of a standard normal output direction on ``index`` (Gauss-Newton's
    output-side moment, up to the loss's scale)."""
    import torch

    taps.on = True
    out = forward(worker, data, index)
    out.backward(torch.randn(out.shape, generator=generator).to(out.dtype))
    taps.on = False
    worker.zero_grad(set_to_none=True)
    return {name: g.T @ g for name, g in taps.grads.items()}


def _gradient_and_inputs(worker, taps, data, index) -> tuple[dict, float]:
    """The loss's gradient on ``index`` (left in the worker's .grad) and Σ a aᵀ per map from the same forwards;
    returns the input moments and the targets' energy (the loss's denominator)."""
    total = float(data.y[index].pow(2).sum())
    moments = {}
    for start in range(0, len(index), CHUNK):
        part = index[start : start + CHUNK]
        taps.on = True
        out = forward(worker, data, part)
        taps.on = False
        for name, a in taps.inputs.items():
            moments[name] = moments.get(name, 0) + a.T @ a
        ((out.float() - data.y[part]).pow(2).sum() / total).backward()
    return moments, total


def _inverse(factor):
    import torch

    mean = float(factor.trace() / factor.shape[0])
    return torch.linalg.inv(factor + DAMPING * mean * torch.eye(factor.shape[0]))


def _directions(named, taps, inputs, outputs, tokens: int, total: float, masks: dict, sampled: float) -> dict:
    """Per map, the damped Kronecker-factored Gauss-Newton direction (G + δ)⁻¹ ∇W (A + δ)⁻¹ of the loss
    Σ‖f − y‖² / ``total`` over ``tokens`` tokens; ``sampled``: those tokens over the output factors' tokens."""
    directions = {}
    for name in taps.maps:
        weight = named[name + ".weight"]
        gauss_newton = outputs[name] * (2.0 / total) * sampled
        step = _inverse(gauss_newton) @ weight.grad @ _inverse(inputs[name] / tokens)
        directions[name + ".weight"] = step * masks.get(name + ".weight", 1.0)
    return directions


def _model_scales(module, data, index, directions: dict):
    """The steps' joint scales from the Gauss-Newton model of the loss on ``index``: with J d_i by finite
    differences of the float32 masters, minimise ‖r − Σ c_i J d_i‖² (Levenberg-Marquardt-damped)."""
    import torch

    rope = tuple(t.float() for t in data.position_embeddings)
    mask = None if data.attention_mask is None else data.attention_mask.float()

    def forward():
        return module(data.x[index].float(), position_embeddings=rope, attention_mask=mask)[0].double()

    named = dict(module.named_parameters())
    with torch.no_grad():
        base = forward()
        residual = (base - data.y[index].double()).reshape(-1)
        columns = []
        for name, direction in directions.items():
            start = named[name].detach().clone()
            eps = PROBE * float(start.norm() / direction.norm().clamp_min(1e-30))
            named[name].sub_(eps * direction)
            columns.append(((forward() - base) / eps).reshape(-1))
            named[name].copy_(start)
    jacobian = torch.stack(columns)
    system = jacobian @ jacobian.T
    system += MODEL_DAMPING * torch.diag(system.diagonal())
    return -torch.linalg.solve(system, jacobian @ residual)


def kfac(module, data, exact, seed=0, compute_dtype=None) -> dict:
    """Fit ``module`` (the float32 masters) in place in ``STEPS`` Gauss-Newton steps; the best held-out point kept."""
    import torch

    import mha2mla.convert.steps.reconstruct as recon

    started = time.time()
    train, held_out = split(data)
    _, masks = recon._trainable(module, exact)  # also sets which parameters train
    named = dict(module.named_parameters())
    worker = recon._Worker(module, compute_dtype)
    taps = _Taps(worker.module)
    others = [p for k, p in named.items() if p.requires_grad and k.removesuffix(".weight") not in taps.maps]
    adam = torch.optim.Adam([{"params": [p], "lr": recon.LEARNING_RATE * float(p.detach().pow(2).mean().sqrt())}
                             for p in others]) if others else None
    generator = torch.Generator().manual_seed(seed)
    best = before = recon._held_out_error(worker.module, data, held_out)
    curve, best_state, passes = [before], {k: p.detach().clone() for k, p in named.items()}, len(held_out) / 3
    for _ in range(STEPS):
        order = torch.randperm(train, generator=generator)
        outputs = _output_factors(worker.module, taps, data, order[:FACTOR_SEQUENCES], generator)
        index = order[-STEP_SEQUENCES:]
        inputs, total = _gradient_and_inputs(worker.module, taps, data, index)
        worker.grads()
        with torch.no_grad():
            directions = _directions(named, taps, inputs, outputs, len(index) * data.x.shape[1], total, masks,
                                     len(index) / FACTOR_SEQUENCES)
            probe = order[FACTOR_SEQUENCES : FACTOR_SEQUENCES + MODEL_SEQUENCES]
            for (name, direction), scale in zip(directions.items(), _model_scales(module, data, probe, directions)):
                named[name].sub_(float(scale) * direction)
        if adam is not None:
            adam.step()
        for p in named.values():
            p.grad = None
        worker.refresh()
        # float32 forwards counted as two bf16 ones: 1 + one per map on the probe sequences
        passes += FACTOR_SEQUENCES + STEP_SEQUENCES + (1 + len(directions)) * MODEL_SEQUENCES * 2 / 3 + len(held_out) / 3
        error = recon._held_out_error(worker.module, data, held_out)
        curve.append(error)
        if error < best:
            best, best_state = error, {k: p.detach().clone() for k, p in named.items()}
    with torch.no_grad():
        for k, p in named.items():
            p.copy_(best_state[k])
            p.requires_grad_(False)
    return {"reconstruction_error": before, "reconstruction_error_after": best, "reconstruction_steps": STEPS,
            "reconstruction_curve": [round(e, 5) for e in curve], "reconstruction_seconds": round(time.time() - started, 2),
            "sequence_passes": round(passes)}
