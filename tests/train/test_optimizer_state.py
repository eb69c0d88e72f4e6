"""A checkpoint's optimizer state (mha2mla/train/state/gather.py) says what AdamW holds, not how a process steps it:
the fused kernel (one device) and the plain loop (FSDP) save the same state, and a resumed optimizer keeps its own
way of stepping."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from mha2mla.train.state.gather import IMPLEMENTATION_KEYS, gathered_optimizer_state, load_optimizer_state

ONE_PROCESS = SimpleNamespace(distributed_type=DistributedType.NO)


def _stepped(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5, 3))
    optimizer = torch.optim.AdamW([param], lr=1e-2, fused=fused or None)
    for _ in range(2):
        optimizer.zero_grad()
        param.pow(2).sum().backward()
        optimizer.step()
    return param, optimizer


def test_a_fused_checkpoint_resumes_into_the_plain_loop_and_steps_as_the_fused_one():
    param, fused = _stepped(fused=True)
    buffer = io.BytesIO()  # through bytes, as a checkpoint goes: the saved tensors are not the optimizer's own
    torch.save(gathered_optimizer_state(None, fused, ["p"], ONE_PROCESS), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert not set(IMPLEMENTATION_KEYS) & set(saved["param_groups"][0])
    resumed_param = torch.nn.Parameter(param.detach().clone())
    plain = torch.optim.AdamW([resumed_param], lr=1e-2)
    load_optimizer_state(None, plain, saved, ["p"], ONE_PROCESS)
    assert plain.param_groups[0]["fused"] is None
    refused = torch.optim.AdamW([torch.nn.Parameter(param.detach().clone())], lr=1e-2, fused=True)
    load_optimizer_state(None, refused, saved, ["p"], ONE_PROCESS)  # a state without the flag
    assert refused.param_groups[0]["fused"] is True
    torch.testing.assert_close(plain.state[resumed_param]["exp_avg"], fused.state[param]["exp_avg"])
    for model_param, optimizer in ((param, fused), (resumed_param, plain)):
        optimizer.zero_grad()
        model_param.pow(2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(resumed_param, param, rtol=0, atol=0)  # the two kernels round alike here
    assert not torch.equal(param.detach(), _stepped(fused=True)[0].detach())  # the third step moved it


def test_a_full_disk_while_torch_saves_a_checkpoint_file_is_the_oserror_itself():
    """torch.save turns its file's OSError into a RuntimeError without the errno; the checkpoint writer gives the
    OSError back, so the run's one sentence names the full disk (tests/cli/test_reliability.py)."""
    import errno

    from mha2mla.train.state.checkpoint import _torch_file

    class FullDisk:
        written = 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(data)

        def flush(self):
            pass

    with pytest.raises(OSError) as raised:
        _torch_file({"exp_avg": torch.zeros(100_000)})(FullDisk())
    assert raised.value.errno == errno.ENOSPC
