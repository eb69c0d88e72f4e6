"""The rows a recovery run trains and evaluates on, from whichever text it has (docs/recover.md, "Data" and "No
dataset"): ``--data`` streamed (stream.py); no ``--data``, the default healing text of general domains (healing.py),
streamed the same way; or, with ``default_data`` generated, the text the teacher writes (generated.py), held in
memory. ``prepare_rows`` is the one entry point: every source gives training rows with ``rows_at(starts, size)``,
``state_dict()`` and ``load_state_dict(state)`` (packing.MemoryRows, stream.StreamRows) and held-out rows
(packing.PackedSequences, or None)."""

from __future__ import annotations

import contextlib
from itertools import chain

from mha2mla.io.cache import cache_dir
from mha2mla.io.documents import iter_documents
from mha2mla.train.data.generated import generated_rows
from mha2mla.train.data.healing import default_data
from mha2mla.train.data.packing import MemoryRows, pack_documents
from mha2mla.train.data.stream import prepare_stream


def prepare_rows(config, tokenizer, rows_needed: int, teacher=None, accelerator=None, show_progress: bool = True):
    """The training rows of a run (``rows_at(starts, size)``, ``state_dict()``, ``load_state_dict(state)``: see
    packing.MemoryRows) and its held-out rows (PackedSequences or None): with no ``data`` and ``default_data``
    generated, text the teacher writes (generated_data); else streamed (stream.prepare_stream) from ``data`` or, without it, from the
    default healing text of general domains (healing.default_data; docs/recover.md, "No dataset")."""
    if not config.data and config.default_data == "generated":
        return generated_data(config, tokenizer, rows_needed, teacher, accelerator, show_progress)
    if not config.data:
        config = config.model_copy(update={"data": default_data(config)})
    return prepare_stream(config, tokenizer, rows_needed)


def generated_data(config, tokenizer, rows_needed: int, teacher, accelerator=None, show_progress: bool = True):
    """A run's training and held-out rows when it has no ``data``: ``rows_needed`` rows of teacher-generated text,
    and the held-out rows of ``eval_data``, or else the first ``eval_sequences`` rows of the generated text (held
    out, as the first rows of real data are). The main process generates on the run's device; the others wait
    for it, then read the cache."""
    held = 0 if config.eval_data else config.eval_sequences
    main = accelerator is None or accelerator.is_main_process
    if accelerator is not None:
        teacher.to(accelerator.device)  # where it will distil too (RecoveryRun.setup_training)
    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        packed = generated_rows(
            teacher, tokenizer, rows=rows_needed + held, seq_len=config.seq_len, seed=config.seed,
            cache_folder=cache_dir() / "generated_text", temperature=config.generated_temperature,
            top_p=config.generated_top_p, show_progress=show_progress and main, teacher_path=config.teacher)
    evaluation = chain.from_iterable(iter_documents(source, config.text_field) for source in config.eval_data or [])
    if config.eval_data:
        return MemoryRows(packed, config.seed), pack_documents(
            tokenizer, evaluation, config.seq_len, config.eval_sequences or None, "evaluation data", config.eval_data)
    if held == 0:
        return MemoryRows(packed, config.seed), None
    held_out, train = packed.split(held)
    return MemoryRows(train, config.seed), held_out
