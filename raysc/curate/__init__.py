"""Data curation: MinHash/LSH near-duplicate keys, document quality rules, the Ray Data pipeline
behind ``raysc curate`` (``pipeline``: the list of stages) and its dedup audit, and ``raysc pack``
(``pack``: curated documents to per-domain token shards). The mixture loader that feeds curated
domains to training is ``raysc.data.mixture``.
"""
