"""Resumable checkpoints: ``OUT/step-NNNNNN/`` holds the trainable weights (and the peft adapter),
optimizer, scheduler, every RNG state and the data position. A folder is written as ``step-NNNNNN.tmp``
and renamed when complete, so a run killed while saving leaves the previous checkpoint usable."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mha2mla import UserError

STEP_PATTERN = re.compile(r"^step-(\d{6,})$")
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"


def step_folder(out: Path, step: int) -> Path:
    return out / f"step-{step:06d}"


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints in ``out``, oldest first."""
    if not out.is_dir():
        return []
    found = []
    for child in out.iterdir():
        match = STEP_PATTERN.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(out: Path) -> Path | None:
    checkpoints = list_checkpoints(out)
    return checkpoints[-1] if checkpoints else None


def rng_state() -> dict:
    """Every RNG's state as tensors and plain numbers, so checkpoints load with ``weights_only=True``
    (nothing is ever unpickled)."""
    version, python_state, gauss = random.getstate()
    kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(numpy_keys.astype(np.int64)), "pos": int(numpy_pos),
                  "has_gauss": int(numpy_has_gauss), "gauss": float(numpy_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(int(v) for v in python["state"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    out: Path,
    step: int,
    trainable: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    trainer_state: dict,
    rng_states: list[dict],
    adapter_model=None,
    keep: int = 2,
) -> Path:
    """Write one checkpoint atomically (main process only) and prune all but the newest ``keep``."""
    final = step_folder(out, step)
    partial = final.with_name(final.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in trainable.items()}, str(partial / TRAINABLE_FILE))
    torch.save(optimizer_state, partial / OPTIMIZER_FILE)
    torch.save(scheduler_state, partial / SCHEDULER_FILE)
    for rank, state in enumerate(rng_states):
        torch.save(state, partial / f"rng_state_{rank}.pt")
    if adapter_model is not None:  # the peft adapter, loadable on its own with PeftModel.from_pretrained; its
        # tensors are the ones given (gathered from every process under FSDP), not the model's own (maybe shards)
        adapter_model.save_pretrained(str(partial / "adapter"), state_dict=trainable)
    (partial / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(folder: Path, rank: int = 0) -> dict:
    """Everything a checkpoint holds, as tensors/dicts (weights on CPU)."""
    folder = Path(folder)
    if not (folder / STATE_FILE).is_file():
        raise UserError(f"{folder} is not a complete recover checkpoint (no {STATE_FILE}).")
    rng_file = folder / f"rng_state_{rank}.pt"
    if not rng_file.is_file():
        raise UserError(f"{folder} was written by a run with fewer processes; resume with the same number of processes.")
    return {
        "trainable": load_file(str(folder / TRAINABLE_FILE)),
        "optimizer": torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True),
        "scheduler": torch.load(folder / SCHEDULER_FILE, map_location="cpu", weights_only=True),
        "rng": torch.load(rng_file, weights_only=True),
        "state": json.loads((folder / STATE_FILE).read_text()),
    }
