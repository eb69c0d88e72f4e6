"""A text file as training data (mha2mla.io.text_formats, mha2mla.train.data.stream, data.pack_held_out): read in pieces of
bounded size, cut at whitespace, that pack as the whole document; a single file split between held-out and training
rows, so `recover --data one.txt` trains with the defaults; a text too short refused in one sentence naming the rows
it fills and the fixes; peak memory that does not grow with the file."""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import SAMPLE_TEXT, CharTokenizer, run_cli, snapshot

from mha2mla import UserError
from mha2mla.io import text_formats as pieces_module
from mha2mla.io.documents import iter_pieces
from mha2mla.train import RecoverConfig
from mha2mla.train.data import stream as stream_module
from mha2mla.train.data.packing import pack_token_lists
from mha2mla.train.data.stream import StreamRows, prepare_stream

SEQ_LEN = 8


def _words(count: int, first: int = 0) -> str:
    """``count`` distinct two-byte characters, a space after every fifth and a line end after every 23rd: each token
    but the whitespace names its place in the text."""
    return "".join(chr(0x100 + i) + (" " if i % 5 == 4 else "") + ("\n" if i % 23 == 22 else "")
                   for i in range(first, first + count))


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces_module, "PIECE_BYTES", 32)
    monkeypatch.setattr(stream_module, "SHUFFLE_BLOCK_TOKENS", 5 * SEQ_LEN)  # blocks of 5 rows
    monkeypatch.setattr(stream_module, "TOKENIZE_CHARACTERS", 40)


TEXTS = {
    "words and lines": _words(300),
    "one line": _words(300).replace("\n", " "),
    "no whitespace": "ünïcödé字" * 60,
    "whitespace runs": "a" + " " * 100 + "b\n\n\n" + "\t" * 70 + "c" * 90,
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_pieces_are_the_text_cut_at_whitespace_and_resume_at_any_locator(tmp_path, small_pieces, name):
    text = TEXTS[name]
    path = tmp_path / "doc.txt"
    path.write_bytes(codecs.BOM_UTF8 + text.encode())
    read = list(iter_pieces(str(path)))
    assert "".join(piece.text for piece in read) == text  # the byte-order mark dropped
    assert len(read) > 4 and all(len(piece.text.encode()) <= 32 for piece in read)
    assert [(piece.first, piece.last) for piece in read] == [(True, False)] + [(False, False)] * (len(read) - 2) + [
        (False, True)]
    if name in ("words and lines", "one line"):  # cut before a space or line end between two words
        assert all(not a.text[-1].isspace() and b.text[0] in " \n" for a, b in zip(read, read[1:]))
    for index, piece in enumerate(read):
        assert list(iter_pieces(str(path), None, json.loads(json.dumps(piece.locator)))) == read[index:]


def test_a_short_text_is_one_piece_and_a_blank_one_is_empty(tmp_path, small_pieces):
    (tmp_path / "short.txt").write_text("one document")
    assert [tuple(piece) for piece in iter_pieces(str(tmp_path / "short.txt"))] == [(0, "one document", True, True)]
    (tmp_path / "blank.txt").write_text(" \n\t " * 20)  # several pieces, all blank
    with pytest.raises(UserError, match=r"blank\.txt is empty"):
        list(iter_pieces(str(tmp_path / "blank.txt")))
    (tmp_path / "bad.txt").write_bytes(b"word " * 20 + b"\xff")
    with pytest.raises(UserError, match=r"bad\.txt is not UTF-8 text \(bad byte at offset 100\)"):
        list(iter_pieces(str(tmp_path / "bad.txt")))


def _reference(texts: list[str]) -> list[list[int]]:
    """The rows of ``texts`` packed whole, one document each, sorted (a block shuffles them)."""
    return sorted(pack_token_lists([[ord(c) for c in text] + [0] for text in texts], SEQ_LEN).input_ids.tolist())


def test_text_files_in_pieces_pack_as_whole_documents_and_resume_at_the_exact_row(tmp_path, small_pieces):
    texts = [_words(200), _words(150, 200)]
    names = []
    for index, text in enumerate(texts):
        names.append(str(tmp_path / f"{index}.txt"))
        Path(names[-1]).write_text(text)
    order = StreamRows(names, CharTokenizer(), SEQ_LEN, 0)._order(0)
    per_epoch = len(_reference(texts))
    whole = StreamRows(names, CharTokenizer(), SEQ_LEN, 0).rows_at([0], per_epoch + 9)
    ids, positions = whole["input_ids"], whole["position_ids"]
    assert sorted(ids[:per_epoch].tolist()) == _reference([texts[unit] for unit in order])
    # positions restart at each row and document start only: a piece boundary inside a row is no restart
    assert (positions[:, 0] == 0).all() and torch.equal(positions[:, 1:] == 0, ids[:, :-1] == 0)
    for cut in (3, 11, per_epoch - 2):
        before = StreamRows(names, CharTokenizer(), SEQ_LEN, 0)
        before.rows_at([0], cut)
        state = json.loads(json.dumps(before.state_dict()))
        resumed = StreamRows(names, CharTokenizer(), SEQ_LEN, 0)
        resumed.load_state_dict(state)
        rest = resumed.rows_at([cut], 9)
        assert torch.equal(rest["input_ids"], ids[cut:cut + 9]) and torch.equal(rest["position_ids"], positions[cut:cut + 9])


def _config(data: list[str], **settings) -> RecoverConfig:
    return RecoverConfig.model_construct(**{"data": data, "seq_len": SEQ_LEN, "text_field": None, "seed": 0,
                                            "eval_sequences": 3, "eval_data": [], **settings})


@pytest.mark.parametrize("name", ["one.txt", "one.jsonl"])
def test_one_document_is_split_between_held_out_and_training_rows(tmp_path, small_pieces, name):
    text = _words(300)
    path = tmp_path / name
    path.write_text(text if name.endswith(".txt") else json.dumps({"text": text}) + "\n")
    train, held_out = prepare_stream(_config([str(path)]), CharTokenizer(), 10)
    tokens = [ord(c) for c in text] + [0]
    assert held_out.input_ids.tolist() == [tokens[i:i + SEQ_LEN] for i in range(0, 3 * SEQ_LEN, SEQ_LEN)]
    rows = (len(tokens) - 3 * SEQ_LEN) // SEQ_LEN
    trained = train.rows_at([0], 3 * rows)["input_ids"]  # three epochs
    assert sorted(trained[:rows].tolist()) == sorted(
        tokens[i:i + SEQ_LEN] for i in range(3 * SEQ_LEN, 3 * SEQ_LEN + rows * SEQ_LEN, SEQ_LEN))
    assert not set(held_out.input_ids.flatten().tolist()) - {ord(" "), ord("\n")} & set(trained.flatten().tolist())
    before = StreamRows([str(path)], CharTokenizer(), SEQ_LEN, 0, None, train.start)  # a resume from there
    before.rows_at([0], 7)
    resumed = StreamRows([str(path)], CharTokenizer(), SEQ_LEN, 0, None, train.start)
    resumed.load_state_dict(json.loads(json.dumps(before.state_dict())))
    assert torch.equal(resumed.rows_at([7], 2 * rows)["input_ids"], trained[7:7 + 2 * rows])


def test_held_out_rows_ending_inside_a_text_file_before_the_last_leave_its_rest_out(tmp_path, small_pieces):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(_words(100))
    (tmp_path / "corpus" / "b.txt").write_text(_words(100, 100))
    train, held_out = prepare_stream(_config([str(tmp_path / "corpus")]), CharTokenizer(), 10)
    assert train.start == (1, None, 0)  # whole documents are held out where another follows
    trained = set(train.rows_at([0], 30)["input_ids"].flatten().tolist()) - {0, ord(" "), ord("\n")}
    assert trained <= {ord(c) for c in _words(100, 100)} and len(trained) > 90  # b.txt's rows only


def test_text_that_cannot_hold_out_and_train_names_the_rows_it_fills(tmp_path, small_pieces):
    (tmp_path / "short.txt").write_text(_words(35))  # 35 + 7 spaces + 1 line end + EOS: 44 tokens, 5 rows of 8
    with pytest.raises(UserError, match=r"short\.txt\) fills only 5 sequences of 8 tokens, not enough to hold out 5 "
                       r"for evaluation \(--eval-sequences\) and train on the rest; give more text, --eval-sequences 4 or "
                       r"less, or separate evaluation text with --eval-data\.$"):  # no --seq-len: 8 is the least
        prepare_stream(_config([str(tmp_path / "short.txt")], eval_sequences=5), CharTokenizer(), 10)
    train, held_out = prepare_stream(_config([str(tmp_path / "short.txt")], eval_sequences=4), CharTokenizer(), 10)
    assert len(held_out) == 4 and len(train.rows_at([0], 3)["input_ids"]) == 3  # the one row left, every epoch


# ---- the command


def test_recover_trains_on_a_single_text_file_with_the_defaults(tiny_mla, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text((SAMPLE_TEXT * 40)[:60000])  # one document: 8 rows of 512 held out, the rest trained on
    out = tmp_path / "out"
    code, _, err = run_cli(["recover", tiny_mla, "--data", notes, "--out", out, "--max-steps", "1", "--no-progress"],
                           capsys)
    assert code == 0, err
    report = json.loads((out / "recovery_report.json").read_text())
    assert report["steps"] == 1 and len(report["evaluations"]) == 2  # held-out perplexity before and after
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_recover_refuses_a_text_too_short_to_hold_out_rows(tiny_mla, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text(SAMPLE_TEXT * 2)  # 3,030 tokens: 5 rows of 512
    before = snapshot(tmp_path)
    code, _, err = run_cli(["recover", tiny_mla, "--data", notes, "--out", tmp_path / "out", "--max-steps", "1",
                            "--no-progress"], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and "Traceback" not in err and len(lines) == 1, err
    assert "notes.txt) fills only 5 sequences of 512 tokens, not enough to hold out 8 for evaluation" in lines[0], lines
    assert lines[0].endswith("give more text, --seq-len 336 or less, --eval-sequences 4 or less, or separate evaluation "
                             "text with --eval-data."), lines
    assert snapshot(tmp_path) == before


# ---- memory


def _peak_rss_kib(args: list[str], cwd: Path) -> int:
    """The peak resident set of ``mha2mla ARGS`` run in a fresh process (its own parent process reports it)."""
    measure = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
               "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "mha2mla.cli.main", *args], cwd=cwd,
                            capture_output=True, text=True, check=False, timeout=600)
    code, peak = result.stdout.split()
    assert code == "0", result.stderr[-3000:]
    return int(peak)


def _write_text(path: Path, size: int, one_line: bool) -> Path:
    unit = SAMPLE_TEXT.replace("\n", " ") if one_line else SAMPLE_TEXT
    with path.open("w") as handle:
        for _ in range(-(-size // len(unit))):
            handle.write(unit)
    return path


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_text_file(tiny_mla, tmp_path):
    peaks = {}
    for name, size, one_line in (("small", 1 << 20, False), ("lines", 50 << 20, False), ("one-line", 50 << 20, True)):
        text = _write_text(tmp_path / f"{name}.txt", size, one_line)
        peaks[name] = _peak_rss_kib(["recover", str(tiny_mla), "--data", str(text), "--out", str(tmp_path / name),
                                     "--max-steps", "2", "--no-progress"], tmp_path)
    print("peak resident set, KiB:", peaks)  # shown with -s
    assert all(abs(peaks[name] - peaks["small"]) <= 0.2 * peaks["small"] for name in ("lines", "one-line")), peaks
