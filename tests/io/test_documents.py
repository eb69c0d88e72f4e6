"""mha2mla.io.documents: every format, folders, the text-field rule, dataset ids and each user error."""

from __future__ import annotations

import json
import random
import sys

import pytest

from mha2mla import UserError
from mha2mla.io.documents import TEXT_SUFFIXES, iter_documents, iter_located, parse_dataset_id


def _read(spec, text_field=None) -> list[str]:
    return list(iter_documents(str(spec), text_field))


def _jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_text_suffixes_are_every_readable_format():
    assert set(TEXT_SUFFIXES) == {".txt", ".md", ".rst", ".jsonl", ".json", ".parquet"}


@pytest.mark.parametrize("suffix", [".txt", ".md", ".rst", ".TXT"])
def test_a_plain_text_file_is_one_document(tmp_path, suffix):
    path = tmp_path / f"doc{suffix}"
    path.write_text("first line\n\nsecond paragraph, ünïcödé\n", encoding="utf-8")
    assert _read(path) == ["first line\n\nsecond paragraph, ünïcödé\n"]


def test_a_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfhello")
    assert _read(path) == ["hello"]


def test_jsonl_strings_and_objects_one_per_line(tmp_path):
    path = tmp_path / "data.jsonl"
    _jsonl(path, ["a plain string", {"text": "an object"}, {"text": "   "}, {"text": "line\u2028separator inside"}])
    path.write_text(path.read_text(encoding="utf-8") + "\n  \n", encoding="utf-8")  # blank lines are skipped
    assert _read(path) == ["a plain string", "an object", "line\u2028separator inside"]  # blank texts skipped


def test_json_list_single_object_single_string_and_json_lines(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"content": "one"}, "two", {"body": "three"}]))
    single = tmp_path / "single.json"
    single.write_text(json.dumps({"document": "alone"}))
    string = tmp_path / "string.json"
    string.write_text(json.dumps("just text"))
    lines = tmp_path / "lines.json"  # JSON lines under a .json name, as many dataset dumps are
    _jsonl(lines, [{"text": "x"}, {"text": "y"}])
    assert _read(listed) == ["one", "two", "three"]
    assert _read(single) == ["alone"]
    assert _read(string) == ["just text"]
    assert _read(lines) == ["x", "y"]


def test_parquet_rows_with_the_field_rule_and_nulls_skipped(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "content": ["alpha", None, "gamma"], "body": ["b1", "b2", "b3"]}), path)
    assert _read(path) == ["alpha", "gamma"]  # content comes before body; the null row has no text
    assert _read(path, "body") == ["b1", "b2", "b3"]
    with pytest.raises(UserError, match=r"no string column 'text'"):
        _read(path, "text")
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    with pytest.raises(UserError, match="no string column among text, content, document, body"):
        _read(numbers)


def test_a_folder_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "inner.txt").write_text("inner")
    (tmp_path / "a.md").write_text("first")
    _jsonl(tmp_path / "c.jsonl", [{"text": "c1"}, {"text": "c2"}])
    (tmp_path / "notes.csv").write_text("skipped,entirely")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\x00\x00")
    assert _read(tmp_path) == ["first", "inner", "c1", "c2"]  # a.md, b/inner.txt, c.jsonl


def test_the_text_field_rule(tmp_path):
    path = tmp_path / "fields.jsonl"
    _jsonl(path, [
        {"text": "t", "content": "c"},  # text wins
        {"text": 5, "content": "c"},  # text is not a string: the next field
        {"id": 1, "document": "d", "body": "b"},
        {"body": "b"},
    ])
    assert _read(path) == ["t", "c", "d", "b"]
    named = tmp_path / "named.jsonl"
    _jsonl(named, [{"text": "ignored", "article": "chosen"}, "a string is still a document"])
    assert _read(named, "article") == ["chosen", "a string is still a document"]


def test_dataset_id_syntaxes(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return iter([{"text": f"{name}|{config}|{split}"}, {"text": ""}, {"content": "second"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert _read("org/name") == ["org/name|None|train", "second"]
    assert _read("org/name:wiki") == ["org/name|wiki|train", "second"]
    assert _read("org/name@validation") == ["org/name|None|validation", "second"]
    assert _read("org/name:wiki@test[:10]") == ["org/name|wiki|test[:10]", "second"]
    assert [c[3] for c in calls] == [True] * 4  # always streamed
    assert parse_dataset_id("plain") == ("plain", None, "train")
    with pytest.raises(UserError, match="not a dataset id"):
        parse_dataset_id("name@")
    with pytest.raises(UserError, match="not a dataset id"):
        _read("name:@train")


def test_dataset_record_without_a_text_field(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: iter([{"text": "ok"}, {"label": 3}]))
    with pytest.raises(UserError, match=r"dataset org/name record 1 has no string field among text"):
        _read("org/name")


def test_dataset_that_cannot_be_loaded_is_one_sentence():
    pytest.importorskip("datasets")  # tests/conftest.py sets HF_DATASETS_OFFLINE=1: nothing is downloaded
    with pytest.raises(UserError, match="neither an existing file or folder nor a loadable Hugging Face dataset") as info:
        _read("no-such-org/no-such-dataset-mha2mla")
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------- errors


def test_missing_path_is_reported_at_the_call(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        iter_documents(str(tmp_path / "nowhere.txt"))  # not even iterated
    with pytest.raises(UserError, match="does not exist"):
        iter_documents("./relative/nowhere")


def test_folder_without_text_files(tmp_path):
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"holds no \.txt/\.md/\.rst/\.jsonl/\.json/\.parquet files"):
        iter_documents(str(tmp_path))


def test_file_of_another_format(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n")
    with pytest.raises(UserError, match=r"table\.csv is not a \.txt/"):
        iter_documents(str(path))


def test_invalid_json_lines_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    documents = iter_documents(str(path))
    assert next(documents) == "fine"  # records before the bad line are read
    with pytest.raises(UserError, match=r"bad\.jsonl:3 is not valid JSON"):
        next(documents)


def test_invalid_json_names_the_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": }\n]')
    with pytest.raises(UserError, match=r"bad\.json is not valid JSON \(.* at line 3, column"):
        _read(path)


@pytest.mark.parametrize("line, kind", [("[1, 2]", "an array"), ("42", "a number"), ("null", "null")])
def test_a_record_that_is_neither_string_nor_object(tmp_path, line, kind):
    path = tmp_path / "records.jsonl"
    path.write_text('"fine"\n' + line + "\n")
    with pytest.raises(UserError, match=rf"records\.jsonl:2 is {kind}, not a string or an object"):
        _read(path)


def test_a_json_item_that_is_neither_string_nor_object(tmp_path):
    path = tmp_path / "items.json"
    path.write_text('["fine", ["nested"]]')
    with pytest.raises(UserError, match=r"items\.json item 1 is an array"):
        _read(path)


def test_a_record_without_the_text_field(tmp_path):
    path = tmp_path / "fields.jsonl"
    _jsonl(path, [{"text": "fine"}, {"title": "no text here"}])
    with pytest.raises(UserError, match=r"fields\.jsonl:2 has no string field among text, content, document, body"):
        _read(path)
    with pytest.raises(UserError, match=r"fields\.jsonl:1 has no string field 'title'"):
        _read(path, "title")


def test_random_bytes_are_not_utf8_text(tmp_path):
    path = tmp_path / "noise.txt"
    generator = random.Random(0)
    path.write_bytes(bytes(generator.randrange(256) for _ in range(4096)))
    with pytest.raises(UserError, match=r"noise\.txt is not UTF-8 text"):
        _read(path)


def test_latin1_text_names_the_bad_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.jsonl is not UTF-8 text \(bad byte at offset 13\)"):
        _read(path)


def test_utf16_text_is_refused(tmp_path):
    path = tmp_path / "wide.txt"
    path.write_bytes("plain ascii in utf-16".encode("utf-16-le"))  # valid UTF-8 byte by byte, but full of NULs
    with pytest.raises(UserError, match=r"wide\.txt is not UTF-8 text \(NUL byte at offset 1\)"):
        _read(path)


def test_a_file_without_text_is_empty(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    with pytest.raises(UserError, match=r"blank\.txt is empty"):
        _read(blank)
    records = tmp_path / "blank.jsonl"
    _jsonl(records, [{"text": ""}, " "])
    with pytest.raises(UserError, match=r"blank\.jsonl is empty"):
        _read(records)


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1 not really")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"rows\.parquet needs pyarrow"):
        _read(path)


def test_a_file_that_is_not_parquet(tmp_path):
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "fake.parquet"
    path.write_text("just text")
    with pytest.raises(UserError, match=r"fake\.parquet is not a readable parquet file"):
        _read(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".json-lines", ".parquet", ".txt"])
def test_reading_resumes_at_any_locator_with_the_same_documents(tmp_path, suffix):
    texts = [f"document {i} " + "é" * i for i in range(12)] + ["", "last"]
    path = tmp_path / f"docs{suffix.replace('-lines', '')}"
    if suffix == ".parquet":
        pq, pa = pytest.importorskip("pyarrow.parquet"), pytest.importorskip("pyarrow")
        pq.write_table(pa.table({"text": texts}), path, row_group_size=5)
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")
    elif suffix == ".txt":
        path.write_text("one document", encoding="utf-8")
    else:  # JSON lines, under .jsonl or .json, a blank line among them
        path.write_text("\ufeff" + "".join(json.dumps({"text": t}) + "\n" + ("\n" if i == 3 else "")
                                           for i, t in enumerate(texts)), encoding="utf-8")
    located = list(iter_located(str(path)))
    assert [text for _, text in located] == ([t for t in texts if t] if suffix != ".txt" else ["one document"])
    for index, (locator, _) in enumerate(located):
        assert list(iter_located(str(path), None, json.loads(json.dumps(locator)))) == located[index:]


def test_a_dataset_resumes_at_a_record_index(monkeypatch):
    datasets = pytest.importorskip("datasets")
    records = [{"text": "a"}, {"text": " "}, {"text": "c"}, {"label": 1}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: iter(records))
    with pytest.raises(UserError, match=r"dataset org/name record 3 has no string field"):
        list(iter_located("org/name", None, 2))
    records.pop()
    assert list(iter_located("org/name")) == [(0, "a"), (2, "c")]
    assert list(iter_located("org/name", None, 2)) == [(2, "c")]


def test_a_streamed_dataset_resumes_from_its_own_state(monkeypatch):
    datasets = pytest.importorskip("datasets")
    texts = [f"record {i}" for i in range(11)]
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append(args)
        return datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=3)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    located = list(iter_located("org/name"))
    assert [text for _, text in located] == texts
    for index, (locator, _) in enumerate(located):
        assert locator[0] == index
        resumed = list(iter_located("org/name", None, json.loads(json.dumps(locator))))
        assert [text for _, text in resumed] == texts[index:]
        if len(resumed) > 2:  # a locator read after a resume resumes too
            again = iter_located("org/name", None, json.loads(json.dumps(resumed[2][0])))
            assert [text for _, text in again] == texts[index + 2:]
