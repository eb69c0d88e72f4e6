"""mha2mla.train.data.stream: --data streamed, packed as data.py packs, seeded, resumable at the exact next row, epochs
wrapping, held-out rows never trained on, bad input one sentence; data.MemoryRows behind the same interface."""

from __future__ import annotations

import json

import pytest
import torch
from common import CharTokenizer

from mha2mla import UserError
from mha2mla.io import documents as documents_module
from mha2mla.train import RecoverConfig
from mha2mla.train.data import stream as stream_module
from mha2mla.train.data.packing import MemoryRows, RowOrder, pack_token_lists
from mha2mla.train.data.rows import evaluation_rows
from mha2mla.train.data.stream import StreamRows, prepare_stream

SEQ_LEN = 8


def _text(index: int) -> str:
    """Document ``index``: its own character (so a token names its document), 3 to 19 characters long."""
    return chr(0x100 + index) * (3 + (index * 7) % 17)


def _jsonl(path, first, count):
    path.write_text("".join(json.dumps({"text": _text(i)}) + "\n" for i in range(first, first + count)))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(stream_module, "SHUFFLE_BLOCK_TOKENS", 5 * SEQ_LEN)  # blocks of 5 rows
    monkeypatch.setattr(stream_module, "TOKENIZE_DOCUMENTS", 3)
    monkeypatch.setattr(stream_module, "TOKENIZE_CHARACTERS", 40)  # or fewer documents, once they hold 40 characters


def _corpus(tmp_path, kind: str) -> list[str]:
    """The units of a corpus of ~40 documents as one jsonl file, a folder of text files, a parquet file of several
    row groups, or a folder mixing the formats."""
    if kind == "jsonl":
        _jsonl(tmp_path / "docs.jsonl", 0, 40)
        return documents_module.units(str(tmp_path / "docs.jsonl"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    if kind == "text":
        for i in range(30):
            (folder / f"{i:02d}.txt").write_text(_text(i))
    elif kind == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        pq.write_table(pa.table({"text": [_text(i) for i in range(40)]}), folder / "docs.parquet", row_group_size=6)
    else:
        _jsonl(folder / "a.jsonl", 0, 15)
        (folder / "sub").mkdir()
        _jsonl(folder / "sub" / "b.jsonl", 15, 15)
        for i in range(30, 36):
            (folder / f"{i}.txt").write_text(_text(i))
    return documents_module.units(str(folder))


def _stream(names, seed=0, start=(0, None)) -> StreamRows:
    return StreamRows(names, CharTokenizer(), SEQ_LEN, seed, None, start)


def _epoch_rows(names, epoch: int, start=(0, None)) -> list[list[int]]:
    """Reference: the epoch's documents packed by data.pack_token_lists, rows sorted (a block shuffles them)."""
    order = _stream(names, start=start)._order(epoch)
    texts = [text for unit in order for _, text in documents_module.iter_located(
        names[unit], None, start[1] if unit == start[0] else None)]
    packed = pack_token_lists([[ord(c) for c in text] + [0] for text in texts], SEQ_LEN)
    return sorted(packed.input_ids.tolist())


@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet", "folder"])
def test_rows_are_packed_as_data_py_packs_and_epochs_wrap(tmp_path, kind):
    names = _corpus(tmp_path, kind)
    per_epoch = len(_epoch_rows(names, 0))
    rows = _stream(names).rows_at([0], 3 * per_epoch)
    for epoch in range(3):
        ids = rows["input_ids"][epoch * per_epoch:(epoch + 1) * per_epoch]
        assert sorted(ids.tolist()) == _epoch_rows(names, epoch)
    # positions restart at every document start (EOS before it) and at every row start
    ids, positions = rows["input_ids"], rows["position_ids"]
    assert (positions[:, 0] == 0).all()
    assert torch.equal(positions[:, 1:] == 0, ids[:, :-1] == 0)
    if len(names) > 1:  # the units' order is drawn again each epoch
        assert len({tuple(_stream(names)._order(epoch)) for epoch in range(3)}) > 1


@pytest.mark.parametrize("kind", ["jsonl", "folder"])
def test_rows_are_seeded(tmp_path, kind):
    names = _corpus(tmp_path, kind)
    first = _stream(names, seed=3).rows_at([0, 20], 10)
    again = _stream(names, seed=3).rows_at([0, 20], 10)
    other = _stream(names, seed=4).rows_at([0, 20], 10)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["input_ids"], other["input_ids"])


@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet", "folder"])
def test_a_resumed_stream_reads_the_exact_next_row(tmp_path, kind, monkeypatch):
    names = _corpus(tmp_path, kind)
    total = 2 * len(_epoch_rows(names, 0)) + 7  # past the end of an epoch
    whole = _stream(names, seed=1).rows_at([0], total)
    for cut in (1, 5, 13, total - 9):
        before = _stream(names, seed=1)
        for start in range(0, cut, 2):  # the run reads in steps
            before.rows_at([start], min(2, cut - start))
        state = json.loads(json.dumps(before.state_dict()))  # as the checkpoint keeps it
        opened = []
        real = stream_module.iter_pieces

        def recording(unit, text_field=None, start=None, real=real, opened=opened):
            opened.append(start)
            return real(unit, text_field, start)

        monkeypatch.setattr(stream_module, "iter_pieces", recording)
        resumed = _stream(names, seed=1)
        resumed.load_state_dict(state)
        rest = resumed.rows_at([cut, cut + 3], 3)
        monkeypatch.setattr(stream_module, "iter_pieces", real)
        expected = torch.cat([whole["input_ids"][cut:cut + 3], whole["input_ids"][cut + 3:cut + 6]])
        assert torch.equal(rest["input_ids"], expected)
        assert torch.equal(rest["position_ids"], torch.cat([whole["position_ids"][cut:cut + 6]]))
        if state["cursor"]["locator"] is not None:  # opened where the block starts, not at the unit's beginning
            assert opened[0] == state["cursor"]["locator"]


def test_rows_are_read_forward_only_and_a_foreign_state_is_refused(tmp_path):
    names = _corpus(tmp_path, "jsonl")
    rows = _stream(names)
    rows.rows_at([12], 2)
    with pytest.raises(ValueError, match="before the block"):
        rows.rows_at([0], 1)
    with pytest.raises(UserError, match="not for this training text and these settings"):
        _stream(names, seed=2).load_state_dict(rows.state_dict())


def _config(names, **settings) -> RecoverConfig:
    return RecoverConfig.model_construct(**{"data": names, "seq_len": SEQ_LEN, "text_field": None, "seed": 0,
                                            "eval_sequences": 3, "eval_data": [], **settings})


@pytest.mark.parametrize("kind", ["jsonl", "folder"])
def test_held_out_rows_are_never_trained_on(tmp_path, kind):
    _corpus(tmp_path, kind)
    spec = str(tmp_path / ("docs.jsonl" if kind == "jsonl" else "corpus"))
    train, held_out = prepare_stream(_config([spec]), CharTokenizer(), rows_needed=50)
    assert held_out.input_ids.shape == (3, SEQ_LEN)
    held_tokens = set(held_out.input_ids.flatten().tolist()) - {0}
    trained = set(train.rows_at([0], 80)["input_ids"].flatten().tolist())  # several epochs
    assert held_tokens and not held_tokens & trained
    assert trained - {0}  # and the rest is trained on
    in_order = documents_module.iter_documents(spec)
    first_rows = pack_token_lists([[ord(c) for c in text] + [0] for text in in_order], SEQ_LEN, 3)
    assert torch.equal(held_out.input_ids, first_rows.input_ids)  # the first rows in the given (sorted) order


def test_eval_data_holds_out_another_text_and_training_starts_at_the_first_row(tmp_path):
    names = _corpus(tmp_path, "jsonl")
    (tmp_path / "eval.txt").write_text("e" * 100)
    config = _config(names, eval_data=[str(tmp_path / "eval.txt")])
    train, held_out = prepare_stream(config, CharTokenizer(), 10, evaluation_rows(config, CharTokenizer()))
    assert held_out.input_ids.unique().tolist() == [0, ord("e")] or held_out.input_ids.unique().tolist() == [ord("e")]
    assert train.state_dict()["cursor"]["first_row"] == 0 and train.start == (0, None, 0)


def test_bad_input_is_one_sentence(tmp_path):
    short = tmp_path / "short.jsonl"
    _jsonl(short, 0, 2)  # 3 + 10 characters: one row, none past three held-out rows
    with pytest.raises(UserError, match=r"fills only 1 sequence of 8 tokens, not enough to hold out 3 .*give more "
                       r"text, --eval-sequences 0 \(no held-out perplexity\), or separate evaluation text"):
        prepare_stream(_config([str(short)]), CharTokenizer(), 10)
    with pytest.raises(UserError, match=r"has 15 tokens to train on, fewer than one packed sequence of 64"):
        prepare_stream(_config([str(short)], eval_sequences=0, seq_len=64), CharTokenizer(), 10)
    with pytest.raises(UserError, match=r"short\.jsonl\) has 15 tokens, fewer than one packed sequence of 64"):
        prepare_stream(_config([str(short)], seq_len=64), CharTokenizer(), 10)
    broken = tmp_path / "broken.jsonl"
    _jsonl(broken, 0, 30)
    broken.write_text(broken.read_text() + '{"text": "cut\n')
    rows, _ = prepare_stream(_config([str(broken)], eval_sequences=0), CharTokenizer(), 10)
    with pytest.raises(UserError, match=r"broken\.jsonl:31 is not valid JSON") as info:
        rows.rows_at([0], 100)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="does not exist"):
        prepare_stream(_config([str(tmp_path / "missing.jsonl")]), CharTokenizer(), 10)


def test_memory_rows_follow_the_seeded_order_and_keep_their_state():
    packed = pack_token_lists([list(range(1, 60))], seq_len=4)
    rows = MemoryRows(packed, seed=3)
    order = RowOrder(len(packed), seed=3)
    got = rows.rows_at([2, 20], 3)
    assert torch.equal(got["input_ids"], packed.input_ids[torch.cat([order.rows(2, 3), order.rows(20, 3)])])
    MemoryRows(packed, seed=3).load_state_dict(json.loads(json.dumps(rows.state_dict())))
    with pytest.raises(UserError, match="not for these training rows"):
        MemoryRows(packed, seed=4).load_state_dict(rows.state_dict())

