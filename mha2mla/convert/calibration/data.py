"""The calibration tokens: N windows of L tokens, evenly spaced through some text (docs/calibration.md).

The text is ``default`` — the bundled public-domain sample (``mha2mla/data/calibration_sample.txt``:
The Devil's Dictionary, part of the Jargon File and seven CPython standard-library modules; see
calibration_sample_licence.txt) — or anything the project's one document reader takes
(``mha2mla.io.documents``: a .txt/.jsonl/.parquet file, a folder of them, a dataset id).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.io.documents import iter_documents

log = logging.getLogger(__name__)


def bundled_sample_path() -> Path:
    return Path(str(resources.files("mha2mla.data").joinpath("calibration_sample.txt")))


def calibration_documents(spec: str) -> Iterable[str]:
    """The documents of a calibration source: ``default`` or a spec for ``iter_documents``."""
    if spec in ("", "default"):
        return [bundled_sample_path().read_text(encoding="utf-8")]
    return iter_documents(spec)


def calibration_token_ids(documents: Iterable[str], tokenizer, num_samples: int, seq_len: int) -> torch.Tensor:
    """``(num_samples, seq_len)`` token ids: windows evenly spaced through the concatenated documents."""
    separator = tokenizer.eos_token or "\n\n"
    ids: list[int] = []
    for text in documents:
        ids.extend(tokenizer(text + separator, add_special_tokens=False)["input_ids"])
        if len(ids) >= num_samples * seq_len * 4:  # enough for well-spread windows
            break
    if len(ids) < seq_len:
        raise UserError(f"the calibration text has {len(ids)} tokens, fewer than one sequence of {seq_len}; give more text.")
    if len(ids) < num_samples * seq_len:
        log.warning("calibration text has %d tokens: the %d sequences of %d tokens overlap.", len(ids), num_samples, seq_len)
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).round().long()
    tokens = torch.tensor(ids, dtype=torch.long)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])  # (N, L)
