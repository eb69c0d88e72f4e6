"""The comparison report: one table (Markdown + JSON) and PNG plots, from per-model results.

A model result is the dict ``compare.evaluate_loaded`` returns: ``name``, ``role`` ("source" for the baseline,
else "model"), ``measurements`` (KV cache, parameters, throughput), ``tasks`` ({task: {metric: value}}),
``shown`` (top-level task rows) and optionally ``conversion_report`` (the convert step's per-layer errors).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

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


def comparison_rows(results: list[dict]) -> list[dict]:
    """One row per (task, metric) and per measurement: ``{"task", "metric", "values": {name: v}, "deltas": ...}``."""
    baseline = next((r for r in results if r["role"] == "source"), None)
    tasks = list(dict.fromkeys(task for r in results for task in r["shown"]))
    rows = []
    for task in tasks:
        metrics = list(dict.fromkeys(m for r in results for m in table_metrics(r["tasks"].get(task, {}))))
        for metric in metrics:
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "values": {r["name"]: r["tasks"].get(task, {}).get(metric) for r in results},
                }
            )
    kv_dtype = kv_row_dtype(results)
    for metric in MEASUREMENT_ROWS:
        row = {"task": "model", "metric": metric, "values": {r["name"]: r["measurements"].get(metric) for r in results}}
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


def _format_value(value) -> str:
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
    """``| task | metric | source | converted | delta |`` (one value and delta column pair per compared model)."""
    baseline = next((r for r in results if r["role"] == "source"), None)
    others = [r for r in results if r is not baseline]
    header, align = ["task", "metric"], ["---", "---"]
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
        cells = [row["task"], row["metric"] + (f" ({row['dtype']})" if row.get("dtype") else "")]
        if baseline is not None:
            cells.append(_format_value(row["values"].get(baseline["name"])))
        for r in others:
            cells.append(_format_value(row["values"].get(r["name"])))
            if baseline is not None:
                cells.append(_format_delta(row["metric"], row.get("deltas", {}).get(r["name"])))
        lines.append("| " + " | ".join(cells) + " |")
    labels = [("source", baseline)] if baseline is not None else []
    labels += [("converted" if baseline is not None and len(others) == 1 else r["name"], r) for r in others]
    legend = [f"- {label}: `{r['path']}` ({r['measurements'].get('dtype')})" for label, r in labels]
    return "\n".join(lines) + "\n\n" + "\n".join(legend) + "\n"


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tasks(results: list[dict], path: Path) -> Path | None:
    """Small multiples: one panel per task (its first table metric) plus the KV cache, one bar per model."""
    panels = []
    for task in dict.fromkeys(task for r in results for task in r["shown"]):
        metrics = [m for r in results for m in table_metrics(r["tasks"].get(task, {}))]
        if metrics:
            panels.append((task, metrics[0], [r["tasks"].get(task, {}).get(metrics[0]) for r in results]))
    panels.append(
        (
            "KV cache",
            "values per token",
            [r["measurements"].get("kv_cache_values_per_token") for r in results],
        )
    )
    plt = _pyplot()
    names = [r["name"] for r in results]
    colors = [f"C{i}" for i in range(len(results))]
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for ax, (task, metric, values) in zip(axes.flat, panels):
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(range(len(names)), heights, color=colors)
        if (
            metric.endswith("perplexity")
            and all(h > 0 for h in heights)
            and max(heights) / min(heights) > 20
        ):
            ax.set_yscale("log")
        for bar, value in zip(bars, values):
            ax.annotate(
                _format_value(value),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(
            f"{task}\n{metric}" + (" (lower is better)" if metric in LOWER_IS_BETTER else ""), fontsize=9
        )
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.margins(y=0.15)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_conversion_error(results: list[dict], path: Path) -> Path | None:
    """Per-layer relative K and V error of each model that carries a conversion report; None when none does."""
    reports = [
        (r["name"], r["conversion_report"]["layers"])
        for r in results
        if r.get("conversion_report") and r["conversion_report"].get("layers")
    ]
    if not reports:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 3.6), squeeze=False)
    for ax, (name, layers) in zip(axes.flat, reports):
        index = [layer.get("layer", i) for i, layer in enumerate(layers)]
        for key, label in (("k_rel_error", "K (NoPE) rel. error"), ("v_rel_error", "V rel. error")):
            values = [layer.get(key) for layer in layers]
            if any(v is not None for v in values):
                ax.plot(
                    index,
                    [v if v is not None else float("nan") for v in values],
                    marker="o",
                    ms=3,
                    label=label,
                )
        ranks = {layer.get("kv_lora_rank") for layer in layers} - {None}
        rank_text = f", kv_lora_rank {ranks.pop()}" if len(ranks) == 1 else ""
        ax.set_title(f"{name}: conversion error per layer{rank_text}", fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("relative error")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _perplexity_metric(task_metrics: dict) -> str | None:
    """The perplexity a task is plotted by: lm-eval's word perplexity, or the token perplexity of a --text file."""
    return next((m for m in ("word_perplexity", "token_perplexity") if m in task_metrics), None)


def plot_perplexity_vs_kv(results: list[dict], path: Path) -> Path | None:
    """Perplexity of each perplexity task against KV values per token; None with fewer than two models."""
    ppl_tasks = [
        t
        for t in dict.fromkeys(t for r in results for t in r["shown"])
        if any(_perplexity_metric(r["tasks"].get(t, {})) for r in results)
    ]
    if len(results) < 2 or not ppl_tasks:
        return None
    baseline = next((r for r in results if r["role"] == "source"), None)
    base_kv = baseline["measurements"]["kv_cache_values_per_token"] if baseline else None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, task in enumerate(ppl_tasks):
        points = sorted(
            (r["measurements"]["kv_cache_values_per_token"], r["tasks"][task][metric], r["name"])
            for r in results
            for metric in [_perplexity_metric(r["tasks"].get(task, {}))]
            if metric
        )
        metric = next(m for r in results for m in [_perplexity_metric(r["tasks"].get(task, {}))] if m)
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            linestyle="none",
            color=f"C{i}",
            label=f"{task} ({metric.replace('_', ' ')})",
        )
        for x, y, name in points:
            label = f"{name} ({x / base_kv:.3g}× KV)" if base_kv else name
            right = x == points[-1][0] and len(points) > 1  # the rightmost label grows leftwards
            ax.annotate(
                label,
                (x, y),
                textcoords="offset points",
                xytext=(-4 if right else 4, 4),
                ha="right" if right else "left",
                fontsize=7,
            )
    values = [
        r["tasks"][t][metric]
        for r in results
        for t in ppl_tasks
        for metric in [_perplexity_metric(r["tasks"].get(t, {}))]
        if metric and r["tasks"][t][metric]
    ]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.margins(x=0.1)
    ax.set_xlabel("KV cache values per token (all layers)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("perplexity against KV-cache budget", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
