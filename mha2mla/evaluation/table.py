"""The comparison table (Markdown rows and their JSON), from per-model results.

A model result is the dict ``compare.evaluate_loaded`` returns: ``name``, ``role`` ("source" for the baseline,
else "model"), ``measurements`` (KV cache, parameters, throughput), ``tasks`` ({task: {metric: value}}),
``shown`` (top-level task rows) and optionally ``conversion_report`` (the convert step's per-layer errors).
Each task row carries its domain (``tasks.task_domain``): in-domain rows (texts the healing text reads) come first,
then the unseen-domain rows, so a healed model's two kinds of figures sit side by side.
"""

from __future__ import annotations

import logging
import math

from mha2mla.evaluation.tasks import IN_DOMAIN, UNSEEN, task_domain

log = logging.getLogger(__name__)

# lm-eval's rolling log-likelihood metrics, and the token perplexity of a --text file (perplexity.text_perplexity)
PERPLEXITY_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte", "token_perplexity")
LOWER_IS_BETTER = set(PERPLEXITY_METRICS) | {
    "kv_cache_bytes_per_token",
    "kv_cache_values_per_token",
    "parameters",
    "attention_parameters",
}
MEASUREMENT_ROWS = (
    "kv_cache_bytes_per_token",
    "kv_cache_values_per_token",
    "parameters",
    "attention_parameters",
    "tokens_per_second",
)


def table_metrics(task_metrics: dict) -> list[str]:
    """The metrics a task shows in the table: word perplexity and bits/byte for perplexity tasks, token perplexity
    for a --text file, else all."""
    if "token_perplexity" in task_metrics:
        return ["token_perplexity"]
    if "word_perplexity" in task_metrics:
        return [m for m in ("word_perplexity", "bits_per_byte") if m in task_metrics]
    return [m for m in task_metrics if not m.endswith("_stderr") and "_stderr," not in m]


# bytes per value of the dtypes a KV cache is counted in
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def kv_row_dtype(results: list[dict]) -> str | None:
    """The one dtype the KV-bytes row compares every model in: the cache dtype of the first compared (not baseline)
    model, the dtype a conversion is run in (a source dequantised to float32 next to a bfloat16 output would
    otherwise count its cache twice as large)."""
    ordered = sorted(results, key=lambda r: r["role"] == "source")
    for r in ordered:
        measured = r["measurements"]
        dtype = measured.get("kv_cache_dtype") or measured.get("dtype")
        if dtype in DTYPE_BYTES:
            return dtype
    return None


def _kv_bytes_in(measurements: dict, dtype: str) -> float | None:
    values = measurements.get("kv_cache_values_per_token")
    return None if values is None else values * DTYPE_BYTES[dtype]


DOMAIN_ORDER = (IN_DOMAIN, UNSEEN, "")  # the table's groups, top to bottom


def comparison_rows(results: list[dict]) -> list[dict]:
    """One row per (task, metric) and per measurement: ``{"task", "domain", "metric", "values": {name: v},
    "deltas": ...}``; task rows grouped by domain (DOMAIN_ORDER), in their order of appearance within a group."""
    baseline = next((r for r in results if r["role"] == "source"), None)
    tasks = list(dict.fromkeys(task for r in results for task in r["shown"]))
    tasks.sort(key=lambda task: DOMAIN_ORDER.index(task_domain(task)))  # stable: keeps the order within a group
    rows = []
    for task in tasks:
        metrics = list(dict.fromkeys(m for r in results for m in table_metrics(r["tasks"].get(task, {}))))
        for metric in metrics:
            rows.append(
                {
                    "task": task,
                    "domain": task_domain(task),
                    "metric": metric,
                    "values": {r["name"]: r["tasks"].get(task, {}).get(metric) for r in results},
                }
            )
    kv_dtype = kv_row_dtype(results)
    for metric in MEASUREMENT_ROWS:
        row = {"task": "model", "domain": "", "metric": metric,
               "values": {r["name"]: r["measurements"].get(metric) for r in results}}
        if metric == "kv_cache_bytes_per_token" and kv_dtype is not None:
            row["dtype"] = kv_dtype
            row["values"] = {r["name"]: _kv_bytes_in(r["measurements"], kv_dtype) for r in results}
        rows.append(row)
    for row in rows:
        if baseline is None:
            continue
        base = row["values"].get(baseline["name"])
        row["deltas"] = {}
        for r in results:
            value = row["values"].get(r["name"])
            if r is baseline or value is None or base is None:
                continue
            row["deltas"][r["name"]] = {"delta": value - base, "ratio": value / base if base else None}
    return rows


def format_value(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if float(value).is_integer() and 1e6 <= abs(value) < 1e12:  # parameter counts
        return f"{value / 1e6:.2f}M"
    if float(value).is_integer() and abs(value) < 1e6:
        return f"{int(value)}"
    return f"{value:.4g}"


def _format_delta(metric: str, delta: dict | None) -> str:
    if delta is None:
        return "–"
    text = f"{delta['delta']:+.4g}"
    if (metric in LOWER_IS_BETTER or metric == "tokens_per_second") and delta["ratio"] is not None:
        text += f" (×{delta['ratio']:.4g})"
    return text


def markdown_table(results: list[dict], rows: list[dict]) -> str:
    """``| domain | task | metric | source | converted | delta |`` (one value and delta column pair per compared
    model); the domain cell is empty for a --text file and the model's measurements."""
    baseline = next((r for r in results if r["role"] == "source"), None)
    others = [r for r in results if r is not baseline]
    header, align = ["domain", "task", "metric"], ["---", "---", "---"]
    if baseline is not None:
        header.append("source")
        align.append("---:")
    for r in others:
        header.append("converted" if baseline is not None and len(others) == 1 else r["name"])
        align.append("---:")
        if baseline is not None:
            header.append("delta" if len(others) == 1 else f"Δ {r['name']}")
            align.append("---:")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        cells = [row.get("domain", ""), row["task"], row["metric"] + (f" ({row['dtype']})" if row.get("dtype") else "")]
        if baseline is not None:
            cells.append(format_value(row["values"].get(baseline["name"])))
        for r in others:
            cells.append(format_value(row["values"].get(r["name"])))
            if baseline is not None:
                cells.append(_format_delta(row["metric"], row.get("deltas", {}).get(r["name"])))
        lines.append("| " + " | ".join(cells) + " |")
    labels = [("source", baseline)] if baseline is not None else []
    labels += [("converted" if baseline is not None and len(others) == 1 else r["name"], r) for r in others]
    legend = [f"- {label}: `{r['path']}` ({r['measurements'].get('dtype')})" for label, r in labels]
    return "\n".join(lines) + "\n\n" + "\n".join(legend) + "\n"


# ---------------------------------------------------------------- plots
