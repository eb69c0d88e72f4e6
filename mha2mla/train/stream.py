"""Training rows streamed from ``--data`` (docs/recover.md, "Data"): read (mha2mla.io.documents), tokenized and packed
as the run consumes them, so memory does not grow with the corpus and a resumed run starts at its next row without
reading the corpus again.

The run's order of rows, fixed by the seed:

- the units (files, dataset ids) are visited in a seeded order, a new one each epoch; their documents are
  tokenized (EOS after each) and packed back to back across unit boundaries with data.py's rules (positions
  restart at every document start and at a row start), the last partial row of an epoch dropped;
- the packed rows come in blocks of ``SHUFFLE_BLOCK_TOKENS // seq_len`` rows, each block's rows in a seeded
  permutation of its own (epoch, block); rows are numbered on across epochs.

A block is rebuilt from a cursor: the epoch, the block, its first row, the unit (its place in the epoch's order),
the locator of the document the block starts in and how many of that document's tokens earlier blocks took. The
cursor of the block being read is the state a checkpoint keeps; resuming opens the unit at that locator (a byte
offset, a parquet row group, ...), so it reads one block, not the corpus.

Held-out rows, when they come from the training text, are the first ``eval_sequences`` rows packed in the units'
given order; every document that gave them a token lies before the training start and is never trained on."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain

import torch

from mha2mla import UserError
from mha2mla.io.documents import is_local, iter_documents, iter_located, units
from mha2mla.train.data import PackedSequences, pack_documents, pack_held_out, pack_token_lists, tokenized

log = logging.getLogger(__name__)

SHUFFLE_BLOCK_TOKENS = 1 << 20  # tokens per shuffled block: the rows kept in memory (two int64 copies, ~16 MiB)
TOKENIZE_DOCUMENTS = 256  # documents per tokenizer call (a fast tokenizer encodes a batch on all cores) ...
TOKENIZE_CHARACTERS = 1 << 22  # ... or fewer, once they hold this many characters (large text files)
STATE_VERSION = 1


@dataclass(frozen=True)
class Cursor:
    """Where a block starts (see the module docstring); ``locator`` None is the unit's training start."""

    epoch: int = 0
    block: int = 0
    first_row: int = 0
    unit: int = 0
    locator: object = None
    skip: int = 0


def _seeded(*parts) -> torch.Generator:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def fingerprint(unit_names: list[str]) -> str:
    """A short hash of the units' names and (local files) sizes: a checkpoint's position is refused on other text."""
    described = [f"{name}:{os.path.getsize(name) if is_local(name) else ''}" for name in unit_names]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]


class StreamRows:
    """The training rows of ``--data``: ``rows_at(starts, size)``, ``state_dict()``, ``load_state_dict(state)`` (the
    interface of data.MemoryRows). ``start`` is (unit index, locator) of the first training document in the units'
    given order: the units before it and the documents before the locator are held out."""

    def __init__(self, unit_names: list[str], tokenizer, seq_len: int, seed: int, text_field: str | None = None,
                 start: tuple[int, object] = (0, None)):
        self.unit_names, self.tokenizer, self.seq_len, self.seed = unit_names, tokenizer, seq_len, seed
        self.text_field, self.start = text_field, start
        self.block_rows = max(1, SHUFFLE_BLOCK_TOKENS // seq_len)
        self.fingerprint = fingerprint(unit_names)
        self._orders: dict[int, list[int]] = {}
        self._cursor = Cursor()  # of the block in self._block
        self._block: dict[str, torch.Tensor] | None = None
        self._live: tuple[Cursor, Iterator, tuple | None] | None = None  # (next block's cursor, documents, leftover)

    # ------------------------------------------------------------------------------------------ the interface

    def rows_at(self, starts: list[int], size: int) -> dict[str, torch.Tensor]:
        """(len(starts) * size, L) ``input_ids`` and ``position_ids``: rows [s, s+size) of the order for each s."""
        parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "position_ids": []}
        for start in starts:
            row = start
            while row < start + size:
                block = self._block_with(row)
                offset = row - self._cursor.first_row
                end = min(start + size - self._cursor.first_row, len(block["input_ids"]))
                for key in parts:
                    parts[key].append(block[key][offset:end])
                row = self._cursor.first_row + end
        return {key: torch.cat(values) for key, values in parts.items()}

    def state_dict(self) -> dict:
        """The cursor of the block being read, with what it is valid for (JSON-able, a few numbers)."""
        return {"kind": "stream", "version": STATE_VERSION, "seed": self.seed, "seq_len": self.seq_len,
                "block_rows": self.block_rows, "text": self.fingerprint, "cursor": asdict(self._cursor)}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved block: the next ``rows_at`` may ask for any row from the block's first on."""
        mine = {key: value for key, value in self.state_dict().items() if key != "cursor"}
        theirs = {key: value for key, value in state.items() if key != "cursor"}
        if mine != theirs or not isinstance(state.get("cursor"), dict):
            raise UserError(f"the checkpoint's data position ({theirs}) is not for this training text and these "
                            f"settings ({mine}); resume with the --data, --seq-len and --seed the run started with.")
        self._cursor, self._block, self._live = Cursor(**state["cursor"]), None, None

    # ------------------------------------------------------------------------------------------ blocks

    def _block_with(self, row: int) -> dict[str, torch.Tensor]:
        """The block holding global row ``row``, building the blocks up to it (rows are read forward only)."""
        if row < self._cursor.first_row:
            raise ValueError(f"row {row} lies before the block being read (from row {self._cursor.first_row})")
        if self._block is None:
            self._block = self._build(self._cursor)
        while row >= self._cursor.first_row + len(self._block["input_ids"]):
            self._cursor = self._live[0]
            self._block = self._build(self._cursor)
        return self._block

    def _build(self, cursor: Cursor) -> dict[str, torch.Tensor]:
        """The rows of the block at ``cursor`` in their seeded order; ``self._live`` keeps the reader and the next
        block's cursor. An epoch that ends without a whole row goes on with the next epoch."""
        documents, leftover = self._reader(cursor)
        need = self.block_rows * self.seq_len
        taken: list[list[int]] = []
        total, last = 0, None
        if leftover is not None:
            taken.append(leftover[2])
            total, last = len(leftover[2]), leftover
        while total < need:
            document = next(documents, None)
            if document is None:
                break
            taken.append(document[2])
            total += len(document[2])
            last = document
        packed = pack_token_lists(taken, self.seq_len, self.block_rows)
        if total < need:  # the epoch ended: its last partial row is dropped, the next epoch starts
            self._live = (Cursor(cursor.epoch + 1, 0, cursor.first_row + len(packed)), None, None)
            if len(packed) == 0:
                if cursor.block == 0:
                    raise UserError(f"the training data ({', '.join(self.unit_names)}) has {total} tokens to train "
                                    f"on, fewer than one packed sequence of {self.seq_len}; give more text "
                                    "or a smaller --seq-len.")
                return self._build(self._live[0])
        else:
            unit, locator, ids, skip = last
            used = len(ids) - (total - need)
            rest = (unit, locator, ids[used:], skip + used)
            following = Cursor(cursor.epoch, cursor.block + 1, cursor.first_row + len(packed), unit, locator, skip + used)
            self._live = (following, documents, rest)
        self._cursor = cursor
        order = torch.randperm(len(packed), generator=_seeded(self.seed, cursor.epoch, cursor.block))
        return {"input_ids": packed.input_ids[order], "position_ids": packed.position_ids[order]}

    # ------------------------------------------------------------------------------------------ documents

    def _order(self, epoch: int) -> list[int]:
        """The units an epoch reads (those past the held-out start), in the epoch's seeded order."""
        if epoch not in self._orders:
            training = range(self.start[0], len(self.unit_names))
            self._orders = {epoch: [training[i] for i in torch.randperm(len(training), generator=_seeded(
                self.seed, epoch, "units")).tolist()]}
        return self._orders[epoch]

    def _reader(self, cursor: Cursor) -> tuple[Iterator, tuple | None]:
        """The documents from ``cursor`` on and the leftover of the document a block was cut in: the live reader
        when it stands there, else one opened at the cursor (the start of a run, a resume)."""
        if self._live is not None and self._live[0] == cursor and self._live[1] is not None:
            return self._live[1], self._live[2]
        return self._documents(cursor), None

    def _documents(self, cursor: Cursor) -> Iterator[tuple[int, object, list[int], int]]:
        """(unit position, locator, token ids not yet taken, tokens already taken) of every document from the
        cursor to the epoch's end, tokenized a batch at a time."""
        order = self._order(cursor.epoch)
        skip = cursor.skip
        for position in range(cursor.unit, len(order)):
            unit = order[position]
            locator = cursor.locator if position == cursor.unit and cursor.locator is not None else (
                self.start[1] if unit == self.start[0] else None)
            batch: list[tuple[object, str]] = []
            characters = 0
            for located in iter_located(self.unit_names[unit], self.text_field, locator):
                batch.append(located)
                characters += len(located[1])
                if len(batch) == TOKENIZE_DOCUMENTS or characters >= TOKENIZE_CHARACTERS:
                    for where, ids in tokenized(self.tokenizer, batch):
                        yield position, where, ids[skip:] if skip else ids, skip
                        skip = 0
                    batch, characters = [], 0
            for where, ids in tokenized(self.tokenizer, batch):
                yield position, where, ids[skip:] if skip else ids, skip
                skip = 0


# ---------------------------------------------------------------------------------------------- a run's rows


def prepare_stream(config, tokenizer, rows_needed: int) -> tuple[StreamRows, PackedSequences | None]:
    """A run's streamed training rows of ``data`` and its held-out rows: ``eval_data``'s first ``eval_sequences``
    rows (all of them for 0), or the training text's first ``eval_sequences`` rows, or None. Everything is read
    first (mha2mla.io.documents), then packed (data.py); the first block is read now, so a corpus too short for one
    row, or a first file that cannot be read, is refused before the run starts."""
    names = [name for source in config.data for name in units(source)]
    evaluation = chain.from_iterable(iter_documents(source, config.text_field) for source in config.eval_data or [])
    located = ((index, where, text) for index, name in enumerate(names)
               for where, text in iter_located(name, config.text_field))
    held_out, start = None, (0, None)
    if config.eval_data:
        held_out = pack_documents(tokenizer, evaluation, config.seq_len, config.eval_sequences or None,
                                  "evaluation data", config.eval_data)
    elif config.eval_sequences:
        held_out, start = pack_held_out(located, tokenizer, config.seq_len, config.eval_sequences, names)
    rows = StreamRows(names, tokenizer, config.seq_len, config.seed, config.text_field, start)
    rows.rows_at([0], 1)
    log.info("training data: %d files or datasets streamed in a seeded order per epoch, rows shuffled in blocks of %d; "
             "the run reads %d rows", len(names), rows.block_rows, rows_needed)
    return rows, held_out
