"""Training rows streamed from ``--data`` (docs/recover.md, "Data"): read (mha2mla.io.documents: records, and text files
in pieces of bounded size), tokenized and packed as the run consumes them, so memory does not grow with the corpus
and a resumed run starts at its next row without reading the corpus again.

The run's order of rows, fixed by the seed:

- the units (files, dataset ids) are visited in a seeded order, a new one each epoch; their documents are
  tokenized (EOS after each) and packed back to back across unit boundaries with packing.py's rules (positions
  restart at every document start and at a row start), the last partial row of an epoch dropped;
- the packed rows come in blocks of ``SHUFFLE_BLOCK_TOKENS // seq_len`` rows, each block's rows in a seeded
  permutation of its own (epoch, block); rows are numbered on across epochs.

A block is rebuilt from a cursor: the epoch, the block, its first row, the unit (its place in the epoch's order),
the locator of the piece the block starts in and how many of that piece's tokens earlier blocks took. The
cursor of the block being read is the state a checkpoint keeps; resuming opens the unit at that locator (a byte
offset, a parquet row group, ...), so it reads one block, not the corpus.

Held-out rows, when they come from the training text, are the first ``eval_sequences`` rows packed in the units'
given order (packing.pack_held_out); training starts at the first document that gave them no token, so a document they
come from is never trained on, except where they end inside the text's last document (one text file, say): that
one is split, and training starts at the token after them."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain

import torch

from mha2mla import UserError
from mha2mla.io import text_formats
from mha2mla.io.documents import PLAIN_SUFFIXES, is_local, iter_pieces, resolve_files, units
from mha2mla.train.data.packing import PackedSequences, pack_held_out, pack_token_lists, piece_ids

log = logging.getLogger(__name__)

SHUFFLE_BLOCK_TOKENS = 1 << 20  # tokens per shuffled block: the rows kept in memory
TOKENIZE_DOCUMENTS = 256  # pieces per tokenizer call (a fast tokenizer encodes a batch on all cores) ...
TOKENIZE_CHARACTERS = 1 << 18  # ... or fewer, once they hold this many characters: the encodings' memory
# bytes per token of a block being built: its token lists (a Python int each), the packing's tensors (ids, positions,
# documents, their concatenations), the packed rows and their shuffled copy
BLOCK_BYTES_PER_TOKEN = 110
# bytes per character of one tokenizer call's encodings (ids, offsets, masks, the Python lists), at most a token each
ENCODING_BYTES_PER_CHARACTER = 120


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
    """A short hash of the units' names and (local files) sizes, and the piece size of text files (their locators are
    piece starts): a checkpoint's position is refused on other text."""
    described = [f"{name}:{os.path.getsize(name) if is_local(name) else ''}{_piece_size(name)}" for name in unit_names]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]


def _piece_size(name: str) -> str:
    return f":{text_formats.PIECE_BYTES}" if is_local(name) and os.path.splitext(name)[1].lower() in PLAIN_SUFFIXES else ""


def peak_bytes(sources: list[str] | None, seq_len: int) -> int:
    """What streaming ``sources`` (None: the default healing text) holds at its peak (``--dry-run``'s data line): a
    block being built and one tokenizer call's encodings, each no larger than the local files allow (a token takes
    a byte at least, EOS aside); a path that cannot be read counts as large."""
    block = max(1, SHUFFLE_BLOCK_TOKENS // seq_len) * seq_len
    call = TOKENIZE_CHARACTERS + text_formats.PIECE_BYTES  # a call takes pieces until it holds this many characters
    try:
        sizes = [os.path.getsize(path) for source in sources or [] for path in resolve_files(source)]
    except (UserError, OSError):
        sizes = []
    if sizes:
        block, call = min(block, sum(sizes) + len(sizes)), min(call, max(sizes))
    return block * BLOCK_BYTES_PER_TOKEN + call * ENCODING_BYTES_PER_CHARACTER


class StreamRows:
    """The training rows of ``--data``: ``rows_at(starts, size)``, ``state_dict()``, ``load_state_dict(state)`` (the
    interface of packing.MemoryRows). ``start`` is (unit index, locator, tokens to skip) of the first training piece in
    the units' given order (packing.pack_held_out): the units before it, the pieces before the locator and that piece's
    first tokens are held out."""

    def __init__(self, unit_names: list[str], tokenizer, seq_len: int, seed: int, text_field: str | None = None,
                 start: tuple = (0, None, 0)):
        self.unit_names, self.tokenizer, self.seq_len, self.seed = unit_names, tokenizer, seq_len, seed
        self.text_field, self.start = text_field, (*start, 0)[:3]
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
        return {"kind": "stream", "seed": self.seed, "seq_len": self.seq_len,
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
            self._cursor, self._block = self._live[0], None  # the block read is freed before the next is built
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
                    held = " after the rows held out for evaluation" if self.start != (0, None, 0) else ""
                    raise UserError(f"the training data ({', '.join(self.unit_names)}) has {total} tokens to train "
                                    f"on{held}, fewer than one packed sequence of {self.seq_len}; give more text or a "
                                    f"smaller --seq-len{', or fewer --eval-sequences or --eval-data' if held else ''}.")
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
        """(unit position, locator, token ids not yet taken, tokens already taken) of every piece from the cursor to
        the epoch's end."""
        order = self._order(cursor.epoch)
        for position in range(cursor.unit, len(order)):
            unit = order[position]
            if position == cursor.unit and cursor.locator is not None:
                yield from self._unit_documents(position, unit, cursor.locator, cursor.skip)
            elif unit == self.start[0]:
                yield from self._unit_documents(position, unit, self.start[1], self.start[2])
            else:
                yield from self._unit_documents(position, unit, None, 0)

    def _unit_documents(self, position: int, unit: int, locator: object, skip: int):
        """``_documents`` of one unit opened at ``locator``, its first ``skip`` tokens left out, tokenized a batch of
        pieces at a time; the first tokens read start a document (what came before them is not in this block)."""
        batch: list = []
        characters, opened = 0, True
        for piece in chain(iter_pieces(self.unit_names[unit], self.text_field, locator), [None]):
            if piece is not None:
                batch.append(piece)
                characters += len(piece.text)
            if batch and (piece is None or len(batch) == TOKENIZE_DOCUMENTS or characters >= TOKENIZE_CHARACTERS):
                for each, ids in zip(batch, piece_ids(self.tokenizer, batch)):
                    ids = ids[skip:] if skip or (opened and ids) else ids  # a slice is a list: no continuation
                    opened = opened and not ids
                    yield position, each.locator, ids, skip
                    skip = 0
                batch, characters = [], 0


# ---------------------------------------------------------------------------------------------- a run's rows


def prepare_stream(config, tokenizer, rows_needed: int, held_out: PackedSequences | None = None
                   ) -> tuple[StreamRows, PackedSequences | None]:
    """A run's streamed training rows of ``data`` and its held-out rows: ``held_out`` when given (the rows of
    ``eval_data``: rows.evaluation_rows), else the training text's first ``eval_sequences`` rows (packing.pack_held_out),
    or None. Both are read a piece at a time (documents.iter_pieces); the first block is read now, so a corpus too short
    for one row, or a first file that cannot be read, is refused before the run starts."""
    names = [name for source in config.data for name in units(source)]
    located = ((index, piece) for index, name in enumerate(names) for piece in iter_pieces(name, config.text_field))
    start = (0, None, 0)
    if held_out is None and config.eval_sequences:
        held_out, start = pack_held_out(located, tokenizer, config.seq_len, config.eval_sequences, names, len(names))
    rows = StreamRows(names, tokenizer, config.seq_len, config.seed, config.text_field, start)
    rows.rows_at([0], 1)
    log.info("training data: %d files or datasets streamed in a seeded order per epoch, rows shuffled in blocks of %d; "
             "the run reads %d rows", len(names), rows.block_rows, rows_needed)
    return rows, held_out
