"""The rows a recovery run trains and evaluates on, from whichever text it has (docs/recover.md, "Data" and "No
dataset"): ``--data`` streamed (stream.py); no ``--data``, the default healing text of general domains (healing.py),
streamed the same way; or, with ``default_data`` generated, the text the teacher writes (generated.py), held in
memory. ``prepare_rows`` is the one entry point: every source gives training rows with ``rows_at(starts, size)``,
``state_dict()`` and ``load_state_dict(state)`` (packing.MemoryRows, stream.StreamRows) and held-out rows
(packing.PackedSequences, or None)."""

from __future__ import annotations

from mha2mla.io.documents import iter_pieces, units
from mha2mla.train.data.generated import generated_data
from mha2mla.train.data.healing import default_data
from mha2mla.train.data.packing import PackedSequences, pack_pieces
from mha2mla.train.data.stream import prepare_stream


def prepare_rows(config, tokenizer, rows_needed: int, teacher=None, accelerator=None, show_progress: bool = True):
    """The training rows of a run (``rows_at(starts, size)``, ``state_dict()``, ``load_state_dict(state)``: see
    packing.MemoryRows) and its held-out rows (PackedSequences or None). The held-out text ``eval_data`` is read
    first, whatever the training text (``evaluation_rows``), so that it is refused before any text is generated.
    With no ``data`` and ``default_data`` generated, the training text is what the teacher writes (generated_data);
    else it is streamed (stream.prepare_stream) from ``data`` or, without it, from the default healing text of general
    domains (healing.default_data; docs/recover.md, "No dataset")."""
    given = evaluation_rows(config, tokenizer) if config.eval_data else None
    if not config.data and config.default_data == "generated":
        return generated_data(config, tokenizer, rows_needed, teacher, given, accelerator, show_progress)
    if not config.data:
        config = config.model_copy(update={"data": default_data(config)})
    return prepare_stream(config, tokenizer, rows_needed, given)


def evaluation_rows(config, tokenizer) -> PackedSequences:
    """The held-out rows of ``eval_data``: its first ``eval_sequences`` rows (all of them for 0), read a piece at a
    time, whatever the training text is."""
    pieces = (piece for source in config.eval_data for name in units(source)
              for piece in iter_pieces(name, config.text_field))
    return pack_pieces(tokenizer, pieces, config.seq_len, config.eval_sequences or None, "evaluation data",
                       config.eval_data)
