"""The conversion report's phase seconds (convert/phases.py): exclusive, complete, and read from the pipeline itself."""

from __future__ import annotations

import json

from common import build_source

from mha2mla.convert import phases as phases_module
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.phases import PhaseClock, phase
from mha2mla.convert.pipeline import convert


class FakeTime:
    """perf_counter / process_time that advance only when told."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nested_phases_are_charged_exclusively(monkeypatch):
    wall, cpu = FakeTime(), FakeTime()
    monkeypatch.setattr(phases_module.time, "perf_counter", wall)
    monkeypatch.setattr(phases_module.time, "process_time", cpu)

    def spend(seconds: float, cpu_seconds: float) -> None:
        wall.now += seconds
        cpu.now += cpu_seconds

    clock = PhaseClock()
    with clock.running():
        spend(1, 1)  # in no phase: "other"
        with phase("solves"):
            spend(2, 4)
            with phase("refinement"):
                spend(3, 6)
            spend(5, 10)
        with phase("solves"):
            spend(7, 7)
        seconds, cpu_seconds = clock.totals()
    assert seconds == {"solves": 14, "refinement": 3, "other": 1}
    assert cpu_seconds == {"solves": 21, "refinement": 6, "other": 1}
    with phase("refinement"):  # no clock running: nothing is charged anywhere
        spend(100, 100)
    assert clock.seconds["refinement"] == 3


def test_a_calibrated_conversion_reports_every_phase(tmp_path):
    source = build_source(tmp_path / "src", "llama", num_heads=4, num_kv_heads=2)
    options = ConvertConfig(profile="portable", kv_lora_rank=9, rope_dim=8, compute_dtype="float32",
                            calib_samples=16, calib_seq_len=32)
    result = convert(source, tmp_path / "out", options, progress=False)
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    seconds, cpu_seconds = report["phase_seconds"], report["phase_cpu_seconds"]
    expected = {"layer read", "statistics", "solves", "refinement", "source heads", "reconstruction", "advance",
                "writing", "other"}
    assert set(seconds) == expected and set(cpu_seconds) == expected
    assert all(value >= 0 for value in seconds.values())
    assert seconds["reconstruction"] > 0  # 160 gradient steps: never under the report's 0.01 s rounding
    # the phases cover the clock's span, which lies inside the whole conversion
    assert sum(seconds.values()) <= report["elapsed_seconds"] + 0.05 * len(seconds)
    assert result.report.phase_seconds == seconds


def test_weight_only_conversion_has_no_calibration_phases(tmp_path):
    source = build_source(tmp_path / "src", "llama", num_heads=4, num_kv_heads=2)
    result = convert(source, tmp_path / "out", ConvertConfig(calib="none", kv_lora_rank=9, rope_dim=8), progress=False)
    assert set(result.report.phase_seconds) == {"solves", "writing", "other"}
