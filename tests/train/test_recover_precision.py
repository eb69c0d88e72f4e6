"""The compute dtype of `mha2mla recover` (docs/recover.md, "Compute dtype"): decided once per run from
``compute_dtype`` and the device; bfloat16 is bf16 autocast over float32 weights (the trainable ones are AdamW's
master weights) on CPU as on GPU, float32 is no autocast; the merged output keeps the model's dtype; a run saved with the retired
``mixed_precision`` key (another mha2mla's) is not resumed."""

from __future__ import annotations

import json

import pytest
import torch
from common import SAMPLE_TEXT
from safetensors.torch import load_file

import mha2mla.compute
from mha2mla.train import RecoverConfig, recover
from mha2mla.train.data.packing import pack_token_lists
from mha2mla.train.devices import start_devices
from mha2mla.train.loop import RecoveryRun
from mha2mla.train.model.student import load_student
from mha2mla.train.model.trainable import make_trainable


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for name in ("a.txt", "b.txt"):  # the held-out rows come from whole documents: a.txt, the training from b.txt
        (folder / name).write_text(SAMPLE_TEXT * 6)
    return folder


def _config(model, data, out, **overrides) -> RecoverConfig:
    settings = {"model": str(model), "data": [str(data)], "out": str(out), "seq_len": 32, "batch_size": 4,
                "max_steps": 12, "learning_rate": 1e-2, "lora": {"rank": 8}, "eval_sequences": 4, "eval_every": 0,
                "save_every": 0}
    return RecoverConfig(**{**settings, **overrides})


def _one_step_dtypes(config: RecoverConfig, model_folder) -> tuple[RecoveryRun, torch.dtype, set[torch.dtype]]:
    """A run's policy after one train step: (the run, the dtype of a LoRA A matmul's output inside the forward,
    the dtypes of the trainable parameters and of their gradients)."""
    run = RecoveryRun(config, start_devices(config), config.total_steps())
    model = make_trainable(load_student(model_folder), config.lora)
    seen = []
    lora_a = next(module for name, module in model.named_modules() if name.endswith("q_proj.lora_A.default"))
    lora_a.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda grad: grads.append(grad.dtype))
    run.setup_training(model)
    run.train_step(pack_token_lists([list(range(1, 200))], seq_len=16).rows(slice(0, 4)))
    params = {p.dtype for p in run.model.parameters()}
    return run, seen[0], params | set(grads)


@pytest.mark.parametrize("name, mixed, compute", [("bfloat16", "bf16", torch.bfloat16), ("float32", "no", torch.float32)])
def test_policy_follows_compute_dtype(tiny_mla, tmp_path, name, mixed, compute):
    run, inside, stored = _one_step_dtypes(_config(tiny_mla, tiny_mla, tmp_path / "o", compute_dtype=name), tiny_mla)
    assert run.compute_dtype == name and run.accelerator.mixed_precision == mixed
    assert inside == compute  # what the matmuls ran in
    assert stored == {torch.float32}  # weights (frozen and master) and gradients: float32 either way


@pytest.mark.parametrize("flags, full, expected", [
    ({"avx512_bf16"}, {}, "float32"), ({"amx_bf16"}, {}, "float32"), (set(), {}, "float32"),  # LoRA
    ({"avx512_bf16"}, {"full_attention": True}, "bfloat16"), ({"amx_bf16"}, {"full_layers": True}, "bfloat16"),
    (set(), {"full_layers": True}, "float32"),
])
def test_auto_follows_the_cpu_and_the_trainable_set(tiny_mla, tmp_path, monkeypatch, flags, full, expected):
    """Recovery's auto: bf16 only on a CPU with native bf16 and only when parameters train in full; LoRA keeps
    float32 (bf16 LoRA measured harmful)."""
    monkeypatch.setattr(mha2mla.compute, "cpu_flags", lambda *args: set(flags))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    devices = start_devices(_config(tiny_mla, tiny_mla, tmp_path / "o", **full))
    assert devices.compute_dtype == expected
    assert devices.accelerator.mixed_precision == ("bf16" if expected == "bfloat16" else "no")


def test_bf16_recovery_lowers_the_loss_and_keeps_the_output_dtype(tiny_mla, corpus, tmp_path):
    out = tmp_path / "recovered"
    report = recover(_config(tiny_mla, corpus, out, compute_dtype="bfloat16"), show_progress=False)
    assert report["compute_dtype"] == "bfloat16" and "mixed_precision" not in report
    assert sum(report["losses"][-3:]) < sum(report["losses"][:3])
    assert report["evaluations"][-1]["perplexity"] < report["evaluations"][0]["perplexity"]
    source_dtype = json.loads((tiny_mla / "config.json").read_text())["dtype"]
    assert json.loads((out / "config.json").read_text())["dtype"] == source_dtype
    written = load_file(str(out / "model.safetensors"))
    assert {tensor.dtype for tensor in written.values()} == {getattr(torch, source_dtype)}
    settings = json.loads((out / "recovery_report.json").read_text())["settings"]
    assert settings["compute_dtype"] == "bfloat16" and "mixed_precision" not in settings


def test_a_run_saved_with_mixed_precision_is_refused_naming_the_settings(tmp_path):
    """A run started before compute_dtype existed recorded ``mixed_precision``: its settings differ from this run's."""
    from mha2mla import UserError
    from mha2mla.io.model_folder import RECOVER_CONFIG
    from mha2mla.train.state.resume import check_same_run

    config = RecoverConfig(model="m", data=["d"], out=str(tmp_path), max_steps=2, compute_dtype="float32")
    saved = {key: value for key, value in config.outcome_fields().items() if key != "compute_dtype"}
    (tmp_path / RECOVER_CONFIG).write_text(json.dumps({**saved, "mixed_precision": "no"}))
    with pytest.raises(UserError, match=r"settings differ from the interrupted run \(compute_dtype, mixed_precision\)"):
        check_same_run(config, tmp_path)


def test_the_compute_dtype_is_decided_once_per_run(tiny_mla, corpus, tmp_path, monkeypatch):
    """devices.start_devices resolves the compute dtype, and nothing else in a run does it again."""
    import mha2mla.train.devices

    calls, resolve = [], mha2mla.compute.resolve_compute_dtype

    def counted(*args, **kwargs):
        calls.append(args)
        return resolve(*args, **kwargs)

    monkeypatch.setattr(mha2mla.compute, "resolve_compute_dtype", counted)
    monkeypatch.setattr(mha2mla.train.devices, "resolve_compute_dtype", counted)
    report = recover(_config(tiny_mla, corpus, tmp_path / "out", max_steps=2), show_progress=False)
    assert len(calls) == 1 and report["compute_dtype"] == "float32"
