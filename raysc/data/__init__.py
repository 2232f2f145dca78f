"""Training data: the bundled corpus, the tokenizer, packing, the packed-shard reader of ``raysc pack``
output (``shards``), the deterministic batch and mixture loaders, and ``prepare_data`` (``prepare``),
which the supervisor runs to turn ``[data]`` into packed rows."""
