"""The benchmarks' shared harness: the environment record, the project's assets, timing side by side, the
JSON + Markdown output every suite prints, and the records file each measurement is appended to
(benchmarks/README.md; docs/benchmarks.md's tables are rendered from those records by benchmarks/render.py).

    python benchmarks/harness.py          # this machine's environment record, as the suites write it

The package and torch are imported inside the functions that need them, so a suite's ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the CPU features that decide the float32 and bfloat16 kernels torch picks (docs/benchmarks.md's machine lines)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
HELD_OUT_SLICES = ("kjv", "python_docs")  # the acceptance slices: 16,384 tokens of each, from a third in
SLICE_TOKENS = 16384
RECORDS = REPO / "benchmarks" / "records"  # one JSON-lines file per suite script, committed: docs/benchmarks.md's source
# the question each suite answers, by script name: every record carries it
QUESTIONS = {
    "quality": "How close to the source is a converted model, without training?",
    "convert_cost": "What does the default conversion cost against its floor, phase by phase, and in peak memory?",
    "scale": "How long per layer and how much memory does `mha2mla convert` take at 7B-70B layer widths?",
    "heal": "How far does `mha2mla recover` heal a conversion, on text no healing text reads?",
    "recover_speed": "How fast does a converted model train against its source under the same settings?",
    "recover_memory": "What peak memory and speed do real `mha2mla recover` runs reach, beside the --dry-run estimate?",
    "recover_data": "How fast and in how much memory does recover's streamed --data read, and how fast does it resume?",
    "decode": "How fast does a converted model decode, and how many KV-cache bytes does it hold?",
    "kernels_bench": "How fast are the MLA Triton kernels against torch SDPA and against HBM bandwidth?",
    "fresh_clone": "How long do the README's two commands take in a fresh clone?",
    "recon_solvers": "Does a second-order solver fit the conversion's reconstruction in less time than its Adam?",
}
_records_file: list[Path] = []  # set by --records (add_output_arguments); else records/<script>.jsonl


# --- the environment -------------------------------------------------------------------------------------------


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in block.splitlines())}


def git_commit() -> str:
    """The commit, ``+dirty`` when tracked files but the records (no code) differ from it ("unknown" outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/records"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_name(cpu: str, flags: set[str], cpus: int | None) -> str | None:
    """The name docs/benchmarks.md gives this kind of machine (its "Machines" line), or None for another kind."""
    if cpus != 2:
        return None
    if cpu.startswith("AMD EPYC") and "avx512_bf16" in flags and "amx_bf16" not in flags:
        return "A"
    if cpu.startswith("Intel(R) Xeon") and "amx_bf16" in flags:
        return "C"
    return None


def environment() -> dict:
    """What a figure depends on: machine, CPU and its flags, cores and threads, GPU, library versions, commit."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    cpu = info.get("model name") or platform.processor() or platform.machine()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "machine": platform.machine(),
        "name": machine_name(cpu, flags, cpus),
        "cpu": cpu,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "cpus": cpus,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": [round(load, 2) for load in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "mha2mla": _version("mha2mla"),
        "commit": git_commit(),
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# --- the project's assets, through the package -------------------------------------------------------------------


def source_model(model: str | None = None) -> Path:
    """The source model's folder: ``model`` (folder, .gguf or hub id) or the cached default SmolLM2 GGUF, dequantised
    (a UserError saying ``make assets`` when it is not fetched)."""
    from mha2mla.io.cache import cached_default_model
    from mha2mla.io.source import resolve_source

    return resolve_source(model or cached_default_model())


def held_out_ids(tokenizer, name: str, num_tokens: int, start_fraction: float = 1 / 3) -> list[int]:
    """``num_tokens`` token ids of held-out text ``name`` (``kjv`` or ``python_docs``) from ``start_fraction`` in:
    by default the evaluation slice every suite scores."""
    from mha2mla.data.held_out import held_out_token_ids
    from mha2mla.io.cache import cached_held_out_text

    return held_out_token_ids(tokenizer, cached_held_out_text(name), num_tokens, start_fraction)


def perplexities(folder: str | Path, slices: Sequence[str] = HELD_OUT_SLICES, num_tokens: int = SLICE_TOKENS) -> dict:
    """Held-out perplexity of the model in ``folder`` (float32, transformers) on each slice, as ``mha2mla eval`` and
    every suite score it: ``num_tokens`` tokens from a third into the text, 512-token windows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla.evaluation.perplexity import held_out_perplexity
    from mha2mla.io.cache import cached_held_out_text

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return {name: held_out_perplexity(model, tokenizer, cached_held_out_text(name), num_tokens=num_tokens)
            for name in slices}


def cache_path(*parts: str) -> Path:
    """A path inside the cache (``$MHA2MLA_CACHE``, else the checkout's .cache), e.g. ``cache_path("converted")``."""
    from mha2mla.io.cache import cache_dir

    return cache_dir().joinpath(*parts)


# --- timing side by side -----------------------------------------------------------------------------------------


def time_side_by_side(candidates: dict[str, Callable[[int], object]], repeats: int = 5, warmup: int = 1,
                      synchronize: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each call of every candidate, taken in turn round after round (so all see the same machine load);
    each call gets the round's index (0 .. warmup + repeats - 1: e.g. which batch to take); ``warmup`` untimed rounds
    first; ``synchronize`` (e.g. ``torch.cuda.synchronize``) runs around each call."""
    sync = synchronize or (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(warmup + repeats):
        for name, call in candidates.items():
            sync()
            started = time.perf_counter()
            call(round_)
            sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - started)
    return times


# --- output ------------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """``rows`` as a Markdown table with ``columns`` (default: every key, in first-seen order)."""
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


class _RecordsFile(argparse.Action):
    """``--records PATH``: the file this run's records are appended to, read by ``record``."""

    def __call__(self, parser, namespace, value, option_string=None):
        _records_file[:] = [Path(value)]
        setattr(namespace, self.dest, value)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", dest="json_out", default=None, metavar="PATH", help="also write the JSON record here")
    parser.add_argument("--records", default=None, metavar="PATH", action=_RecordsFile,
                        help="append one JSON line per measurement here (default: benchmarks/records/<suite>.jsonl)")


def _script() -> str:
    return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "interactive"


def records_path() -> Path:
    """Where this run's records go: ``--records``, else the script's committed records file."""
    return _records_file[0] if _records_file else RECORDS / f"{_script()}.jsonl"


def command_line() -> str:
    """The command as run, from the checkout: OMP_NUM_THREADS when set, the script's path, its arguments."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    threads = os.environ.get("OMP_NUM_THREADS")
    return " ".join([*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python", shlex.quote(str(shown)),
                     *map(shlex.quote, sys.argv[1:])])


def record(suite: str, settings: dict, figures: dict, env: dict | None = None, run: dict | None = None) -> dict:
    """Append one measurement to the records file (``records_path``) as one JSON line: the suite's question, the
    command, the machine's flags, the commit, the library versions, the settings and the figures."""
    env = env or environment()
    line = {
        "suite": suite, "question": QUESTIONS.get(_script(), ""), "command": command_line(),
        "machine": {key: env.get(key) for key in ("name", "cpu", "cpu_flags", "cpus", "torch_threads",
                                                   "omp_num_threads", "load_average", "gpu") if key != "name" or env.get(key)},
        "commit": env.get("commit"),
        "versions": {key: env.get(key) for key in ("python", "torch", "transformers", "mha2mla")},
        "date": datetime.date.today().isoformat(), "settings": settings, "figures": figures, **({"run": run} if run else {}),
    }
    path = records_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(line, default=str) + "\n")
    return line


def report(suite: str, settings: dict, rows: Sequence[dict], json_out: str | None = None,
           columns: Sequence[str] | None = None, table: str | None = None, commit: str | None = None, **extra) -> dict:
    """Print the suite's JSON record (environment, settings, results, ``extra``) and then its Markdown table
    (``table`` when given, else ``rows`` with ``columns``); write the JSON to ``json_out`` too when given; append
    each row to the records file as one measurement (``record``). ``commit``: the commit measured, where it is not
    the checkout's (a fresh clone's)."""
    env = environment() | ({"commit": commit} if commit else {})
    whole = {"suite": suite, "environment": env, "settings": settings, "results": list(rows), **extra}
    for row in rows:
        record(suite, settings, row, env, run=json.loads(json.dumps(extra, default=str)) if extra else None)
    text = json.dumps(whole, indent=2, default=str)
    print(text)
    print()
    print(table if table is not None else markdown_table(rows, columns))
    if json_out:
        Path(json_out).write_text(text + "\n", encoding="utf-8")
    return whole


def run(main: Callable[[], int | None]) -> int:
    """Call a suite's ``main``; a mistake in its input or a missing asset (``mha2mla.UserError``) is one ``error:``
    line and exit status 2, not a traceback."""
    from mha2mla import UserError

    try:
        return main() or 0
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    print(json.dumps(environment(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
