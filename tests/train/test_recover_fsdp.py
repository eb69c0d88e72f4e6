"""`mha2mla recover` under FSDP2 on two CPU processes (torchrun, gloo): the same loss curve as one process, the same
checkpoint folder, an exact resume after SIGKILL, and FSDP version 1 refused in one sentence (docs/recover.md). The
same check on CUDA is gpu-marked (benchmarks/gpu_check.sh runs it).

accelerate selects FSDP only on accelerator devices; on CPU processes the recipe switches its state to FSDP when
``ACCELERATE_USE_FSDP=true`` (mha2mla/train/state/gather.py), so these runs go through accelerate's FSDP2 code."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from common import SAMPLE_TEXT
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "DeepseekV3DecoderLayer",
}
# 40 steps of 2 micro-batches (no_sync on the first) of 2 rows per process, in float32 (one process and two must give
# the same curve); 5 held-out rows, so two processes score 3 and 2 rows.
SETTINGS = ["--max-steps", "40", "--seq-len", "32", "--grad-accum", "2", "--lr", "2e-3", "--warmup-steps", "3",
            "--lora-rank", "4", "--eval-sequences", "5", "--eval-every", "10", "--save-every", "10",
            "--compute-dtype", "float32", "--no-progress", "--keep-checkpoints-after-run"]  # compared after the runs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """One long document to train on (the held-out rows come from a first one: whole documents are held out): every
    packed row has the same number of targets, so the mean loss of 4 rows equals the mean of two processes' 2-row
    means, and one process and two must compute the same curve."""
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "held_out.txt").write_text(SAMPLE_TEXT * 20)
    (folder / "one.txt").write_text(SAMPLE_TEXT * 20)
    return folder


def _env(device: str, fsdp: bool) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(FSDP_ENV if fsdp else {})}
    return {**env, "ACCELERATE_USE_CPU": "1"} if device == "cpu" else env


def _processes(device: str) -> int:
    """Two CPU processes (gloo); on GPUs one per GPU, at most two (NCCL takes one GPU per process)."""
    return 2 if device == "cpu" else min(2, torch.cuda.device_count())


def _one_process(model: Path, corpus: Path, out: Path, rows: int) -> list[str]:
    return [sys.executable, "-m", "mha2mla.cli.main", "recover", str(model), "--data", str(corpus), "--out", str(out),
            "--batch-size", str(rows), *SETTINGS]


def _fsdp_run(model: Path, corpus: Path, out: Path, processes: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), "-m",
            "mha2mla.cli.main", "recover", str(model), "--data", str(corpus), "--out", str(out), "--batch-size", "2",
            *SETTINGS, *extra]


def _run(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun starts each worker in a session of its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's id
            found.append(int(stat.parent.name))
    return found


def _kill_after_checkpoint(command: list[str], env: dict[str, str], out: Path, step: int, processes: int) -> None:
    """Start the FSDP run and SIGKILL all of it, the launcher and then every worker, once the checkpoint of
    ``step`` is complete."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (out / "checkpoints" / f"step-{step:06d}").exists() and process.poll() is None:
        time.sleep(0.005)
    workers = _children(process.pid)
    process.send_signal(signal.SIGKILL)
    for worker in workers:
        os.kill(worker, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert len(workers) == processes
    while any(Path(f"/proc/{worker}").exists() and "Z" not in _state(worker) for worker in workers):
        time.sleep(0.01)  # gone (or a zombie of init's) before the resume starts


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "Z"


def _report(out: Path) -> dict:
    return json.loads((out / "recovery_report.json").read_text())


def check_fsdp_run(model: Path, corpus: Path, tmp_path: Path, device: str, curve_rtol: float, resume_rtol: float):
    """FSDP over ``_processes(device)`` processes against one process reading the same rows per micro-batch: the
    loss and perplexity curves (``curve_rtol``), the checkpoint folder, then SIGKILL after step 20 and
    ``--resume auto`` against the uninterrupted FSDP run (``resume_rtol``)."""
    processes = _processes(device)
    single, fsdp, killed = tmp_path / "single", tmp_path / "fsdp", tmp_path / "killed"
    _run(_one_process(model, corpus, single, rows=2 * processes), _env(device, fsdp=False))
    _run(_fsdp_run(model, corpus, fsdp, processes), _env(device, fsdp=True))
    one, two = _report(single), _report(fsdp)
    assert (one["num_processes"], two["num_processes"], two["steps"]) == (1, processes, 40)
    assert two["tokens_trained"] == one["tokens_trained"] == 40 * 2 * 2 * processes * 32
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=curve_rtol, atol=0)
    perplexities = [[e["perplexity"] for e in report["evaluations"]] for report in (one, two)]
    torch.testing.assert_close(torch.tensor(perplexities[1]), torch.tensor(perplexities[0]), rtol=curve_rtol, atol=0)

    # the same checkpoint folder: full trainable tensors by name, the optimizer state by parameter index
    ckpt_one, ckpt_two = single / "checkpoints" / "step-000020", fsdp / "checkpoints" / "step-000020"
    assert {p.name for p in ckpt_two.iterdir()} == {p.name for p in ckpt_one.iterdir()} | {
        f"rng_state_{rank}.pt" for rank in range(processes)}
    weights_one, weights_two = load_file(str(ckpt_one / "trainable.safetensors")), load_file(str(ckpt_two / "trainable.safetensors"))
    assert weights_two.keys() == weights_one.keys()
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-3, atol=1e-5)
    optimizer_one, optimizer_two = (torch.load(c / "optimizer.pt", weights_only=True) for c in (ckpt_one, ckpt_two))
    assert optimizer_two["param_groups"] == optimizer_one["param_groups"]
    assert optimizer_two["state"].keys() == optimizer_one["state"].keys() == set(range(len(weights_one)))
    assert all(optimizer_two["state"][i]["exp_avg"].shape == optimizer_one["state"][i]["exp_avg"].shape
               for i in optimizer_one["state"])
    adapter = dict(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), ckpt_two / "adapter").named_parameters())
    for name, tensor in weights_two.items():  # written from the gathered tensors, not from one process's shards
        torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=0)

    env = _env(device, fsdp=True)
    _kill_after_checkpoint(_fsdp_run(model, corpus, killed, processes), env, killed, step=20, processes=processes)
    assert not (killed / "config.json").exists()
    _run(_fsdp_run(model, corpus, killed, processes, "--resume", "auto"), env)
    resumed = _report(killed)
    assert resumed["resumed_from"] is not None and int(Path(resumed["resumed_from"]).name[5:]) >= 20
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(two["losses"]), rtol=resume_rtol, atol=0)
    merged_two, merged_resumed = load_file(str(fsdp / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    for name, tensor in merged_two.items():
        torch.testing.assert_close(merged_resumed[name], tensor, rtol=resume_rtol, atol=1e-7)
    assert AutoModelForCausalLM.from_pretrained(killed).config.model_type == "deepseek_v3"


def test_fsdp_on_two_cpu_processes_matches_one_process_and_resumes_after_sigkill(tiny_mla, corpus, tmp_path):
    check_fsdp_run(tiny_mla, corpus, tmp_path, "cpu", curve_rtol=1e-5, resume_rtol=1e-6)


@pytest.mark.gpu
def test_fsdp_on_gpus_matches_one_process_and_resumes_after_sigkill(tiny_mla, corpus, tmp_path):
    """The same on CUDA (benchmarks/gpu_check.sh): NCCL, fp32; cuBLAS picks kernels by batch shape, so the curve
    is compared to 1e-4 rather than 1e-5."""
    check_fsdp_run(tiny_mla, corpus, tmp_path, "cuda", curve_rtol=1e-4, resume_rtol=1e-5)


def test_fsdp_version_1_is_refused_in_one_sentence(tiny_mla, corpus, tmp_path):
    out = tmp_path / "out"
    env = {**_env("cpu", fsdp=True), "FSDP_VERSION": "1"}
    result = subprocess.run(_fsdp_run(tiny_mla, corpus, out, 2), env=env, capture_output=True, text=True,
                            check=False, timeout=600)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all("recover runs FSDP version 2 only" in line for line in errors)  # one per process
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr)  # the workers' exit status, as torchrun reports it
    assert "mha2mla/train" not in result.stderr  # torchrun prints its own traceback, none of ours
    assert not out.exists()
