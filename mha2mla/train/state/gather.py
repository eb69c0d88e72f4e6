"""The full state a recovery checkpoint holds, whichever spread of processes trained it (docs/recover.md, "Devices"):
one device, DDP, or FSDP2, all through accelerate.

FSDP is FSDP2 (torch's ``fully_shard``, accelerate's ``fsdp_version: 2``): every parameter is a DTensor sharded across
the processes, so a checkpoint cannot read tensors off the main process as under DDP. ``gathered_trainable`` and
``gathered_optimizer_state`` gather the full trainable tensors and AdamW state with torch's distributed state-dict API
(``torch.distributed.checkpoint.state_dict``; every process takes part, the main process receives them) and give them
in the layout one process or DDP saves: tensors by parameter name, the optimizer state by parameter index. So the
checkpoint folder is the same whoever wrote it, and ``load_optimizer_state`` shards it back.

Accelerate is started, and the compute dtype decided, once per run in devices.py; this module is what a checkpoint
needs from every process: the trainable tensors, the optimizer state and every process's RNG state, saved and
restored."""

from __future__ import annotations

import random

import numpy as np
import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

# Full tensors of the trainable parameters only, offloaded to CPU on the main process (the others receive nothing).
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def is_sharded(accelerator: Accelerator) -> bool:
    """True under FSDP: parameters are sharded, forwards are collective, state must be gathered."""
    return accelerator.distributed_type == DistributedType.FSDP


def gathered_trainable(model, accelerator: Accelerator) -> dict:
    """Every trainable parameter by name, as full CPU tensors (under FSDP every process must call this; only the
    main process receives the tensors). On one process the parameters themselves when they are on the CPU (a
    checkpoint writes them before the next step changes them; a copy would double the trainable weights)."""
    if not is_sharded(accelerator):
        return {name: param.detach().cpu() for name, param in accelerator.unwrap_model(model).named_parameters()
                if param.requires_grad}
    return get_model_state_dict(model, options=GATHER)


# how a process runs AdamW's step (fused kernels on one device, the plain loop under FSDP), not state: a checkpoint
# leaves them out and a resumed run keeps its own
IMPLEMENTATION_KEYS = ("fused", "foreach")


def _portable(groups: list[dict]) -> list[dict]:
    return [{key: value for key, value in group.items() if key not in IMPLEMENTATION_KEYS} for group in groups]


def gathered_optimizer_state(model, optimizer, names: list[str], accelerator: Accelerator) -> dict:
    """The optimizer's state as ``optimizer.state_dict()`` gives it on one process (keyed by the index of the
    parameter in ``names``, the trainable parameters' names in the optimizer's order), full tensors under FSDP
    (collective; only the main process receives it); without IMPLEMENTATION_KEYS."""
    if not is_sharded(accelerator):
        state = optimizer.state_dict()
        return {**state, "param_groups": _portable(state["param_groups"])}
    by_name = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if not by_name:  # not the main process
        return {}
    index = {name: position for position, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in by_name["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in _portable(by_name["param_groups"])],
    }


def load_optimizer_state(model, optimizer, saved: dict, names: list[str], accelerator: Accelerator) -> None:
    """Restore a checkpoint's optimizer state (the layout above) into the prepared optimizer; under FSDP every
    process reads the full state and keeps its own shard of it. The optimizer keeps its own IMPLEMENTATION_KEYS."""
    own = [{key: group[key] for key in IMPLEMENTATION_KEYS if key in group} for group in optimizer.param_groups]
    _load_optimizer_state(model, optimizer, saved, names, accelerator)
    for group, keys in zip(optimizer.param_groups, own):
        group.update(keys)


def _load_optimizer_state(model, optimizer, saved: dict, names: list[str], accelerator: Accelerator) -> None:
    if not is_sharded(accelerator):
        optimizer.load_state_dict(saved)
        return
    by_name = {
        "state": {names[position]: value for position, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[position] for position in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


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


def gathered_state(model, optimizer, names: list[str], accelerator: Accelerator) -> tuple[dict, dict, list[dict]]:
    """What a checkpoint saves of the processes (every process must call this; the main process receives it): the
    trainable tensors by name, the optimizer state (the layout above) and every process's RNG state."""
    trainable = gathered_trainable(model, accelerator)
    optimizer_state = gathered_optimizer_state(model, optimizer, names, accelerator)
    rng_states = gather_object([rng_state()]) if accelerator.num_processes > 1 else [rng_state()]
    return trainable, optimizer_state, rng_states


def restore_state(model, optimizer, saved: dict, names: list[str], accelerator: Accelerator) -> None:
    """A checkpoint's optimizer state and this process's RNG state put back (after ``prepare``, which under FSDP
    swaps the optimizer's parameters for the shards)."""
    load_optimizer_state(model, optimizer, saved["optimizer"], names, accelerator)
    set_rng_state(saved["rng"])
