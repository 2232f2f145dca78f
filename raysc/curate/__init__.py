"""Data curation (issue 6, in progress): MinHash/LSH near-duplicate keys and document quality rules.

The Ray Data pipeline that runs them over a corpus (``raysc curate``), the dedup audit, tokenize-and-
pack per domain and the mixture loader are not built yet; see the notes of the last stop.
"""
