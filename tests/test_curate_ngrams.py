"""Gopher's n-gram repetition measures computed for a whole batch in numpy (``raysc.curate.ngrams``) equal
the per-document definition (a ``Counter`` of word tuples; ``Counter.most_common``'s tie rule), document by
document, on synthetic documents with seeded copies and on the edge cases."""

from __future__ import annotations

import pytest

from raysc.curate.ngrams import ngram_repetition, ngram_repetition_reference
from raysc.curate.words import words

TOP, DUP = [2, 3, 4], [5, 6, 7, 8, 9, 10]


EDGE = [
    "",
    "one",
    "a b",
    "a a a a a a a a a a a a",
    "to be or not to be that is the question to be or not",
    # a tie: "x y" and "p q" both twice; "p q" occurs first, and its words are longer
    "pp qq x y pp qq x y",
    "x y pp qq x y pp qq",
    "the cat sat on the mat the cat sat on the mat the cat sat on the mat and then some more words here",
]


def test_the_batch_equals_the_per_document_definition():
    from raysc.curate.synth import Synth, SynthSpec

    texts = [d["text"] for d, _ in Synth(SynthSpec(docs=300, corpus_mb=0.5, near_frac=0.3))]
    texts = EDGE + texts + EDGE  # the same documents again: n-grams shared across documents stay apart
    docs = [words(t) for t in texts]
    got = ngram_repetition(docs, TOP, DUP)
    for i, w in enumerate(docs):
        for key, want in ngram_repetition_reference(w, TOP, DUP).items():
            assert got[key][i] == pytest.approx(want, abs=1e-12), (i, key, texts[i][:80])
    assert any(got["dup_5gram_frac"] > 0.2) and any(got["top_2gram_frac"] > 0)  # the measures were exercised


def test_one_document_at_a_time_gives_the_same_as_the_batch():
    docs = [words(t) for t in EDGE]
    batch = ngram_repetition(docs, TOP, DUP)
    for i, w in enumerate(docs):
        alone = ngram_repetition([w], TOP, DUP)
        assert {k: v[0] for k, v in alone.items()} == {k: v[i] for k, v in batch.items()}
    with pytest.raises(ValueError, match="start at 2"):
        ngram_repetition(docs, [1], DUP)


def test_gophers_letter_words_are_counted_as_per_word_definition():
    """``alpha_words_ratio`` counts the whitespace-separated words that hold a letter with one regex over
    the text; the definition is a search in each word of ``str.split()`` (odd whitespace and digits too)."""
    import re

    from raysc.curate.quality import measure_gopher

    letter = re.compile(r"[^\W\d_]")
    for text in [
        "a\x1cb c\u00a0d",
        "12 3_ _x é9 ٣ x\u2028y",
        "###... …",
        " \t lead trail \n",
        "",
        "_ __ 9a a9 ²³ Ⅻ",
        "word1 2word __init__ 3.14 e=mc² ∑x",
    ]:
        w = text.split()
        want = sum(bool(letter.search(x)) for x in w) / max(len(w), 1)
        assert measure_gopher(text)["alpha_words_ratio"] == want, text
        assert measure_gopher(text)["avg_word_len"] == sum(map(len, w)) / max(len(w), 1)
