"""The comparison report: one table (Markdown + JSON, table.py) and PNG plots (plots.py), written into one folder.

A model result is the dict ``run.evaluate_loaded`` returns (see table.py). The folder may hold other files: the
report's files are written into a hidden staging folder beside it and moved in at the end, and a report file
mha2mla did not write (a ``results.md`` of the user's), or one changed since it wrote it (results.json lists each
file's hash), is never replaced; nor is anything written into a model folder or below one
(:func:`check_report_folder`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mha2mla import UserError
from mha2mla.evaluation.plots import plot_conversion_error, plot_perplexity_vs_kv, plot_tasks
from mha2mla.evaluation.table import comparison_rows, markdown_table
from mha2mla.io.model_folder import holds_checkpoint, is_model_folder
from mha2mla.io.output import remove_made, remove_stale, staging_for, user_path
from mha2mla.io.output_file import check_results_folder
from mha2mla.io.written import file_hash

RESULTS_JSON = "results.json"
WRITER = "mha2mla eval"  # results.json's "written_by": what marks the folder's report files as mha2mla's
PLOT_FILES = {"tasks": "tasks.png", "conversion_error": "conversion_error.png", "perplexity_vs_kv": "perplexity_vs_kv.png"}
REPORT_FILES = (RESULTS_JSON, "results.md", *PLOT_FILES.values())


def _written_by_eval(out: Path) -> dict[str, str | None]:
    """The report files an earlier ``mha2mla eval`` wrote into ``out``, each with the hash it was written with (None:
    not recorded); empty when results.json is not its."""
    try:
        report = json.loads((out / RESULTS_JSON).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(report, dict):
        return {}
    if report.get("written_by") == WRITER:
        hashes = report.get("hashes") if isinstance(report.get("hashes"), dict) else {}
        return {name: hashes.get(name) for name in report.get("files", []) if isinstance(name, str)}
    if {"settings", "models", "table"} <= report.keys():  # written before reports named their writer
        plots = report.get("plots") if isinstance(report.get("plots"), dict) else {}
        return dict.fromkeys({RESULTS_JSON, "results.md", *(Path(str(path)).name for path in plots.values())})
    return {}


def _model_folder_above(target: Path) -> Path | None:
    """The nearest folder above ``target`` that holds a model: a config.json or safetensors weights (a folder that
    merely holds a .gguf file, where people run eval on it, is not one)."""
    for folder in target.parents:
        if holds_checkpoint(folder):
            return folder
    return None


def _changed(out: Path, name: str, digest: str | None) -> bool:
    path = out / name
    return digest is not None and path.is_file() and file_hash(path) != digest


def check_report_folder(out: str | Path) -> None:
    """Refuse an --out the report cannot go into without loss, before any model is evaluated: a file, a read-only
    folder, a model folder or a folder inside one, or a folder holding a report file that mha2mla eval did not write
    or that was changed since."""
    check_results_folder(out, "results.json, results.md and the plots")
    folder, target = user_path(out), user_path(out).resolve()
    above = _model_folder_above(target)
    if above is not None:
        suggested = os.path.relpath(above.parent / f"{above.name}-eval")
        raise UserError(f"--out {out} lies inside the model folder {above}; write the evaluation outside it, "
                        f"e.g. --out {suggested}.")
    if not folder.is_dir():
        return
    if is_model_folder(folder):
        raise UserError(f"--out {out} is a model folder; write the evaluation into a folder of its own, "
                        f"e.g. --out {target.name or 'model'}-eval.")
    ours = _written_by_eval(folder)
    foreign = [name for name in REPORT_FILES if os.path.lexists(folder / name) and name not in ours]
    if foreign:
        raise UserError(f"--out {out} already holds {', '.join(foreign)}, which mha2mla eval did not write; move "
                        "it away or choose another --out.")
    changed = [name for name, digest in ours.items() if _changed(folder, name, digest)]
    if changed:
        raise UserError(f"--out {out} holds {', '.join(changed)}, changed since mha2mla eval wrote it; move it away or "
                        "choose another --out.")


def _write_files(results: list[dict], settings: dict, folder: Path) -> dict:
    rows = comparison_rows(results)
    table = markdown_table(results, rows)
    plots = {
        "tasks": plot_tasks(results, folder / PLOT_FILES["tasks"]),
        "conversion_error": plot_conversion_error(results, folder / PLOT_FILES["conversion_error"]),
        "perplexity_vs_kv": plot_perplexity_vs_kv(results, folder / PLOT_FILES["perplexity_vs_kv"]),
    }
    plots = {key: path.name for key, path in plots.items() if path is not None}
    files = [RESULTS_JSON, "results.md", *plots.values()]
    (folder / "results.md").write_text(table, encoding="utf-8")
    hashes = {name: file_hash(folder / name) for name in files[1:]}  # a later eval replaces them only unchanged
    report = {"written_by": WRITER, "files": files, "hashes": hashes, "settings": settings, "models": results,
              "table": rows, "plots": plots}
    (folder / RESULTS_JSON).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    report["markdown"] = table
    return report


def write_report(results: list[dict], settings: dict, out: Path) -> dict:
    """Write results.json, results.md and the plots into ``out``; return the report (JSON-able), its plots as
    paths in ``out``. Files are staged beside ``out`` and moved in once all are written."""
    out = user_path(out)
    made, staging = staging_for(out / RESULTS_JSON)
    try:
        remove_stale(out)  # what a killed eval left
        staging.mkdir()
        report = _write_files(results, settings, staging)
        out.mkdir(parents=True, exist_ok=True)
        for name in report["files"]:
            os.replace(staging / name, out / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_made(made)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    report["plots"] = {key: str(out / name) for key, name in report["plots"].items()}
    return report
