"""Training text: read documents (mha2mla.io.documents, docs/recover.md), tokenize, pack them into fixed-length
rows that respect document boundaries.

A packed row holds several documents back to back (each followed by EOS). Positions restart at 0 at every
document start (and at the start of every row, where a long document continues), so

- rotary positions are those the document would have alone, and
- with ``attention_mask=None`` and no cache, transformers derives a block-diagonal causal mask from the
  position restarts (sdpa / eager / flash); a custom attention kernel can derive segment ids the same way
  (a new segment wherever ``position_ids[t] != position_ids[t-1] + 1``).

The first token of every segment is never a prediction target (it would be predicted from another document).

``--data`` is streamed with these rules (stream.py); here are the packing itself, the held-out rows of
``--eval-data`` (``evaluation_rows``) and the training rows kept in memory (``MemoryRows``: teacher-generated text).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

import torch

from mha2mla import UserError
from mha2mla.io.documents import iter_documents

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


def build_packed(tokenizer, sources: list[str], seq_len: int, text_field: str | None = "text",
                 max_rows: int | None = None, what: str = "training data") -> PackedSequences:
    """Read (mha2mla.io.documents: files, folders, dataset ids), tokenize and pack ``sources``; a corpus that cannot
    fill one row is a user error. ``text_field`` None picks the first of text/content/document/body per record."""
    documents = chain.from_iterable(iter_documents(source, text_field) for source in sources)
    packed = pack_token_lists(tokenize_documents(tokenizer, documents), seq_len, max_rows)
    if len(packed) == 0:
        raise UserError(
            f"the {what} ({', '.join(sources)}) has {packed.dropped_tokens} tokens, fewer than one packed sequence "
            f"of {seq_len}; give more text or a smaller --seq-len."
        )
    log.info("%s: %d documents packed into %d rows of %d tokens", what, packed.num_documents, len(packed), seq_len)
    return packed


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


def evaluation_rows(config, tokenizer) -> PackedSequences:
    """The held-out rows of ``eval_data``: its first ``eval_sequences`` packed rows (all of them for 0)."""
    return build_packed(
        tokenizer, config.eval_data, config.seq_len, config.text_field, config.eval_sequences or None, "evaluation data"
    )
