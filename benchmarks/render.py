"""Render docs/benchmarks.md's tables from the records in benchmarks/records/ (one JSON line per measurement, appended
by the suites through benchmarks/harness.py's ``record``).

    python benchmarks/render.py            # rewrite every table between its markers in docs/benchmarks.md
    python benchmarks/render.py --check    # exit 1 when the page differs from what the records render

A table sits between ``<!-- table: NAME -->`` and ``<!-- /table -->``; NAME is a key of TABLES below, which says
which records file and suite feed it, which records it keeps and how each column reads a record. Every row ends
with the commit and the machine its record names, so no figure is typed into the page by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "records"
PAGE = REPO / "docs" / "benchmarks.md"
MARKERS = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def get(record: dict, path: str, default=None):
    """The value at a dotted ``path`` of ``record`` (``figures.perplexity.kjv``), or ``default``."""
    value = record
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def number(value, digits: int = 2) -> str:
    """A figure with thousands separators and ``digits`` decimals; empty when missing."""
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def times(value, digits: int = 3) -> str:
    return "" if value is None else f"×{value:.{digits}f}"


def duration(seconds) -> str:
    """Seconds as minutes below an hour, else hours."""
    return "" if seconds is None else f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def machine(record: dict) -> str:
    """The machine as the page names it (A, B, C: docs/benchmarks.md's machine list), else its CPU and cores; a
    measurement other jobs shared is marked so."""
    found = record.get("machine") or {}
    name = found.get("name") or found.get("gpu") or f"{found.get('cpu', '?')}, {found.get('cpus', '?')} cores"
    threads = found.get("omp_num_threads")
    return name + (f", {threads} thr." if threads else "") + (", shared" if found.get("shared") else "")


def ppl_cell(slice_name: str) -> Callable[[dict], str]:
    """Perplexity (× source) on a held-out slice: the record's own ratio, else against its run's source perplexity."""
    def cell(record: dict) -> str:
        ppl = get(record, f"figures.perplexity.{slice_name}")
        ratio = get(record, f"figures.x_source.{slice_name}")
        source = get(record, f"run.source_perplexity.{slice_name}")
        if ratio is None and ppl is not None and source:
            ratio = ppl / source
        if ppl is None:
            return times(ratio)
        return f"{ppl:.2f}" + (f" ({times(ratio)})" if ratio is not None else "")
    return cell


def phase(name: str) -> Callable[[dict], str]:
    """A conversion phase's wall seconds and its multiple of the floor."""
    def cell(record: dict) -> str:
        seconds, floor = get(record, f"figures.conversion.phases.{name}"), get(record, "figures.floor_seconds")
        if seconds is None:
            return ""
        return f"{seconds:,.1f}" + (f" ({seconds / floor:.2f}×)" if floor else "")
    return cell


def field(path: str, digits: int = 2) -> Callable[[dict], str]:
    def cell(record: dict) -> str:
        value = get(record, path)
        return value if isinstance(value, str) else number(value, digits)
    return cell


def ratio_field(path: str, digits: int = 3) -> Callable[[dict], str]:
    return lambda record: times(get(record, path), digits)


@dataclass(frozen=True)
class Table:
    records: str  # the file under benchmarks/records/
    suite: str  # the records' "suite"
    columns: tuple[tuple[str, Callable[[dict], str]], ...]
    keep: Callable[[dict], bool] = lambda record: True
    order: Callable[[dict], object] | None = None  # the rows' sort key (None: as appended)


def _conversion(record: dict) -> str:
    seconds, floor = get(record, "figures.conversion.seconds"), get(record, "figures.floor_seconds")
    return f"**{seconds:,.1f} s (×{seconds / floor:.2f})**"


def _steps(record: dict) -> str:
    steps = get(record, "figures.reconstruction_steps", get(record, "figures.conversion.reconstruction_steps"))
    return phase("reconstruction")(record) + f"; {number(steps)} steps"


def _pair(record: dict, path: str) -> str:
    first, second = (get(record, f"{path}.{name}") for name in ("kjv", "python_docs"))
    return "" if first is None else f"{first:.2f} / {second:.2f}"


def _mc(record: dict) -> str:
    points = [get(record, f"figures.x_source.{task}_points") for task in ("fortunes_mc", "debian_policy_mc")]
    return "" if points[0] is None else " / ".join(f"{value:+.0f}" for value in points)


def _bits(name: str) -> Callable[[dict], str]:
    def cell(record: dict) -> str:
        value, ratio = get(record, f"figures.bits_per_byte.{name}"), get(record, f"figures.x_source.{name}")
        return f"{value:.3f}" + (f" ({times(ratio)})" if ratio is not None else "")
    return cell


def _acc(task: str) -> Callable[[dict], str]:
    return lambda record: f"{get(record, f'figures.{task}.acc'):.2f} / {get(record, f'figures.{task}.acc_norm'):.2f}"


# heal.py score labels of the healing-per-minute arms (docs/benchmarks.md, "Healing per minute"), in the table's words
ROUTE_ARMS = {
    "smollm2-135m-kv0.125": "converted (the default at 12.5%), not healed",
    "smollm2-135m-kv0.125-adam": "converted (the default at 12.5%), again, beside the K-FAC conversion",
    "smollm2-135m-kv0.125-kfac": "converted at 12.5% with K-FAC Gauss-Newton reconstruction steps, not healed (not kept)",
    "kl-base": "KL at the head, every layer trains (the recipe's objective)",
    "kl-attn": "KL at the head, attention trains, for about the baseline's minutes",
    "kl-ild": "KL at the head + each layer's output matched to the source's, weight 1; every layer trains (not kept)",
    "attn-tf": "each attention on the source's input at its depth, matched to its output; attention trains (not kept)",
}

# benchmarks/recon_solvers.py's solvers, in the table's words
SOLVERS = {"adam": "Adam, 160 steps of 4 (the default)", "lbfgs": "L-BFGS, whole set", "kfac": "K-FAC, 8 steps of 64"}


def _fits(record: dict) -> str:
    pairs = zip(get(record, "figures.held_out_error_before"), get(record, "figures.held_out_error_after"))
    return " · ".join(f"{before:.3f} → {after:.3f}" for before, after in pairs)


def _minutes(record: dict) -> str:
    seconds = get(record, "figures.wall_seconds")
    return "" if seconds is None else f"{seconds / 60:.1f}"


TABLES: dict[str, Table] = {
    "quality": Table("quality.jsonl", "quality", (
        ("KV budget", lambda r: f"{100 * get(r, 'figures.budget'):g}%"), ("profile", field("figures.profile")),
        ("compute dtype", field("figures.compute_dtype")), ("options", field("settings.options")),
        ("KJV ppl (×)", ppl_cell("kjv")), ("Python docs ppl (×)", ppl_cell("python_docs")),
        ("convert s", field("figures.convert_seconds", 1)))),
    "family-smoke": Table("quality.jsonl", "family-smoke", (
        ("family", field("figures.family")), ("setting", field("figures.setting")),
        ("max abs logit error", lambda r: f"{get(r, 'figures.sequence max abs', get(r, 'figures.max abs')):g}"),
        ("top-1", lambda r: f"{get(r, 'figures.top-1 agreement'):g}")),
        keep=lambda record: "full capacity" in get(record, "figures.setting", "")),  # 31.25% of random weights: a check
    "convert-cost": Table("convert_cost.jsonl", "convert_cost", (
        ("source, budget", lambda r: f"{get(r, 'figures.shape')}, {100 * get(r, 'figures.kv_budget'):g}%"),
        ("floor s", field("figures.floor_seconds", 1)), ("reconstruction", _steps), ("advance", phase("advance")),
        ("statistics", phase("statistics")), ("refinement", phase("refinement")),
        ("source heads", phase("source heads")), ("other", phase("other")), ("**conversion**", _conversion),
        ("peak GiB", field("figures.conversion.peak_rss_gib")),
        ("KJV / Python docs ppl", lambda r: _pair(r, "figures.conversion.perplexity"))),
        keep=lambda record: record.get("commit") != "4b18d91"),  # the same conversions again at 915e8d7
    "scale": Table("scale.jsonl", "scale", (
        ("shape", field("figures.shape")), ("mode", field("figures.mode")),
        ("s/layer", field("figures.seconds_per_layer", 1)), ("peak GiB", field("figures.peak_rss_gib")),
        ("full depth (extrapolated)", lambda r: duration(get(r, "figures.extrapolated_full_depth_seconds"))))),
    "heal-recipe": Table("heal.jsonl", "recipe-eval", (
        ("model (bits per byte, × source)", field("figures.label")), ("KJV", _bits("kjv")),
        ("Python docs", _bits("python_docs")), ("**fortunes**", _bits("fortunes")),
        ("**Debian policy**", _bits("debian_policy")), ("fortunes_mc acc / norm", _acc("fortunes_mc")),
        ("debian_policy_mc acc / norm", _acc("debian_policy_mc")))),
    "heal-curve": Table("heal.jsonl", "recovery-curve", (
        ("thousand tokens trained", lambda r: number(round(get(r, "figures.tokens_trained") / 1000))),
        ("**fortunes**", ratio_field("figures.x_source.fortunes", 2)),
        ("**Debian policy**", ratio_field("figures.x_source.debian_policy", 2)),
        ("KJV", ratio_field("figures.x_source.kjv", 2)), ("Python docs", ratio_field("figures.x_source.python_docs", 2)),
        ("MC points", _mc))),
    "heal-routes": Table("heal.jsonl", "recovery", (
        ("arm", lambda r: ROUTE_ARMS[get(r, "figures.label")]), ("tokens trained", field("figures.tokens")),
        ("healing minutes", _minutes), ("tokens/s", field("figures.tokens_per_second", 1)),
        ("**fortunes**", ratio_field("figures.x_source.fortunes", 2)),
        ("**Debian policy**", ratio_field("figures.x_source.debian_policy", 2)),
        ("KJV", ratio_field("figures.x_source.kjv", 2)), ("Python docs", ratio_field("figures.x_source.python_docs", 2)),
        ("MC points", _mc)),
        keep=lambda record: get(record, "figures.label") in ROUTE_ARMS,
        order=lambda record: list(ROUTE_ARMS).index(get(record, "figures.label"))),
    "recon-solvers": Table("recon_solvers.jsonl", "recon-solvers", (
        ("budget", lambda r: f"{100 * get(r, 'figures.kv_budget'):g}%"), ("solver", lambda r: SOLVERS[get(r, "figures.solver")]),
        ("held-out error, layers 2 · 10 · 20", _fits), ("s", field("figures.seconds", 1)),
        ("CPU s", field("figures.cpu_seconds", 1)), ("passes per layer", lambda r: " · ".join(number(n, 0) for n in get(r, "figures.sequence_passes"))))),
    "recon-convert": Table("recon_solvers.jsonl", "recon-solvers-convert", (
        ("budget", lambda r: f"{100 * get(r, 'figures.kv_budget'):g}%"), ("solver", lambda r: SOLVERS[get(r, "figures.solver")]),
        ("convert min", lambda r: f"{get(r, 'figures.convert_seconds') / 60:.1f}"),
        ("reconstruction min", lambda r: f"{get(r, 'figures.phase_seconds.reconstruction') / 60:.1f}"))),
    "heal-step": Table("heal.jsonl", "heal-step", (
        ("conversion", field("settings.converted")), ("weight stepped", field("figures.kind")),
        ("loss, converted", field("figures.converted", 3)), ("loss, balanced", field("figures.balanced", 3))),
        keep=lambda record: get(record, "figures.kind") in ("none", "self_attn.kv_b_proj.weight")),  # others: balancing moves nothing
    "recover-speed": Table("recover_speed.jsonl", "recovery-speed", (
        ("model", field("figures.model")), ("compute dtype", field("figures.compute_dtype")),
        ("tokens/s", field("figures.tokens_per_second", 1)))),
    "recover-memory": Table("recover_memory.jsonl", "recover_memory", (
        ("case", field("figures.case")), ("peak GiB", field("figures.peak GiB")),
        ("tokens/s", field("figures.tokens/s", 1)),
        ("(estimate + libraries) / peak", field("figures.estimate + libraries / peak")))),
    "recover-data": Table("recover_data.jsonl", "recover_data", (
        ("path", field("figures.path")), ("tokens read", field("figures.tokens read")),
        ("seconds", field("figures.seconds")), ("tokens/s", field("figures.tokens/s")),
        ("peak RSS MiB", field("figures.peak RSS MiB", 0)))),
    "decode": Table("decode.jsonl", "decode", (
        ("context", field("figures.context")), ("batch", field("figures.batch")), ("model", field("figures.model")),
        ("prefill s", field("figures.prefill_s", 1)), ("decode tok/s", field("figures.decode_tokens_per_s")),
        ("cache MiB", lambda r: number(get(r, "figures.cache_bytes") / 2**20, 1)))),
    "fresh-clone": Table("fresh_clone.jsonl", "fresh-clone", (
        ("command", field("figures.target")), ("wall", lambda r: duration(get(r, "figures.seconds"))),
        ("tests", field("figures.tests")), ("of which pytest", lambda r: duration(get(r, "figures.pytest seconds"))),
        ("KJV × source (demo)", ratio_field("figures.kjv x source", 2)), ("peak GiB", field("figures.peak GiB")))),
    "engines": Table("engines.jsonl", "test-engines", (
        ("case", field("figures.case")), ("prompt max \\|Δ logprob\\|", field("figures.prompt_max_logprob_delta")),
        ("prompt top-1", field("figures.prompt_top1")),
        ("decode max \\|Δ logprob\\|", field("figures.decode_max_logprob_delta")),
        ("greedy 32 tokens", field("figures.greedy")), ("KV B/token (vLLM / plan)", field("figures.kv_bytes")))),
}


def read_records(name: str) -> list[dict]:
    path = RECORDS / name
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def render_table(table: Table) -> str:
    """The Markdown table of every kept record of ``table``'s suite, in the order they were appended."""
    rows = [record for record in read_records(table.records) if record.get("suite") == table.suite and table.keep(record)]
    if table.order is not None:
        rows.sort(key=table.order)
    headers = [header for header, _ in table.columns] + ["commit", "machine"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for record in rows:
        cells = [cell(record) for _, cell in table.columns] + [f"`{record.get('commit', '?')}`", machine(record)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """``text`` with every marked table rewritten from the records (an unknown table name is an error)."""
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise SystemExit(f"error: docs/benchmarks.md names table {name!r}, which benchmarks/render.py does not define")
        return match.group(1) + render_table(TABLES[name]) + match.group(4)
    return MARKERS.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is not as rendered")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to render (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    rendered = render(text)
    if args.check:
        if rendered != text:
            print(f"error: {args.page} differs from its records; run python benchmarks/render.py", file=sys.stderr)
            return 1
        return 0
    if rendered != text:
        args.page.write_text(rendered, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
