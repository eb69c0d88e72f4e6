"""Training text: read documents (mha2mla.io.documents, docs/recover.md), tokenize, pack them into fixed-length
rows that respect document boundaries.

A packed row holds several documents back to back (each followed by EOS). Positions restart at 0 at every
document start (and at the start of every row, where a long document continues), so

- rotary positions are those the document would have alone, and
- with ``attention_mask=None`` and no cache, transformers derives a block-diagonal causal mask from the
  position restarts (sdpa / eager / flash); a custom attention kernel can derive segment ids the same way
  (a new segment wherever ``position_ids[t] != position_ids[t-1] + 1``).

The first token of every segment is never a prediction target (it would be predicted from another document).

``--data`` is streamed with these rules (stream.py); here are the tokenizing and packing themselves (of documents
read by mha2mla.io.documents, which the callers open: nothing here reads a file), the held-out rows, and the
training rows kept in memory (``MemoryRows``: teacher-generated text).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
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
    unread = False
    documents = iter(documents)
    for tokens in documents:
        if not tokens:
            continue
        tokens_tensor = torch.tensor(tokens, dtype=torch.int64)
        ids.append(tokens_tensor)
        positions.append(torch.arange(len(tokens), dtype=torch.int64))
        doc_index.append(torch.full((len(tokens),), num_documents, dtype=torch.int64))
        num_documents += 1
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


def tokenize_documents(tokenizer, documents: Iterable[str]) -> Iterator[list[int]]:
    """Token ids of each document followed by EOS (no BOS or other special tokens)."""
    eos = tokenizer.eos_token_id
    for text in documents:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if eos is not None:
            ids = ids + [eos]
        yield ids


def tokenized(tokenizer, batch: list[tuple[object, str]]) -> list[tuple[object, list[int]]]:
    """(locator, token ids followed by EOS) of each (locator, document), the documents encoded in one call: as
    ``tokenize_documents``, no BOS or other special tokens."""
    if not batch:
        return []
    encoded = tokenizer([text for _, text in batch], add_special_tokens=False, verbose=False)["input_ids"]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [(where, ids + eos) for (where, _), ids in zip(batch, encoded)]


def _check_one_row(packed: PackedSequences, what: str, sources: list[str], seq_len: int) -> None:
    """Text that cannot fill one packed row is a user error."""
    if len(packed) == 0:
        raise UserError(f"the {what} ({', '.join(sources)}) has {packed.dropped_tokens} tokens, fewer than one packed "
                        f"sequence of {seq_len}; give more text or a smaller --seq-len.")


def pack_documents(tokenizer, documents: Iterable[str], seq_len: int, max_rows: int | None, what: str,
                   sources: list[str]) -> PackedSequences:
    """Tokenize and pack ``documents`` (read from ``sources``) into at most ``max_rows`` rows; text that cannot fill
    one row is a user error."""
    packed = pack_token_lists(tokenize_documents(tokenizer, documents), seq_len, max_rows)
    _check_one_row(packed, what, sources, seq_len)
    log.info("%s: %d documents packed into %d rows of %d tokens", what, packed.num_documents, len(packed), seq_len)
    return packed


def pack_held_out(located: Iterable[tuple[int, object, str]], tokenizer, seq_len: int, count: int,
                  sources: list[str]) -> tuple[PackedSequences, tuple[int, object]]:
    """The first ``count`` rows packed from ``located`` documents (unit index, locator, text), and (unit index,
    locator) of the first document that gave them no token: where training starts."""
    last: list[tuple[int, object]] = []

    def documents():
        for index, where, text in located:
            last[:] = [(index, where)]
            yield tokenized(tokenizer, [(where, text)])[0][1]

    packed = pack_token_lists(documents(), seq_len, count)
    _check_one_row(packed, "training data", sources, seq_len)
    if len(packed) < count or not packed.unread:  # pack_token_lists looked at one document past the rows
        raise UserError(
            f"the training data fills only {len(packed)} sequences of {seq_len} tokens, not enough to hold out "
            f"{count} for evaluation and train on the rest; give more text, --eval-data, or a smaller --eval-sequences."
        )
    return packed, last[0]


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
