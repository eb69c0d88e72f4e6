"""The comparison report: one table (Markdown + JSON, table.py) and PNG plots (plots.py), written into one folder.

A model result is the dict ``run.evaluate_loaded`` returns (see table.py)."""

from __future__ import annotations

import json
from pathlib import Path

from mha2mla.evaluation.plots import plot_conversion_error, plot_perplexity_vs_kv, plot_tasks
from mha2mla.evaluation.table import comparison_rows, markdown_table


def write_report(results: list[dict], settings: dict, out: Path) -> dict:
    """Write results.json, results.md and the plots into ``out``; return the report (JSON-able)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = comparison_rows(results)
    table = markdown_table(results, rows)
    plots = {
        "tasks": plot_tasks(results, out / "tasks.png"),
        "conversion_error": plot_conversion_error(results, out / "conversion_error.png"),
        "perplexity_vs_kv": plot_perplexity_vs_kv(results, out / "perplexity_vs_kv.png"),
    }
    report = {
        "settings": settings,
        "models": results,
        "table": rows,
        "plots": {key: str(p) for key, p in plots.items() if p is not None},
    }
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(table, encoding="utf-8")
    report["markdown"] = table
    return report
