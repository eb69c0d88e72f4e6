"""The comparison report's PNG plots (matplotlib, the eval extra): task scores, per-layer conversion error, and
perplexity against the KV-cache budget."""

from __future__ import annotations

import math
from pathlib import Path

from mha2mla.evaluation.table import LOWER_IS_BETTER, format_value, table_metrics


def _save(plt, fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
                format_value(value),
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
    return _save(plt, fig, path)


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
    return _save(plt, fig, path)


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
    return _save(plt, fig, path)
