"""Corpus, tokenizer, packing and the deterministic batch loader."""
