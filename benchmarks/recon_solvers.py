"""Second-order solvers for the conversion's reconstruction, side by side with its Adam (the quality-per-minute
issue's route 2): does a Gauss-Newton step with Kronecker-factored curvature, or L-BFGS on the whole training set,
fit a converted layer to the source in less time than the default's 160 Adam steps?

    OMP_NUM_THREADS=2 python benchmarks/recon_solvers.py layers --kv-budget 0.125 --layers 2 10 20
    OMP_NUM_THREADS=2 python benchmarks/recon_solvers.py convert --kv-budget 0.125 --solver kfac --out FOLDER

``layers`` runs the default conversion up to the last layer named, keeps those layers' reconstruction problems (the
converted layer before the fit, its inputs and targets, as ``convert/steps/reconstruct.py`` builds them), then fits
each one with every solver from the same start: held-out relative error before and after, seconds, and the
sequence passes (one sequence's forward and backward; a forward alone counts a third) each solver spent.
``convert`` runs the whole default conversion with one solver in the reconstruction's place and writes the model to
--out (scored by ``heal.py score --converted FOLDER``, beside the default's conversion). Both replace ``reconstruct.reconstruct`` in this process
only: the solvers here are not in the product (docs/calibration.md, "tried and not kept").

- ``adam``: the product's reconstruction, unchanged.
- ``lbfgs``: L-BFGS with a strong-Wolfe line search on the whole training set (every parameter in units of its own
  RMS, as Adam's steps are), 4 iterations.
- ``kfac``: 8 Gauss-Newton steps, each on 64 training sequences. Every linear map's curvature is Kronecker-factored,
  (E[a aᵀ] + δ) ⊗ (E[g gᵀ] + δ): its inputs' moment taken in the gradient's own pass, its outputs' Gauss-Newton
  moment from one backward of a random output direction on 8 sequences, δ a tenth of each factor's mean
  eigenvalue. The maps' steps are then scaled together by the Gauss-Newton model of the loss on 16 other
  sequences (the 4 × 4 system of their Jacobian-vector products, by finite differences in float32). Parameters
  that are not a linear map's weight (kv_a_layernorm) take the default's Adam steps. The best held-out point is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
import time
from pathlib import Path

import harness
from arms.problem import forward, split

SOLVERS = ("adam", "lbfgs", "kfac")


@contextlib.contextmanager
def solver_in_place(solver):
    """The conversion's reconstruction replaced by ``solver`` (same signature and report) in this process."""
    import mha2mla.convert.steps.reconstruct as recon

    original = recon.reconstruct
    recon.reconstruct = solver
    try:
        yield original
    finally:
        recon.reconstruct = original


class _Captured(Exception):
    """Raised to end the conversion once the last wanted layer's problem is kept."""


def capture(budget: float, layers: list[int]) -> dict:
    """{layer: (module, data, exact, compute dtype)}: the reconstruction problems of ``layers`` in the default
    conversion of the cached SmolLM2 at ``budget``, each module as it was before its fit."""
    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    kept, seen = {}, [0]

    def keep(module, data, exact, seed=0, compute_dtype=None):
        layer = seen[0]
        seen[0] += 1
        if layer in layers:
            kept[layer] = (copy.deepcopy(module), data, exact, compute_dtype)
        if layer >= max(layers):
            raise _Captured
        return original(module, data, exact, seed, compute_dtype)

    with solver_in_place(keep) as original, tempfile.TemporaryDirectory() as tmp:
        with contextlib.suppress(_Captured):
            convert(harness.source_model(), Path(tmp) / "out", ConvertConfig(kv_budget=budget), progress=False)
    return kept


def lbfgs(module, data, exact, seed=0, compute_dtype=None, iterations=4):
    """L-BFGS (strong Wolfe) on every training sequence, parameters in units of their RMS; the best point kept."""
    import torch

    import mha2mla.convert.steps.reconstruct as recon

    started = time.time()
    train, held_out = split(data)
    _, masks = recon._trainable(module, exact)  # also sets which parameters train
    named = {k: p for k, p in module.named_parameters() if p.requires_grad}
    worker = recon._Worker(module, compute_dtype)
    scales = {k: float(p.detach().pow(2).mean().sqrt().clamp_min(1e-8)) for k, p in named.items()}
    units = {k: (p.detach() / scales[k]).clone().requires_grad_(True) for k, p in named.items()}
    start = {k: p.detach().clone() for k, p in named.items()}
    total = float(data.y[:train].pow(2).sum())
    passes = [0]

    def closure():
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(units[k] * scales[k])
        worker.refresh()
        loss = 0.0
        for first in range(0, train, 8):
            index = slice(first, min(first + 8, train))
            part = (forward(worker.module, data, index).float() - data.y[index]).pow(2).sum() / total
            part.backward()
            loss += float(part)
        passes[0] += train
        worker.grads()
        for k, p in named.items():
            units[k].grad = p.grad * scales[k] * masks.get(k, 1.0)
            p.grad = None
        return torch.tensor(loss)

    before = recon._held_out_error(worker.module, data, held_out)
    torch.optim.LBFGS(list(units.values()), lr=1, max_iter=iterations, line_search_fn="strong_wolfe").step(closure)
    with torch.no_grad():
        for k, p in named.items():
            p.copy_(units[k] * scales[k])
    worker.refresh()
    after = recon._held_out_error(worker.module, data, held_out)
    with torch.no_grad():
        for k, p in named.items():
            if after > before:  # the start kept, as the default keeps it
                p.copy_(start[k])
            p.requires_grad_(False)
    return {"reconstruction_error": before, "reconstruction_error_after": min(after, before),
            "reconstruction_steps": iterations, "reconstruction_curve": [round(before, 5), round(after, 5)],
            "reconstruction_seconds": round(time.time() - started, 2),
            "sequence_passes": round(passes[0] + 2 * len(held_out) / 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["layers", "convert"])
    parser.add_argument("--kv-budget", type=float, default=0.125)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 10, 20], help="layers: the layers fitted")
    parser.add_argument("--solvers", nargs="+", choices=SOLVERS, default=list(SOLVERS))
    parser.add_argument("--solver", choices=SOLVERS, default="kfac", help="convert: the reconstruction's solver")
    parser.add_argument("--out", type=Path, default=None, help="convert: the converted model's folder")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    from arms.recon_kfac import kfac  # the K-FAC solver (benchmarks/arms/: measured, not in the product)

    solvers = {"lbfgs": lbfgs, "kfac": kfac}
    if args.mode == "convert":
        return convert_with(args, solvers)
    return fit_layers(args, solvers)


def fit_layers(args, solvers) -> int:
    """Every solver on every kept layer, from the same start; one row per solver with the layers' figures."""
    import torch

    import mha2mla.convert.steps.reconstruct as recon

    solvers = {"adam": recon.reconstruct, **solvers}
    problems = capture(args.kv_budget, sorted(args.layers))
    rows = []
    for name in args.solvers:
        row = {"kv_budget": args.kv_budget, "solver": name, "layers": [], "held_out_error_before": [],
               "held_out_error_after": [], "seconds": 0.0, "cpu_seconds": 0.0, "sequence_passes": []}
        for layer, (module, data, exact, dtype) in sorted(problems.items()):
            torch.manual_seed(0)
            cpu = time.process_time()  # every thread's CPU seconds: moves far less than wall time with other load
            report = solvers[name](copy.deepcopy(module), data, exact, 0, dtype)
            held_out = split(data)[1]
            steps = report["reconstruction_steps"]  # the default's: a batch each, and a held-out forward per point
            passes = report.get("sequence_passes", steps * recon.BATCH_SEQUENCES
                                + len(report["reconstruction_curve"]) * len(held_out) / 3)
            row["layers"].append(layer)
            row["held_out_error_before"].append(round(report["reconstruction_error"], 5))
            row["held_out_error_after"].append(round(report["reconstruction_error_after"], 5))
            row["seconds"] = round(row["seconds"] + report["reconstruction_seconds"], 2)
            row["cpu_seconds"] = round(row["cpu_seconds"] + time.process_time() - cpu, 2)
            row["sequence_passes"].append(round(passes))
        rows.append(row)
    settings = {"kv_budget": args.kv_budget, "layers": sorted(args.layers), "solvers": args.solvers}
    harness.report("recon-solvers", settings, rows, args.json_out,
                   columns=["solver", "layers", "held_out_error_before", "held_out_error_after", "seconds",
                            "cpu_seconds", "sequence_passes"])
    return 0


def convert_with(args, solvers) -> int:
    from mha2mla.convert.config import ConvertConfig
    from mha2mla.convert.pipeline import convert

    if args.out is None:
        raise SystemExit("convert: give the converted model's folder with --out FOLDER")
    started = time.time()
    if args.solver == "adam":
        result = convert(harness.source_model(), args.out, ConvertConfig(kv_budget=args.kv_budget), progress=False)
    else:
        with solver_in_place(solvers[args.solver]):
            result = convert(harness.source_model(), args.out, ConvertConfig(kv_budget=args.kv_budget), progress=False)
    seconds = time.time() - started
    row = {"kv_budget": args.kv_budget, "solver": args.solver, "convert_seconds": round(seconds, 1),
           "phase_seconds": getattr(result.report, "phase_seconds", None), "folder": str(args.out)}
    harness.report("recon-solvers-convert", {"kv_budget": args.kv_budget, "solver": args.solver}, [row], args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
