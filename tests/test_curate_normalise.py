"""The read stage's normalisation over a whole batch (Arrow kernels, ``inputs.normalise_texts``) gives
the text of the per-document definition (``inputs.normalise``), character for character, and the
batch's hashes, ids, domains and bad rows are the ones each document's own would be."""

from __future__ import annotations

import hashlib
import random
import unicodedata

import pyarrow as pa

from raysc.curate.inputs import ISSPACE, normalise, normalise_batch, normalise_texts, tag_domain

# every kind of character the normalisation touches: decomposed and composed accents, each Unicode
# space and line separator, carriage returns, blank lines
ALPHABET = [
    "a",
    "b",
    "é",
    "e\u0301",
    "x y",
    " ",
    "  ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x85",
    "\xa0",
    "\u1680",
    "\u2000",
    "\u200a",
    "\u200b",
    "\u2028",
    "\u2029",
    "\u202f",
    "\u3000",
    "def f():",
]


def test_isspace_lists_every_character_str_strip_removes():
    assert set(ISSPACE) == {chr(c) for c in range(0x110000) if chr(c).isspace()}


def test_the_batch_normalisation_equals_the_per_document_one():
    """(Breaking it, e.g. Arrow's utf8_normalize for NFC, which decomposes in pyarrow 25, fails this.)"""
    rng = random.Random(0)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 40))) for _ in range(5000)]
    texts += ["", "\n\n", " \u3000 ", "a\r\n\r\n\r\n\r\nb", unicodedata.normalize("NFD", "Café crème")]
    got = normalise_texts(pa.array(texts)).to_pylist()
    assert [i for i, (t, g) in enumerate(zip(texts, got)) if g != normalise(t)] == []


def test_a_batch_gets_each_documents_hash_id_domain_and_bad_reason():
    texts = ["  Hello\u00a0 world \r\n", "def f():\n    return 1\n", " \n ", "ignored", "Caf\u0065\u0301"]
    batch = pa.table(
        {
            "text": texts,
            "id": ["d1", "", "d3", "d4", ""],
            "domain": ["prose", "", "", "", "web"],
            "bad": ["", "", "", "malformed JSON", ""],
            "url": ["u"] * 5,
        }
    )
    out = normalise_batch(batch).to_pydict()
    want_text = [normalise(texts[0]), normalise(texts[1]), "", "", normalise(texts[4])]
    hashes = [hashlib.sha1(t.encode()).hexdigest() for t in want_text]
    assert out["text"] == want_text and out["hash"] == hashes
    assert out["id"] == ["d1", hashes[1][:16], "d3", "d4", hashes[4][:16]]
    assert out["bad"] == ["", "", "empty document", "malformed JSON", ""]
    assert out["domain"] == ["prose", tag_domain(want_text[1]), "", "", "web"]
    assert out["node"] == [f"{i}\x00{h[:16]}" for i, h in zip(out["id"], hashes)]
    assert out["bytes"] == [len(t.encode()) for t in want_text] and out["url"] == ["u"] * 5
