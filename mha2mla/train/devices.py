"""Where and in what a recovery run computes, decided once (docs/recover.md, "Devices" and "Compute dtype"):
``start_devices(config)`` reads the device accelerate will place this process on, resolves ``compute_dtype`` for it
(mha2mla.compute) and starts accelerate for one device, DDP or FSDP2; the frozen ``Devices`` it returns is what the
rest of the run reads.

bfloat16 is accelerate's bf16 autocast, the same on CPU and GPU: the student's weights stay float32 (the trainable
ones are AdamW's master weights, the merge reads them), the matmuls and attention of every forward and backward run in
bf16, the losses in float32 (losses.py); float32 is no autocast at all. ``auto`` on a CPU with native bf16 is bf16
when parameters train in full, float32 with LoRA (docs/benchmarks.md).

On CPU processes (``torchrun`` with ``ACCELERATE_USE_CPU=1``) accelerate never selects FSDP: ``AcceleratorState``
switches to FSDP only from an accelerator device's multi-process type, not from ``MULTI_CPU``. torch's ``fully_shard``
does run on CPU with the gloo backend (tests/train/test_recover_fsdp.py), so when FSDP is asked for there
(``ACCELERATE_USE_FSDP=true``, as ``accelerate launch`` sets from an FSDP config) ``start_devices`` sets the
state to FSDP with the plugin read from the same ``FSDP_*`` variables; everything after that (``prepare``, clipping,
``no_sync``) is accelerate's own FSDP2 code. This is how the FSDP path is tested on a machine without GPUs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator, DistributedType, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin, parse_flag_from_env

from mha2mla import UserError
from mha2mla.compute import resolve_compute_dtype, torch_dtype

SUPPORTED_DISTRIBUTION = (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.FSDP)


@dataclass(frozen=True)
class Devices:
    """The run's placement: accelerate, the compute dtype (its name and torch dtype), the processes and whether the
    model is sharded (FSDP: parameters split over processes, forwards collective, state gathered to save)."""

    accelerator: Accelerator
    compute_dtype: str
    dtype: torch.dtype
    world: int
    rank: int
    is_main: bool
    sharded: bool

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


def run_device() -> torch.device:
    """The device accelerate will place this process on (read before it starts: the compute dtype depends on it,
    and accelerate takes its autocast setting only when it starts)."""
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU")).device


def start_devices(config) -> Devices:
    """The compute dtype of ``config`` (``compute_dtype`` on this process's device) and accelerate started with it;
    a distribution recover does not run is refused in one sentence."""
    compute_dtype = resolve_compute_dtype(config.compute_dtype, run_device().type, cpu_bf16=config.adapter is None)
    dtype = torch_dtype(compute_dtype)
    mixed_precision = "bf16" if compute_dtype == "bfloat16" else "no"
    held = AcceleratorState._shared_state.get("_mixed_precision", mixed_precision)
    if held != mixed_precision and PartialState().num_processes == 1:
        # accelerate holds one autocast setting per process and refuses another; a lone process may run float32 and
        # bf16 recoveries one after the other (the Python API, benchmarks/recover_speed.py), so it starts afresh.
        # An accelerator made before without autocast keeps none (its native_amp is off), so float32 and bf16 runs
        # can even alternate when the float32 ones start first (recover_speed.py orders them so).
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=mixed_precision)
    if accelerator.distributed_type == DistributedType.MULTI_CPU and parse_flag_from_env("ACCELERATE_USE_FSDP"):
        # FSDP on CPU processes (the module docstring says why), with the plugin accelerate itself builds from the
        # FSDP_* variables; written into PartialState too, as AcceleratorState.__init__ does with its own choice:
        # every later AcceleratorState() copies it from there
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    if accelerator.distributed_type not in SUPPORTED_DISTRIBUTION:
        raise UserError(
            f"recover supports one device, DDP or FSDP (accelerate multi-GPU/CPU or FSDP), not "
            f"{accelerator.distributed_type.value}; use recipes/accelerate/multi_gpu.yaml or recipes/accelerate/fsdp.yaml."
        )
    sharded = accelerator.distributed_type == DistributedType.FSDP
    if sharded and not accelerator.is_fsdp2:
        raise UserError(
            "recover runs FSDP version 2 only (torch's fully_shard); set fsdp_version: 2 in the accelerate config, "
            "as recipes/accelerate/fsdp.yaml does."
        )
    return Devices(accelerator, compute_dtype, dtype, accelerator.num_processes, accelerator.process_index,
                   accelerator.is_main_process, sharded)

