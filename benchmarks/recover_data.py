"""Recovery, the data path alone: tokens/s and peak RSS of `mha2mla recover`'s streamed ``--data``
(mha2mla/train/data/stream.py) over a generated corpus of ~1B tokens against the same stream over a small corpus, the
time to resume at a row far into the large one, and the in-memory packing the stream replaced, on the small one.

    OMP_NUM_THREADS=1 python benchmarks/recover_data.py --corpus /tmp/recover_data_corpus --tokens 1e9
    OMP_NUM_THREADS=1 python benchmarks/recover_data.py --tokens 1e9 --read-tokens 2.5e8  # a shorter pass
    python benchmarks/recover_data.py --tokens 2e7 --small-tokens 2e6          # a quick look

The corpus: JSON-lines files of synthetic documents, each 1 to 80 sentences drawn at random from the cached texts
(``make assets``), written under ``--corpus`` (deleted afterwards unless ``--keep``). The tokenizer is the SmolLM2
source's (the cached GGUF, or ``--model``). Every measurement runs in a fresh process, so each peak RSS is its own:

- ``stream``: ``StreamRows.rows_at`` batch after batch until the corpus's first epoch ends (the large corpus keeps
  the data state of a block ``--resume-at`` of the way in, and a hash of every batch);
- ``in-memory packing``: ``io.documents.iter_documents`` + ``data.pack_token_lists`` over the small corpus (the path before streaming; the large corpus
  would need its rows in memory, 16 bytes a token);
- ``resume``: a fresh process loads that state and reads the next batch, checked equal to the first pass's;
- side by side: the stream and the packing over a third, small corpus (``--ratio-tokens``) in turn, round after
  round: their speed ratio (the measurements above run one after another, each under its own load).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness

BATCH_ROWS = 16  # rows per rows_at call, as a step's batch
CHARACTERS_PER_TOKEN = 4.2  # SmolLM2's tokenizer on this English text, to size the corpus (the table says the count)
TEXTS = ("kjv", "python_docs", "debian_policy", "fortunes")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="/tmp/recover_data_corpus", help="folder of the generated corpus")
    parser.add_argument("--tokens", type=float, default=1e9, help="about this many tokens in the large corpus")
    parser.add_argument("--small-tokens", type=float, default=2e7, help="about this many in the small one")
    parser.add_argument("--ratio-tokens", type=float, default=2e6,
                        help="about this many in the corpus the stream and the packing read in turn, round after round")
    parser.add_argument("--files", type=int, default=16, help="JSON-lines files of the large corpus")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--read-tokens", type=float, default=None,
                        help="stop the large corpus's stream after this many tokens (default: its whole first epoch)")
    parser.add_argument("--resume-at", type=float, default=0.9, help="where the resumed row lies, as a fraction")
    parser.add_argument("--model", default=None, help="whose tokenizer (default: the cached SmolLM2 GGUF)")
    parser.add_argument("--keep", action="store_true", help="keep the generated corpus")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one measurement, in its own process
    harness.add_output_arguments(parser)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the corpus


def sentences() -> list[str]:
    """Sentences of the cached texts, JSON-escaped (a document line is their join)."""
    from mha2mla.io.cache import cached_held_out_text

    pool = []
    for name in TEXTS:
        text = cached_held_out_text(name).read_text(encoding="utf-8")
        pool += [json.dumps(s.strip())[1:-1] for s in text.replace("\n", " ").split(". ") if len(s.strip()) > 20]
    return pool


def write_corpus(folder: Path, tokens: float, files: int, seed: int) -> int:
    """JSON-lines files of ~``tokens`` tokens of documents of 1 to 80 sentences; their size in bytes."""
    pool, draw = sentences(), random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = int(tokens * CHARACTERS_PER_TOKEN / files)
    for index in range(files):
        written = 0
        with open(folder / f"part-{index:03d}.jsonl", "w", encoding="utf-8") as handle:
            while written < per_file:
                count = min(80, int(draw.lognormvariate(2.0, 1.0)) + 1)
                line = '{"text": "' + ". ".join(draw.choices(pool, k=count)) + '."}\n'
                handle.write(line)
                written += len(line)
    return sum(path.stat().st_size for path in folder.iterdir())


# ---------------------------------------------------------------------------------------------- measurements


def _digest(batch) -> str:
    return hashlib.sha256(batch["input_ids"].numpy().tobytes() + batch["position_ids"].numpy().tobytes()).hexdigest()


def measure_stream(tokenizer, spec: dict) -> dict:
    """Read the stream's first epoch (or its first ``read_tokens``) batch by batch; the data states of its blocks and a
    hash of every batch."""
    from mha2mla.io.documents import units
    from mha2mla.train.data.stream import StreamRows

    rows = StreamRows(units(spec["corpus"]), tokenizer, spec["seq_len"], seed=0)
    states, digests, start = [], {}, 0
    limit = spec.get("read_tokens") or float("inf")
    started = time.perf_counter()
    while start * spec["seq_len"] < limit:
        batch = rows.rows_at([start], BATCH_ROWS)
        if rows.state_dict()["cursor"]["epoch"] > 0:
            break
        digests[start] = _digest(batch)
        state = rows.state_dict()
        if not states or states[-1]["cursor"] != state["cursor"]:
            states.append(state)
        start += BATCH_ROWS
    seconds = time.perf_counter() - started
    chosen = states[int(len(states) * spec.get("resume_at", 0.0))]
    row = -(-chosen["cursor"]["first_row"] // BATCH_ROWS) * BATCH_ROWS + BATCH_ROWS  # a batch inside the block
    return {"rows": start, "tokens": start * spec["seq_len"], "seconds": seconds, "resume_state": chosen,
            "resume_row": row, "resume_digest": digests.get(row)}


def measure_packing(tokenizer, spec: dict) -> dict:
    """The path before streaming: the whole corpus read, tokenized and packed into memory at once."""
    from mha2mla.io.documents import iter_documents
    from mha2mla.train.data.packing import pack_token_lists

    started = time.perf_counter()
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids = (tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + eos
           for text in iter_documents(spec["corpus"], None))  # each document whole, EOS after it
    packed = pack_token_lists(ids, spec["seq_len"])
    return {"rows": len(packed), "tokens": len(packed) * spec["seq_len"], "seconds": time.perf_counter() - started}


def measure_resume(tokenizer, spec: dict) -> dict:
    """A fresh stream set to a saved state, then the batch at ``resume_row``: seconds and its hash."""
    from mha2mla.io.documents import units
    from mha2mla.train.data.stream import StreamRows

    started = time.perf_counter()
    rows = StreamRows(units(spec["corpus"]), tokenizer, spec["seq_len"], seed=0)
    rows.load_state_dict(spec["resume_state"])
    batch = rows.rows_at([spec["resume_row"]], BATCH_ROWS)
    return {"seconds": time.perf_counter() - started, "digest": _digest(batch)}


def side_by_side(model: str, corpus: str, seq_len: int, rounds: int = 3) -> dict:
    """Seconds of the stream's first epoch and of the in-memory packing over the same corpus, taken in turn round
    after round (harness.time_side_by_side: both see the same load): the one speed ratio a shared machine gives."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    spec = {"corpus": corpus, "seq_len": seq_len}
    times = harness.time_side_by_side({"stream": lambda _: measure_stream(tokenizer, spec),
                                       "packing": lambda _: measure_packing(tokenizer, spec)}, repeats=rounds)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def child(spec: dict) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    measure = {"stream": measure_stream, "packing": measure_packing, "resume": measure_resume}[spec["kind"]]
    result = measure(tokenizer, spec)
    print(json.dumps({**result, "peak_rss_mib": harness.peak_rss_mib()}))


def in_child(**spec) -> dict:
    """One measurement in a fresh Python process (its own peak RSS)."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {spec['kind']} measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- the suite


def _row(name: str, corpus_bytes: int, result: dict) -> dict:
    return {"path": name, "corpus MB": round(corpus_bytes / 1e6), "tokens read": result.get("tokens"),
            "seconds": round(result["seconds"], 2), "tokens/s": round(result["tokens"] / result["seconds"])
            if result.get("tokens") else None, "peak RSS MiB": result["peak_rss_mib"]}


def main() -> int:
    args = parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    model = str(harness.source_model(args.model))
    corpus = Path(args.corpus)
    made = not corpus.exists()
    try:
        large_bytes = write_corpus(corpus / "large", args.tokens, args.files, seed=1) if made else sum(
            p.stat().st_size for p in (corpus / "large").iterdir())
        small_bytes = write_corpus(corpus / "small", args.small_tokens, 1, seed=2) if made else sum(
            p.stat().st_size for p in (corpus / "small").iterdir())
        if made:
            write_corpus(corpus / "ratio", args.ratio_tokens, 1, seed=3)
        common = {"model": model, "seq_len": args.seq_len}
        small = in_child(kind="stream", corpus=str(corpus / "small"), **common)
        packing = in_child(kind="packing", corpus=str(corpus / "small"), **common)
        large = in_child(kind="stream", corpus=str(corpus / "large"), resume_at=args.resume_at,
                         read_tokens=args.read_tokens, **common)
        resume = in_child(kind="resume", corpus=str(corpus / "large"), resume_state=large["resume_state"],
                          resume_row=large["resume_row"], **common)
        medians = side_by_side(model, str(corpus / "ratio"), args.seq_len)
    finally:
        if made and not args.keep:
            shutil.rmtree(corpus, ignore_errors=True)
    rows = [_row("stream, small corpus", small_bytes, small), _row("in-memory packing, small corpus", small_bytes, packing),
            _row("stream, large corpus", large_bytes, large),
            {"path": f"resume at row {large['resume_row']:,} (a fresh process)", "corpus MB": round(large_bytes / 1e6),
             "seconds": round(resume["seconds"], 2), "peak RSS MiB": resume["peak_rss_mib"]}]
    reading_to_row = large["resume_row"] / large["rows"] * large["seconds"]
    settings = {**vars(args), "batch_rows": BATCH_ROWS, "model": model}
    harness.report("recover_data", settings, rows, args.json_out, resume_equal=resume["digest"] == large["resume_digest"],
                   resume_vs_reading_to_the_row=resume["seconds"] / reading_to_row,
                   side_by_side_median_seconds=medians, packing_over_stream_seconds=medians["packing"] / medians["stream"])
    return 0


if __name__ == "__main__":
    sys.exit(harness.run(main))
