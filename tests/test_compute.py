"""The compute-dtype policy (mha2mla/compute.py): auto picks bf16 only where the hardware reports native bf16."""

from pathlib import Path

import pytest

from mha2mla import UserError, compute


def test_cpu_flags_read_from_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu amx_tile\n")
    assert {"avx512_bf16", "amx_tile", "fpu"} <= compute.cpu_flags(info)
    assert compute.cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("flags, expected", [
    ({"fpu", "avx2", "avx512f"}, False),
    ({"avx512f", "avx512_bf16"}, True),
    ({"amx_tile", "amx_bf16"}, True),
    ({"fp", "asimd", "bf16"}, True),  # Arm
    (set(), False),
])
def test_cpu_has_bf16(flags, expected):
    assert compute.cpu_has_bf16(flags) is expected


def test_auto_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx2"})
    assert compute.resolve_compute_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx512_bf16"})
    assert compute.resolve_compute_dtype("auto", "cpu") == "bfloat16"
    assert compute.resolve_compute_dtype(None, "cpu") == "bfloat16"


def test_flag_forces_the_dtype(monkeypatch):
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx512_bf16"})
    assert compute.resolve_compute_dtype("float32", "cpu") == "float32"
    monkeypatch.setattr(compute, "cpu_flags", lambda: set())
    assert compute.resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"
    assert compute.resolve_compute_dtype("auto", "mps") == "float32"


def test_unknown_name_is_one_sentence():
    with pytest.raises(UserError, match="auto, float32 or bfloat16"):
        compute.resolve_compute_dtype("fp8", "cpu")


def test_a_command_can_keep_float32_on_cpus(monkeypatch):
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"amx_bf16"})
    assert compute.resolve_compute_dtype("auto", "cpu", cpu_bf16=False) == "float32"
    assert compute.resolve_compute_dtype("bfloat16", "cpu", cpu_bf16=False) == "bfloat16"


def test_emulated_bf16_is_kept_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx2"})
    with caplog.at_level("WARNING", logger="mha2mla.compute"):
        assert compute.resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"
    assert "emulated" in caplog.text and "--compute-dtype auto" in caplog.text
    caplog.clear()
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx512_bf16"})
    with caplog.at_level("WARNING", logger="mha2mla.compute"):
        assert compute.resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"
    assert caplog.text == ""
