"""Training text the teacher writes itself, for a recovery run given ``--teacher`` and no ``--data``
(docs/recover.md, "No dataset: teacher-generated text").

Each row is one sample of ``seq_len`` tokens: the tokenizer's BOS token (EOS where there is no BOS: a document
separator), then ``seq_len - 1`` tokens sampled from the teacher with a KV cache (temperature, optional top-p),
under ``torch.no_grad`` in the teacher's dtype, never stopping early. An EOS the teacher samples ends a document:
the positions restart after it, as ``pack_token_lists`` restarts them at a document start, so the usual target
mask (a segment's first token is not a target) applies and the next document is trained without the one before.

Rows come in chunks of ``batch_size``; chunk ``k`` is sampled with its own generator seeded from ``(seed, k)``, so
its content does not depend on which chunks were made before. Every finished chunk is written atomically to
``cache_folder/KEY/chunk-NNNNN.safetensors`` (KEY: a hash of the teacher's files, its dtype and the sampling
settings, named in ``KEY/meta.json``); a later call reads the chunks that are there and samples only the missing
ones, so a killed run picks up where it stopped and a second run reuses the text."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import DynamicCache

from mha2mla import UserError
from mha2mla.io.cache import cache_dir
from mha2mla.io.loader import model_path
from mha2mla.io.model_folder import CONFIG_FILE, GGUF_SUFFIX
from mha2mla.io.output import write_errors
from mha2mla.train.data.packing import MemoryRows, PackedSequences

log = logging.getLogger(__name__)

CHUNK_ROWS = 8  # rows per cached chunk in a run: a fixed size, so runs with other batch sizes reuse the text
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", GGUF_SUFFIX)


# ---------------------------------------------------------------------------------------------- sampling


def document_positions(input_ids: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """(N, L) positions restarting at 0 at every row start and after every EOS past the row's first token (the
    row's first token is the start token, which may be EOS itself)."""
    index = torch.arange(input_ids.shape[1], dtype=torch.int64).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    if eos_id is not None and input_ids.shape[1] > 2:
        starts[:, 2:] = input_ids[:, 1:-1] == eos_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def _sample_next(logits: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float | None,
                 vocab_size: int) -> torch.Tensor:
    """(B, 1) token ids drawn from (B, V) logits: ids past the tokenizer's vocabulary excluded, then temperature,
    then nucleus (top-p) filtering, which keeps the smallest set of likeliest tokens holding ``top_p``."""
    logits = logits.float()
    if logits.shape[-1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p is not None and top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return torch.multinomial(probs, 1, generator=generator)


def _cache_argument(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_chunk(teacher, start_id: int, rows: int, seq_len: int, seed: int, temperature: float = 1.0,
                 top_p: float | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """(rows, seq_len) int64 on the CPU: ``start_id`` followed by ``seq_len - 1`` tokens sampled from ``teacher``
    on its own device and in its own dtype, with a generator seeded by ``seed``."""
    device = next(teacher.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    vocab_size = vocab_size or teacher.get_output_embeddings().weight.shape[0]
    ids = torch.full((rows, 1), start_id, dtype=torch.int64, device=device)
    # the KV cache, filled in place; transformers renamed its argument past_key_values -> cache in 5.x
    cache = {_cache_argument(teacher): DynamicCache(config=teacher.config)}
    tokens = [ids]
    for _ in range(seq_len - 1):
        logits = teacher(input_ids=ids, use_cache=True, **cache).logits
        ids = _sample_next(logits[:, -1], generator, temperature, top_p, vocab_size)
        tokens.append(ids)
    return torch.cat(tokens, dim=1).cpu()


def chunk_seed(seed: int, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of a run seeded ``seed`` (independent of every other chunk's)."""
    digest = hashlib.sha256(f"mha2mla generated text {seed} {chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# ---------------------------------------------------------------------------------------------- the cache


def teacher_identity(path: str | Path) -> dict:
    """The teacher's resolved path and the size and modification time of its .gguf file, or of its folder's
    config.json and weight files: a changed teacher gets new text."""
    path = Path(path).expanduser().resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name == CONFIG_FILE or p.name.endswith(WEIGHT_SUFFIXES))
    return {"path": str(path), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _start_token(tokenizer) -> int:
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise UserError("the tokenizer has neither a BOS nor an EOS token to start the teacher's samples from; "
                        "give --data instead.")
    return start


def _write_atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename to ``path``: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with write_errors(path.parent):
        write(tmp)
        os.replace(tmp, path)


def _read_chunk(path: Path, rows: int, seq_len: int) -> dict[str, torch.Tensor] | None:
    """A cached chunk, or None when it is missing or not what this call would write (then it is sampled again)."""
    if not path.is_file():
        return None
    try:
        chunk = load_file(str(path))
    except (OSError, SafetensorError):
        return None
    shapes = {key: tuple(chunk[key].shape) for key in ("input_ids", "position_ids") if key in chunk}
    return chunk if set(shapes.values()) == {(rows, seq_len)} and len(shapes) == 2 else None


def cache_folder_for(cache_folder: Path, settings: dict) -> Path:
    """``cache_folder/KEY`` for these settings, made with its ``meta.json`` (what KEY stands for)."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_folder) / key
    with write_errors(folder):
        folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "meta.json").is_file():
        _write_atomic(folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(settings, indent=2) + "\n"))
    return folder


# ---------------------------------------------------------------------------------------------- rows


def generated_data(config, tokenizer, rows_needed: int, teacher, held_out=None, accelerator=None,
                   show_progress: bool = True):
    """A run's training and held-out rows when it has no ``data``: ``rows_needed`` rows of teacher-generated text,
    and ``held_out`` (the rows of ``eval_data``) or, without it, the first ``eval_sequences`` rows of the generated
    text (held out, as the first rows of real data are). The main process generates on the run's device; the others
    wait for it, then read the cache."""
    held = 0 if held_out is not None else config.eval_sequences
    main = accelerator is None or accelerator.is_main_process
    if accelerator is not None:
        teacher.to(accelerator.device)  # where it will distil too (RecoveryRun.setup_training)
    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        packed = generated_rows(
            teacher, tokenizer, rows=rows_needed + held, seq_len=config.seq_len, seed=config.seed,
            cache_folder=cache_dir() / "generated_text", temperature=config.generated_temperature,
            top_p=config.generated_top_p, show_progress=show_progress and main,
            teacher_path=model_path(config.teacher)[1])  # a hub id's downloaded folder
    if held == 0:
        return MemoryRows(packed, config.seed), held_out
    first_rows, train = packed.split(held)
    return MemoryRows(train, config.seed), first_rows


def generated_rows(teacher, tokenizer, *, rows: int, seq_len: int, seed: int, cache_folder: str | Path,
                   temperature: float = 1.0, top_p: float | None = None, batch_size: int = CHUNK_ROWS,
                   show_progress: bool = True, teacher_path: str | Path | None = None) -> PackedSequences:
    """``rows`` rows of ``seq_len`` tokens sampled from ``teacher`` (module docstring), the cached chunks read back
    and only the missing ones sampled. ``teacher_path``: where the teacher was loaded from (its folder or .gguf;
    default the model's ``name_or_path``), which names the cache entry."""
    source = teacher_path or getattr(teacher, "name_or_path", "")
    if not source or not Path(source).expanduser().exists():
        raise ValueError("generated_rows needs teacher_path: the teacher's folder or .gguf file names its cached text")
    start, vocab = _start_token(tokenizer), len(tokenizer)
    settings = {"teacher": teacher_identity(source), "dtype": str(next(teacher.parameters()).dtype),
                "seq_len": seq_len, "seed": seed, "temperature": temperature, "top_p": top_p, "vocab_size": vocab,
                "start_token": start, "chunk_rows": batch_size}
    folder = cache_folder_for(Path(cache_folder), settings)
    chunks, made, seconds = [], 0, 0.0
    progress = tqdm(total=rows, desc="generating text", unit="row", disable=not show_progress, dynamic_ncols=True)
    for k in range(-(-rows // batch_size)):
        path = folder / f"chunk-{k:05d}.safetensors"
        chunk = _read_chunk(path, batch_size, seq_len)
        if chunk is None:
            started = time.perf_counter()
            ids = sample_chunk(teacher, start, batch_size, seq_len, chunk_seed(seed, k), temperature, top_p, vocab)
            seconds += time.perf_counter() - started
            chunk = {"input_ids": ids, "position_ids": document_positions(ids, tokenizer.eos_token_id)}
            _write_atomic(path, lambda tmp, chunk=chunk: save_file(chunk, str(tmp)))
            made += 1
        chunks.append(chunk)
        progress.update(min(batch_size, rows - k * batch_size))
    progress.close()
    made_rows = made * batch_size
    log.info("generated text in %s: %d rows reused, %d rows generated (%.0f tokens/s)", folder,
             len(chunks) * batch_size - made_rows, made_rows, made_rows * (seq_len - 1) / seconds if seconds else 0.0)
    input_ids = torch.cat([chunk["input_ids"] for chunk in chunks])[:rows]
    position_ids = torch.cat([chunk["position_ids"] for chunk in chunks])[:rows]
    return PackedSequences(input_ids, position_ids, int((position_ids == 0).sum()), 0)
