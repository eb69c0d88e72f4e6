"""How long do the README's two commands take on a fresh machine?

    python benchmarks/fresh_clone.py            # clones HEAD, then `make test` and `make demo` in the clone

Clones the checkout's HEAD into a temporary folder (nothing of this checkout's ``.venv`` or ``.cache`` is reused:
``MHA2MLA_CACHE`` is unset for the clone) and runs, one after the other, ``make test`` (the venv built from the
package registries, then the default test suite) and ``make demo`` (the assets fetched, the default conversion of
the bundled SmolLM2-135M, its perplexity and KV bytes beside the source's). Each is timed by wall clock; the demo's
perplexity ratio and peak memory (``/usr/bin/time``'s maximum RSS of the whole make) are read from its output. Run
it on an idle machine: both are wall-clock figures.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

SUMMARY = re.compile(r"^=* ?(?P<summary>\d+ passed.*?) in (?P<seconds>[\d.]+)s", re.M)
DEMO_RATIO = re.compile(r"perplexity x(?P<ratio>[\d.]+) before any recovery")
MAX_RSS = re.compile(r"Maximum resident set size \(kbytes\): (?P<kib>\d+)")


def timed_make(clone: Path, target: str, env: dict) -> tuple[float, str, int]:
    """(wall seconds, output, exit code) of ``make TARGET`` in ``clone``, under /usr/bin/time -v for the peak RSS."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", "make", target], cwd=clone, env=env, capture_output=True, text=True)
    return time.perf_counter() - started, done.stdout + done.stderr, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=None, help="where the clone goes (default: the system's temporary folder)")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if not Path("/usr/bin/time").is_file():
        raise SystemExit("error: /usr/bin/time is missing; install it (Debian: apt-get install time).")
    env = {key: value for key, value in os.environ.items() if key not in ("MHA2MLA_CACHE", "VIRTUAL_ENV")}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        clone = Path(tmp) / "mha2mla"
        subprocess.run(["git", "clone", "-q", str(harness.REPO), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                                check=True).stdout.strip()
        rows = []
        for target in ("test", "demo"):
            seconds, output, code = timed_make(clone, target, env)
            summary, demo, rss = SUMMARY.search(output), DEMO_RATIO.search(output), MAX_RSS.search(output)
            rows.append({"target": f"make {target}", "exit code": code, "seconds": round(seconds, 1),
                         "tests": summary.group("summary") if summary else None,
                         "pytest seconds": float(summary.group("seconds")) if summary else None,
                         "kjv x source": float(demo.group("ratio")) if demo else None,
                         "peak GiB": round(int(rss.group("kib")) / 2**20, 2) if rss else None})
            print(output[-3000:], file=sys.stderr)
    harness.report("fresh-clone", {}, rows, args.json_out, commit=commit,
                   columns=["target", "exit code", "seconds", "tests", "pytest seconds", "kjv x source", "peak GiB"])
    return 0 if all(row["exit code"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(harness.run(main))
