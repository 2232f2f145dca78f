"""Word hashes of a whole batch from its UTF-8 bytes (``raysc.curate.words.word_hashes``): the same words
as ``words()`` (Python's ``\\w`` runs of the lowercased text) and each word's ``word_hash``, for ASCII
and other texts, empty ones, a text longer than a numpy chunk and batches cut into chunks anywhere."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa

import raysc.curate.words as w
from raysc.curate.minhash import MinHasher


def _want(texts: list[str]) -> tuple[list[int], list[int]]:
    hashes, bounds = [], [0]
    for t in texts:
        hashes += [w.word_hash(x) for x in w.words(t)]
        bounds.append(len(hashes))
    return hashes, bounds


def _texts(rng: random.Random, n: int) -> list[str]:
    # ASCII word and non-word bytes, Latin-1 and CJK letters, a combining mark, the dotted capital I (its
    # lowercase is two code points), a non-breaking space, digits in other scripts, NUL
    chars = list("abcXYZ019_ .,;:-'\n\t") + list("éÉßİ中文ǅ\u0301\u00a0\u0663\u00b2\x00")
    out = []
    for _ in range(n):
        ascii_only = rng.random() < 0.6
        pool = chars[:19] if ascii_only else chars
        out.append("".join(rng.choice(pool) for _ in range(rng.randrange(0, 60))))
    return out


def test_batch_word_hashes_are_the_words_and_their_hashes(monkeypatch):
    rng = random.Random(0)
    texts = _texts(rng, 600) + ["", "", "Hello, World!", "   ", "x" * 5000 + " Tail"]
    for chunk in (w._CHUNK, 64, 7):  # chunk boundaries fall inside texts' runs of bytes and between texts
        monkeypatch.setattr(w, "_CHUNK", chunk)
        monkeypatch.setattr(w, "_POW", w._powers(w._P, chunk))
        monkeypatch.setattr(w, "_POW_INV", w._powers(w._P_INV, chunk))
        hashes, bounds = w.word_hashes(texts)
        want_hashes, want_bounds = _want(texts)
        assert bounds.tolist() == want_bounds, chunk
        assert hashes.tolist() == want_hashes, chunk
    # an Arrow array (also a sliced one, large or not) gives what the list gives
    arr = pa.array(["pad"] + texts, pa.string()).slice(1)
    for given in (arr, arr.cast(pa.large_string()), pa.chunked_array([arr])):
        got = w.word_hashes(given)
        assert got[0].tolist() == want_hashes and got[1].tolist() == want_bounds
    assert [len(x) for x in w.word_hashes([])] == [0, 1]


def test_word_hashes_separate_words_and_texts():
    """Distinct words get distinct hashes, a word's case does not matter, and a word never runs from one
    text into the next (``ab`` + ``cd`` are two texts of one word each, not ``abcd``)."""
    hashes, bounds = w.word_hashes(["ab", "cd", "AB cd", "abcd"])
    assert bounds.tolist() == [0, 1, 2, 4, 5]
    assert hashes[0] == hashes[2] and hashes[1] == hashes[3] and len(set(hashes.tolist())) == 3
    rng = random.Random(1)
    vocab = {"".join(rng.choice("abcdefghij") for _ in range(rng.randrange(1, 9))) for _ in range(20000)}
    got, _ = w.word_hashes([" ".join(sorted(vocab))])
    assert len(set(got.tolist())) == len(vocab)


def test_minhash_shingles_combine_the_word_hashes():
    """A shingle hash is the finalised sum of its words' hashes times the fixed multipliers; a text of
    fewer words than a shingle is one shingle of all of them; an empty one the hash of nothing."""
    mh = MinHasher()
    texts = ["one two three four five six seven", "one two", "", "Ünïcode wörds here and there too"]
    hashes, starts = mh.shingle_hashes(texts)
    m = 2**64

    def finalise(a: int) -> int:
        a ^= a >> 29
        a = a * 0xBF58476D1CE4E5B9 % m
        return a ^ (a >> 32)

    want = []
    for t in texts:
        ws = [w.word_hash(x) for x in w.words(t)]
        windows = [ws[p : p + 5] for p in range(len(ws) - 4)] or [ws]
        want.append([finalise(sum(h * int(mh._mix[k]) for k, h in enumerate(win)) % m) for win in windows])
    assert starts.tolist() == np.cumsum([0] + [len(x) for x in want[:-1]]).tolist()
    assert hashes.tolist() == [h for doc in want for h in doc]
