"""How a recovery run is spread over processes (docs/recover.md, "Devices"): one device, DDP, or FSDP2, all through
accelerate, and the full state a checkpoint holds whichever of them trained it.

FSDP is FSDP2 (torch's ``fully_shard``, accelerate's ``fsdp_version: 2``): every parameter is a DTensor sharded across
the processes, so a checkpoint cannot read tensors off the main process as under DDP. ``gathered_trainable`` and
``gathered_optimizer_state`` gather the full trainable tensors and AdamW state with torch's distributed state-dict API
(``torch.distributed.checkpoint.state_dict``; every process takes part, the main process receives them) and give them
in the layout one process or DDP saves: tensors by parameter name, the optimizer state by parameter index. So the
checkpoint folder is the same whoever wrote it, and ``load_optimizer_state`` shards it back.

On CPU processes (``torchrun`` with ``ACCELERATE_USE_CPU=1``) accelerate never selects FSDP: ``AcceleratorState``
switches to FSDP only from an accelerator device's multi-process type, not from ``MULTI_CPU``. torch's ``fully_shard``
does run on CPU with the gloo backend (torch 2.13; tests/train/test_recover_fsdp.py), so when FSDP is asked for there
(``ACCELERATE_USE_FSDP=true``, as ``accelerate launch`` sets from an FSDP config) ``use_fsdp_on_cpu`` sets the
state to FSDP with the plugin read from the same ``FSDP_*`` variables; everything after that (``prepare``, clipping,
``no_sync``) is accelerate's own FSDP2 code. This is how the FSDP path is tested on a machine without GPUs."""

from __future__ import annotations

from accelerate import Accelerator, DistributedType, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin, parse_flag_from_env
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from mha2mla import UserError
from mha2mla.train.model import trainable_state

SUPPORTED_DISTRIBUTION = (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.FSDP)
# Full tensors of the trainable parameters only, offloaded to CPU on the main process (the others receive nothing).
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def run_device():
    """The device accelerate will place this process on (read before it starts: the compute dtype depends on it,
    and accelerate takes its autocast setting only when it starts)."""
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU")).device


def start_accelerator(mixed_precision: str) -> Accelerator:
    """accelerate for one device, DDP or FSDP2, with ``mixed_precision`` (bf16 or no); anything else is refused in
    one sentence."""
    held = AcceleratorState._shared_state.get("_mixed_precision", mixed_precision)
    if held != mixed_precision and PartialState().num_processes == 1:
        # accelerate holds one autocast setting per process and refuses another; a lone process may run float32 and
        # bf16 recoveries one after the other (the Python API, benchmarks/recover_speed.py), so it starts afresh.
        # An accelerator made before without autocast keeps none (its native_amp is off), so float32 and bf16 runs
        # can even alternate when the float32 ones start first (recover_speed.py orders them so).
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=mixed_precision)
    if accelerator.distributed_type == DistributedType.MULTI_CPU and parse_flag_from_env("ACCELERATE_USE_FSDP"):
        use_fsdp_on_cpu(accelerator)
    if accelerator.distributed_type not in SUPPORTED_DISTRIBUTION:
        raise UserError(
            f"recover supports one device, DDP or FSDP (accelerate multi-GPU/CPU or FSDP), not "
            f"{accelerator.distributed_type.value}; use recipes/accelerate/multi_gpu.yaml or recipes/accelerate/fsdp.yaml."
        )
    if is_sharded(accelerator) and not accelerator.is_fsdp2:
        raise UserError(
            "recover runs FSDP version 2 only (torch's fully_shard); set fsdp_version: 2 in the accelerate config, "
            "as recipes/accelerate/fsdp.yaml does."
        )
    return accelerator


def use_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Turn accelerate's MULTI_CPU state into FSDP (the module docstring says why), with the plugin accelerate
    itself builds from the ``FSDP_*`` environment variables. The choice is written into ``PartialState`` too, as
    ``AcceleratorState.__init__`` does with its own: every later ``AcceleratorState()`` copies it from there."""
    state = accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def is_sharded(accelerator: Accelerator) -> bool:
    """True under FSDP: parameters are sharded, forwards are collective, state must be gathered."""
    return accelerator.distributed_type == DistributedType.FSDP


def gathered_trainable(model, accelerator: Accelerator) -> dict:
    """Every trainable parameter by name, as full CPU tensors (under FSDP every process must call this; only the
    main process receives the tensors)."""
    if not is_sharded(accelerator):
        return trainable_state(accelerator.unwrap_model(model))
    return get_model_state_dict(model, options=GATHER)


def gathered_optimizer_state(model, optimizer, names: list[str], accelerator: Accelerator) -> dict:
    """The optimizer's state as ``optimizer.state_dict()`` gives it on one process (keyed by the index of the
    parameter in ``names``, the trainable parameters' names in the optimizer's order), full tensors under FSDP
    (collective; only the main process receives it)."""
    if not is_sharded(accelerator):
        return optimizer.state_dict()
    by_name = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if not by_name:  # not the main process
        return {}
    index = {name: position for position, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in by_name["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in by_name["param_groups"]],
    }


def load_optimizer_state(model, optimizer, saved: dict, names: list[str], accelerator: Accelerator) -> None:
    """Restore a checkpoint's optimizer state (the layout above) into the prepared optimizer; under FSDP every
    process reads the full state and keeps its own shard of it."""
    if not is_sharded(accelerator):
        optimizer.load_state_dict(saved)
        return
    by_name = {
        "state": {names[position]: value for position, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[position] for position in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
