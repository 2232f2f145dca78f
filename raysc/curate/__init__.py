"""Data curation: MinHash/LSH near-duplicate keys, document quality rules, the Ray Data pipeline
behind ``raysc curate`` and its dedup audit. The mixture loader that feeds curated domains to
training is ``raysc.data.mixture``.
"""
