"""The ``[curate]``, ``[dedup]`` and ``[quality]`` sections: the data curation pipeline
(``raysc curate``): its input and output, exact and MinHash-LSH near-duplicate removal, and the
Gopher / C4 / FineWeb quality rules with optional reference-model perplexity scoring."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt, opt_dict


@dataclass
class CurateConfig:
    input: str = opt(
        "bundled",
        "documents to curate: 'bundled' (the stdlib corpus), or a file, directory or glob "
        "of JSONL / Parquet / plain-text files, each plain or .gz / .zst, at any fsspec URI "
        "(s3://, file://)",
    )
    output: str = opt("", "where the curated Parquet and the report go (any fsspec URI); empty = <run.dir>/curated")
    text_field: str = opt("text", "field holding a document's text (JSONL and Parquet)")
    id_field: str = opt("id", "field with the input's document id, kept in the output; missing = a content hash")
    domain_field: str = opt("domain", "field naming the document's domain; missing = tagged by rules (code/prose)")
    url_field: str = opt(
        "url",
        "field with the document's source URL (FineWeb's url), kept in the output and the "
        "dropped documents; missing = ''",
    )
    storage_options: dict = opt_dict('fsspec options for input and output, e.g. {endpoint_url = "http://..."}')
    bad_samples: int = opt(20, "bad input records sampled into the report", min=0)


@dataclass
class DedupConfig:
    exact: bool = opt(True, "drop documents whose normalised text is identical (one survivor: the smallest id)")
    near: bool = opt(True, "drop near-duplicates found by MinHash-LSH (one survivor per cluster: the smallest id)")
    shingle: int = opt(5, "words per shingle", min=1)
    num_perm: int = opt(
        112,
        "MinHash values per signature (bins of one_permutation, hash functions of "
        "k_permutations); must equal bands × rows",
        min=1,
    )
    bands: int = opt(14, "LSH bands", min=1)
    rows: int = opt(8, "signature values per band", min=1)
    seed: int = opt(1, "seed of the MinHash hashing")
    minhash: str = opt(
        "one_permutation",
        "signature scheme: one_permutation (one hash per shingle into num_perm "
        "bins, empty bins densified) or k_permutations (num_perm hashes per "
        "shingle, as datasketch)",
        choices=["one_permutation", "k_permutations"],
    )
    threshold: float = opt(
        0.7,
        "a candidate pair from an LSH bucket is a duplicate when its signatures agree "
        "on at least this share of values (estimated Jaccard)",
        min=0.0,
        max=1.0,
    )
    max_rounds: int = opt(40, "rounds of the distributed connected-components search before giving up", min=1)


@dataclass
class QualityConfig:
    enabled: bool = opt(
        True,
        "apply the Gopher, C4 and FineWeb rules; false measures nothing (no q_* columns, "
        "the report says the histograms were skipped) unless a reference_run scores",
    )
    skip_domains: str = opt("code", "comma-separated domains judged by the repetition rules only")
    min_words: int = opt(50, "Gopher: fewest words", min=0)
    max_words: int = opt(100_000, "Gopher: most words", min=1)
    min_avg_word_len: float = opt(3.0, "Gopher: shortest mean word length", min=0.0)
    max_avg_word_len: float = opt(10.0, "Gopher: longest mean word length", min=0.0)
    max_symbol_word_ratio: float = opt(0.1, "Gopher: most '#' and ellipses per word", min=0.0)
    max_bullet_lines_ratio: float = opt(0.9, "Gopher: largest share of lines starting with a bullet", min=0.0)
    max_ellipsis_lines_ratio: float = opt(0.3, "Gopher: largest share of lines ending with an ellipsis", min=0.0)
    min_alpha_words_ratio: float = opt(0.8, "Gopher: smallest share of words with a letter", min=0.0)
    min_stop_words: int = opt(2, "Gopher: fewest English stop words (the, be, to, of, and, that, have, with)", min=0)
    max_dup_line_frac: float = opt(0.3, "Gopher repetition: largest share of duplicate lines", min=0.0)
    max_dup_para_frac: float = opt(0.3, "Gopher repetition: largest share of duplicate paragraphs", min=0.0)
    max_dup_line_char_frac: float = opt(
        0.2, "Gopher repetition: largest share of characters in duplicate lines", min=0.0
    )
    max_dup_para_char_frac: float = opt(
        0.2, "Gopher repetition: largest share of characters in duplicate paragraphs", min=0.0
    )
    top_ngram_max: str = opt(
        "2:0.20,3:0.18,4:0.16", "Gopher repetition: n:max share of characters in the most frequent n-gram"
    )
    dup_ngram_max: str = opt(
        "5:0.15,6:0.14,7:0.13,8:0.12,9:0.11,10:0.10", "Gopher repetition: n:max share of characters in repeated n-grams"
    )
    c4_min_sentences: int = opt(5, "C4: fewest sentences in the lines C4 keeps", min=0)
    c4_min_words_per_line: int = opt(3, "C4: a kept line has at least this many words", min=0)
    c4_max_word_len: int = opt(1000, "C4: a kept line has no longer word", min=1)
    fw_min_line_punct_ratio: float = opt(0.12, "FineWeb: smallest share of lines ending in punctuation", min=0.0)
    fw_max_short_line_ratio: float = opt(0.67, "FineWeb: largest share of short lines", min=0.0)
    fw_short_line_chars: int = opt(30, "FineWeb: a short line has at most this many characters", min=0)
    fw_max_dup_line_char_ratio: float = opt(0.01, "FineWeb: largest share of characters in duplicate lines", min=0.0)
    fw_max_newline_ratio: float = opt(0.3, "FineWeb: most newlines per word", min=0.0)
    reference_run: str = opt(
        "",
        "a raysc run directory (a model trained on text you trust) whose newest verified "
        "checkpoint scores every document's perplexity (CCNet's recipe: q_ppl and a "
        "head/middle/tail bucket per domain); empty = no model score",
    )
    score_tokens: int = opt(
        256, "tokens of each document the reference model scores, from its start (at most the model's context)", min=2
    )
    keep_top_percent: float = opt(
        100.0,
        "keep this percent of each domain's documents, the ones with the lowest "
        "reference perplexity; 100 = score only (needs quality.reference_run)",
        gt=0.0,
        max=100.0,
    )
    max_perplexity: float = opt(
        0.0,
        "drop documents whose reference perplexity is above this; 0 = no limit (needs quality.reference_run)",
        min=0.0,
    )
    score_actors: int = opt(1, "perplexity scorer actors, one reference model each (a Ray Data actor pool)", min=1)
    score_gpus: float = opt(0.0, "GPUs per scorer actor; 0 = score on CPU", min=0.0)
