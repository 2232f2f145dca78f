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


GOOD = [{"text": "first doc", "id": "a1", "domain": "prose", "url": "https://x.org/1"},
        {"text": "", "id": "", "domain": "", "url": None, "extra": {"nested": [1, 2]}},
        {"text": "third\nline", "id": "c3"}]


@pytest.mark.parametrize("records", [
    GOOD,
    [{"text": "int ids", "id": 0}, {"text": "x", "id": 17, "domain": "code"}, {"text": "y"}],
    [{"text": "no other fields"}, {"text": "é ünïcode ✓"}],
])
def test_good_jsonl_by_arrow_matches_the_per_record_parser(tmp_path, monkeypatch, records):
    uri = _jsonl(tmp_path / "a.jsonl", records)
    want = parse_file(uri, {}, *FIELDS)
    assert _rows(uri, monkeypatch) == want


def test_good_parquet_and_compressed_jsonl_by_arrow(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["p1", "p2", "p3"], "id": [0, 5, None], "url": ["u", None, "w"],
                             "dump": ["CC", "CC", "CC"]}), tmp_path / "f.parquet")
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
