"""Every benchmark suite answers ``--help`` without importing torch (its heavy imports stay inside main, after the
arguments are parsed), and docs/benchmarks.md's tables are exactly what benchmarks/render.py makes of the committed
records (a table edited by hand fails here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SUITES = sorted(path.name for path in BENCHMARKS.glob("*.py"))
# runs the script as ``python benchmarks/NAME --help`` would, then prints which heavy modules were imported
WRAPPER = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
sys.path.insert(0, {benchmarks!r})
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code or 0
print("IMPORTED", [name for name in ("torch", "transformers") if name in sys.modules], file=sys.stderr)
sys.exit(code)
"""


def _render_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import render
    finally:
        sys.path.remove(str(BENCHMARKS))
    return render


@pytest.mark.parametrize("name", SUITES)
def test_help_exits_zero_without_torch(name):
    environment = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, "-c", WRAPPER.format(benchmarks=str(BENCHMARKS)), str(BENCHMARKS / name)],
                            capture_output=True, text=True, cwd=ROOT, env=environment, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
    assert "IMPORTED []" in result.stderr, result.stderr[-500:]


def test_the_page_is_what_the_records_render():
    render = _render_module()
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert render.MARKERS.search(page), "docs/benchmarks.md has no rendered table"
    assert render.render(page) == page, "a table differs from its records: run python benchmarks/render.py"


def test_a_hand_edited_table_is_caught():
    render = _render_module()
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    edited = page.replace("`e50f2ae`", "`0000000`", 1)
    assert edited != page and render.render(edited) == page


def test_every_committed_record_names_its_question_command_commit_and_figures():
    lines = [line for path in sorted((BENCHMARKS / "records").glob("*.jsonl"))
             for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines
    for line in lines:
        record = json.loads(line)
        assert record["question"] and record["command"] and record["commit"] and record["figures"], line[:200]
        assert "machine" in record and "versions" in record
        assert "+dirty" not in record["commit"], "a record from an uncommitted tree"


def test_a_suite_appends_one_line_per_measurement_to_its_records_file(tmp_path):
    """``--records PATH`` sends a run's records to PATH (how a smoke run keeps the committed records clean)."""
    records = tmp_path / "run.jsonl"
    setup = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); sys.argv = ['benchmarks/quality.py', '--records', {str(records)!r}]"
    code = "\n".join([setup, "import argparse, harness",
                      "parser = argparse.ArgumentParser(); harness.add_output_arguments(parser); parser.parse_args(sys.argv[1:])",
                      "harness.report('quality', {'budget': 0.5}, [{'ppl': 1.5}, {'ppl': 2.5}])"])
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environment,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    written = [json.loads(line) for line in records.read_text(encoding="utf-8").splitlines()]
    assert [record["figures"] for record in written] == [{"ppl": 1.5}, {"ppl": 2.5}]
    assert written[0]["command"] == f"python benchmarks/quality.py --records {records}"
    assert written[0]["question"].startswith("How close") and written[0]["versions"]["torch"]
