"""Training text: read documents (mha2mla.io.documents, docs/recover.md), tokenize, pack them into fixed-length
rows that respect document boundaries.

A packed row holds several documents back to back (each followed by EOS). Positions restart at 0 at every
document start (and at the start of every row, where a long document continues), so

- rotary positions are those the document would have alone, and
- with ``attention_mask=None`` and no cache, transformers derives a block-diagonal causal mask from the
  position restarts (sdpa / eager / flash); a custom attention kernel can derive segment ids the same way
  (a new segment wherever ``position_ids[t] != position_ids[t-1] + 1``).

The first token of every segment is never a prediction target (it would be predicted from another document).

A long document may come in pieces (mha2mla.io.text_formats: a text file, cut every so many bytes): a piece that continues
its document is tokenized alone and packed as the document's continuation (``Continued``: no EOS before it, no
position restart), so the pieces pack as the whole document would, up to the tokens at the cuts.

``--data`` is streamed with these rules (stream.py); here are the tokenizing and packing themselves (of documents
read by mha2mla.io, which the callers open: nothing here reads a file), the held-out rows, and the training rows
kept in memory (``MemoryRows``: teacher-generated text).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mha2mla import UserError

log = logging.getLogger(__name__)


@dataclass
class PackedSequences:
    """``input_ids`` and ``position_ids``: (N, L) int64 rows of packed tokens."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    num_documents: int
    dropped_tokens: int  # the tail that did not fill a last row
    unread: bool = False  # max_rows filled before the documents ran out; the rest was not read

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "position_ids": self.position_ids[index]}

    def split(self, count: int) -> tuple[PackedSequences, PackedSequences]:
        """The first ``count`` rows and the rest."""
        head = PackedSequences(self.input_ids[:count], self.position_ids[:count], 0, 0)
        tail = PackedSequences(self.input_ids[count:], self.position_ids[count:], self.num_documents,
                               self.dropped_tokens, self.unread)
        return head, tail


class Continued(list):
    """Token ids that continue the document packed before them (a later piece of a long document): ``pack_token_lists``
    packs them as part of it; first in a pack, they start a document."""


# ---------------------------------------------------------------------------------------------- packing


def pack_token_lists(documents: Iterable[list[int]], seq_len: int, max_rows: int | None = None) -> PackedSequences:
    """Concatenate tokenized documents and cut them into rows of ``seq_len`` (the last partial row is dropped).

    Returns at most ``max_rows`` rows: documents are consumed in order and reading stops once the rows are filled
    (``unread`` says whether a document was left), so a large or streamed corpus is never read whole."""
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    doc_index: list[torch.Tensor] = []
    total = 0
    num_documents = 0
    length = 0  # tokens of the document packed last, so far
    unread = False
    documents = iter(documents)
    for tokens in documents:
        if not tokens:
            continue
        first = 0 if not isinstance(tokens, Continued) or num_documents == 0 else length
        num_documents += first == 0
        ids.append(torch.tensor(tokens, dtype=torch.int64))
        positions.append(torch.arange(first, first + len(tokens), dtype=torch.int64))
        doc_index.append(torch.full((len(tokens),), num_documents - 1, dtype=torch.int64))
        length = first + len(tokens)
        total += len(tokens)
        if max_rows is not None and total >= max_rows * seq_len:
            unread = next(documents, None) is not None
            break
    rows = total // seq_len if max_rows is None else min(total // seq_len, max_rows)
    if rows == 0:
        return PackedSequences(torch.empty(0, seq_len, dtype=torch.int64), torch.empty(0, seq_len, dtype=torch.int64), num_documents, total)
    used = rows * seq_len
    input_ids = torch.cat(ids)[:used].view(rows, seq_len)  # (N, L)
    position_ids = torch.cat(positions)[:used].view(rows, seq_len)  # (N, L)
    documents_of = torch.cat(doc_index)[:used].view(rows, seq_len)  # (N, L)
    # a document cut by a row boundary restarts its positions at the row start
    continues = documents_of == documents_of[:, :1]
    position_ids = torch.where(continues, position_ids - position_ids[:, :1], position_ids)
    return PackedSequences(input_ids, position_ids, num_documents, total - used, unread)


def piece_ids(tokenizer, pieces: list) -> list[list[int]]:
    """Token ids of each piece (mha2mla.io.text_formats.Piece: ``text``, ``first``, ``last``), the pieces encoded in one
    call: EOS after a document's last piece only; a piece that continues
    its document is ``Continued``."""
    if not pieces:
        return []
    encoded = tokenizer([piece.text for piece in pieces], add_special_tokens=False, verbose=False)["input_ids"]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [(list if piece.first else Continued)(ids + eos if piece.last else ids) for piece, ids in zip(pieces, encoded)]


def _check_one_row(packed: PackedSequences, what: str, sources: list[str], seq_len: int) -> None:
    """Text that cannot fill one packed row is a user error."""
    if len(packed) == 0:
        raise UserError(f"the {what} ({', '.join(sources)}) has {packed.dropped_tokens} tokens, fewer than one packed "
                        f"sequence of {seq_len}; give more text or a smaller --seq-len.")


def pack_pieces(tokenizer, pieces: Iterable, seq_len: int, max_rows: int | None, what: str,
                sources: list[str]) -> PackedSequences:
    """Tokenize and pack ``pieces`` (mha2mla.io.documents.iter_pieces, read from ``sources``) into at most ``max_rows``
    rows, one piece at a time: memory holds one piece and the rows. Text that cannot fill one row is a user error."""
    packed = pack_token_lists((piece_ids(tokenizer, [piece])[0] for piece in pieces), seq_len, max_rows)
    _check_one_row(packed, what, sources, seq_len)
    log.info("%s: %d documents packed into %d rows of %d tokens", what, packed.num_documents, len(packed), seq_len)
    return packed


def pack_held_out(pieces: Iterable[tuple[int, object]], tokenizer, seq_len: int, count: int, sources: list[str],
                  units: int) -> tuple[PackedSequences, tuple[int, object, int]]:
    """The first ``count`` rows packed from ``pieces`` ((unit index, piece) of ``units`` units, in their given order),
    and (unit index, locator, tokens of that piece to skip) where training starts: at the first document that gave
    the rows no token, or, where the rows end inside the text's last document (a single text file, say), at the
    token after them. Text that does not fill one row more than ``count`` is refused, naming the rows it fills."""
    need = count * seq_len
    read: list[tuple[int, object, list[int]]] = []
    total, boundary, used = 0, None, 0
    for index, piece in pieces:
        read.append((index, piece, piece_ids(tokenizer, [piece])[0]))
        total += len(read[-1][2])
        if boundary is None and total >= need:  # the piece the held-out rows end in, and its tokens they take
            boundary, used = len(read) - 1, len(read[-1][2]) - (total - need)
        if boundary is not None and total >= need + seq_len and len(read) > boundary + 1:
            break
    if total < need + seq_len:
        raise _too_short(total, seq_len, count, sources)
    packed = pack_token_lists([ids for _, _, ids in read[:boundary + 1]], seq_len, count)
    index, piece, _ = read[boundary]
    after = read[boundary + 1] if boundary + 1 < len(read) else None
    if after is not None and after[1].first:
        return packed, (after[0], after[1].locator, 0)
    if after is not None and index + 1 < units:  # the rows end inside a text file: training starts at the next
        return packed, (index + 1, None, 0)
    return packed, (index, piece.locator, used)


def _too_short(total: int, seq_len: int, count: int, sources: list[str]) -> UserError:
    """The refusal of training text of ``total`` tokens that cannot hold out ``count`` rows and train on one more,
    with the fixes that would make it fit."""
    rows = total // seq_len
    if rows == 0:
        return UserError(f"the training data ({', '.join(sources)}) has {total} tokens, fewer than one packed sequence "
                         f"of {seq_len}; give more text or a smaller --seq-len.")
    fixes = ["more text"]
    if total // (count + 1) >= 8:
        fixes.append(f"--seq-len {total // (count + 1)} or less")
    fixes.append(f"--eval-sequences {rows - 1} or less" if rows > 1 else "--eval-sequences 0 (no held-out perplexity)")
    return UserError(f"the training data ({', '.join(sources)}) fills only {rows} sequence{'s' * (rows != 1)} of "
                     f"{seq_len} tokens, not enough to hold out {count} for evaluation (--eval-sequences) and train on "
                     f"the rest; give {', '.join(fixes)}, or separate evaluation text with --eval-data.")


def target_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L-1) bool: which next-token targets ``input_ids[:, 1:]`` are trained on (not a segment start)."""
    return position_ids[:, 1:] != 0


class RowOrder:
    """The deterministic order in which in-memory training rows are visited: a fresh seeded permutation every epoch.

    ``rows(start, count)`` gives the row indices of global positions ``start .. start+count-1``."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows = num_rows
        self.seed = seed
        self._cache: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = {epoch: torch.randperm(self.num_rows, generator=generator)}
        return self._cache[epoch]

    def rows(self, start: int, count: int) -> torch.Tensor:
        out = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, self.num_rows)
            out.append(self._permutation(epoch)[offset])
        return torch.stack(out)


class MemoryRows:
    """Training rows held in memory (teacher-generated text), visited in a seeded permutation per epoch.

    The interface every source of training rows has (stream.py's ``StreamRows`` too): ``rows_at(starts, size)``
    gives rows ``[s, s+size)`` of the run's seeded order for each ``s`` in turn, concatenated; ``state_dict()`` is
    the small JSON-able state a checkpoint keeps, ``load_state_dict`` continues exactly there. Here a row is
    addressed by its position alone, so the state only names the rows and the seed, to refuse another run's."""

    def __init__(self, packed: PackedSequences, seed: int):
        self.packed = packed
        self.order = RowOrder(len(packed), seed)

    def rows_at(self, starts: list[int], size: int) -> dict[str, torch.Tensor]:
        """(len(starts) * size, L) ``input_ids`` and ``position_ids``."""
        return self.packed.rows(torch.cat([self.order.rows(start, size) for start in starts]))

    def state_dict(self) -> dict:
        return {"kind": "memory", "rows": len(self.packed), "seed": self.order.seed}

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise UserError(f"the checkpoint's data position ({state}) is not for these training rows "
                            f"({self.state_dict()}); resume with the settings and text the run started with.")
