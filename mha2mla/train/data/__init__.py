"""The rows a recovery run trains and evaluates on: ``prepare_rows`` (rows.py) turns ``--data`` (stream.py), the
default healing text (healing.py) or teacher-generated text (generated.py) into training and held-out rows, packed
as packing.py packs documents."""

from mha2mla.train.data.packing import PackedSequences, pack_token_lists, target_mask
from mha2mla.train.data.rows import prepare_rows

__all__ = ["PackedSequences", "pack_token_lists", "prepare_rows", "target_mask"]
