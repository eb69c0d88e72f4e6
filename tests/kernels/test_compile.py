"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU: the interpreter the other tests run
under accepts code the compiler rejects, so this runs the compiler itself (``kernels_bench.py --compile table``,
in a child process without TRITON_INTERPRET) on the table's first config of each head width and the decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
H100_SHARED_MEMORY = 227 * 1024  # bytes one block may use on sm_90


def test_kernels_compile_for_sm90_with_tensor_cores(tmp_path):
    triton = pytest.importorskip("triton")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("this Triton has no NVIDIA backend tools")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels_bench.py"), "--compile", "table",
                             "--json", str(tmp_path / "compile.json")], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "compile.json").read_text())
    kernels = {(row["shape"], row["kernel"]) for row in rows}
    assert {("smollm2-mla", "forward"), ("deepseek", "dk/dv"), ("deepseek", "dq")} <= kernels
    assert any(row["kernel"] == "decode split" for row in rows)
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["shared_bytes"] <= H100_SHARED_MEMORY, row
        if row["kernel"] != "decode split" or row["tiles"].startswith("64"):
            assert row["wgmma"] > 0, row  # the dots run on Hopper's tensor cores
        if row["kernel"] == "forward" or (row["kernel"] == "dk/dv" and row["shape"] == "smollm2-mla"):
            assert row["local_bytes"] == 0, row  # no spilled registers (one head per dK/dV program)
