"""Input files parsed by Arrow give the rows the per-record parser gives (raysc.curate.inputs): the same
ids, texts, domains, URLs and sources, and every file it cannot take goes record by record."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysc.curate import inputs
from raysc.curate.inputs import parse_file, parse_file_table

FIELDS = ("text", "id", "domain", "url")


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _rows(uri: str, monkeypatch=None, arrow: bool = True) -> list[dict]:
    if monkeypatch is not None and arrow:  # the file must not need the per-record parser
        monkeypatch.setattr(inputs, "_parse_records", lambda *a: pytest.fail(f"{uri} went record by record"))
    table = parse_file_table(uri, {}, *FIELDS)
    assert table.schema == pa.schema([(f, pa.string()) for f in inputs.ROW_FIELDS])
    return table.to_pylist()


GOOD = [
    {"text": "first doc", "id": "a1", "domain": "prose", "url": "https://x.org/1"},
    {"text": "", "id": "", "domain": "", "url": None, "extra": {"nested": [1, 2]}},
    {"text": "third\nline", "id": "c3"},
]


@pytest.mark.parametrize(
    "records",
    [
        GOOD,
        [{"text": "int ids", "id": 0}, {"text": "x", "id": 17, "domain": "code"}, {"text": "y"}],
        [{"text": "no other fields"}, {"text": "é ünïcode ✓"}],
    ],
)
def test_good_jsonl_by_arrow_matches_the_per_record_parser(tmp_path, monkeypatch, records):
    uri = _jsonl(tmp_path / "a.jsonl", records)
    want = parse_file(uri, {}, *FIELDS)
    assert _rows(uri, monkeypatch) == want


def test_good_parquet_and_compressed_jsonl_by_arrow(tmp_path, monkeypatch):
    pq.write_table(
        pa.table({"text": ["p1", "p2", "p3"], "id": [0, 5, None], "url": ["u", None, "w"], "dump": ["CC", "CC", "CC"]}),
        tmp_path / "f.parquet",
    )
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in GOOD))
    for name in ("f.parquet", "g.jsonl.gz"):
        uri = str(tmp_path / name)
        want = parse_file(uri, {}, *FIELDS)
        assert _rows(uri, monkeypatch) == want
        monkeypatch.undo()


def test_files_arrow_cannot_take_go_record_by_record_with_their_bad_rows(tmp_path):
    cases = {
        "blank.jsonl": b'{"text": "a"}\n\n{"text": "b"}\n',  # line numbers would shift
        "malformed.jsonl": b'{"text": "a"}\n{"text": \n{"text": "c"}\n',
        "latin1.jsonl": '{"text": "caf\u00e9"}\n'.encode("latin-1"),
        "missing.jsonl": b'{"text": "a"}\n{"body": "b"}\n',
        "number.jsonl": b'{"text": "a"}\n{"text": 5}\n',
        "float_id.jsonl": b'{"text": "a", "id": 1.5}\n',
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null_text.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "no_text.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    good = gzip.compress(b'{"text": "a"}\n{"text": "b"}\n')
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) - 6])
    for path in sorted(tmp_path.iterdir()):
        want = parse_file(str(path), {}, *FIELDS)
        assert _rows(str(path), arrow=False) == want, path.name


def test_a_json_file_may_be_one_array_or_one_record(tmp_path):
    """A ``.json`` file holding one JSON array (pretty-printed, as exports write it) gives one row per
    element, each named ``file[i]``, bad elements as bad rows; one object gives one row; a malformed array
    is one bad row for the file (not one per line); JSON lines in a ``.json`` file read line by line."""
    records = [{"text": "first", "id": "a"}, {"text": 3, "id": "b"}, "not an object", {"text": "last"}]
    arr = tmp_path / "export.json"
    arr.write_text("  \n" + json.dumps(records, indent=2))
    rows = _rows(str(arr))
    assert [(r["id"], r["text"], r["source"], r["bad"]) for r in rows] == [
        ("a", "first", "export.json[0]", ""),
        ("", "", "export.json[1]", "missing or non-string field 'text'"),
        ("", "", "export.json[2]", "missing or non-string field 'text'"),
        ("", "last", "export.json[3]", ""),
    ]
    assert rows == parse_file(str(arr), {}, *FIELDS)
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"text": "a single\nrecord", "id": 7, "url": "u"}, indent=1))
    assert [(r["id"], r["text"], r["url"], r["source"]) for r in _rows(str(one))] == [
        ("7", "a single\nrecord", "u", "one.json")
    ]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(records, indent=2)[:-10])
    bad = _rows(str(broken))
    assert len(bad) == 1 and bad[0]["bad"].startswith("malformed JSON array (") and bad[0]["source"] == "broken.json"
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "x", "id": "1"}\n{"text": "y", "id": "2"}\n')
    assert [(r["id"], r["source"]) for r in _rows(str(lines))] == [("1", "lines.json:1"), ("2", "lines.json:2")]
