"""The ``[data]`` section: where training text or tokens come from (bundled corpus, JSONL, Megatron,
OLMo token files, packed shards with a domain mixture schedule), the tokenizer and its special tokens,
the validation split and the cache."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt, opt_dict


@dataclass
class DataConfig:
    source: str = opt(
        "bundled",
        "'bundled' (Python stdlib corpus), a JSONL file / directory with a 'text' field "
        "(plain, .jsonl.gz or .jsonl.zst) or Parquet files with a 'text' column, a Megatron indexed dataset (PREFIX of "
        "PREFIX.bin + PREFIX.idx, with data.tokenizer), OLMo-style token files (.npy, "
        "a file or directory, with data.tokenizer), or the output of `raysc pack` (a directory or URL with index.json: per-domain "
        "token shards fed by the mixture loader)",
    )
    schedule: str = opt(
        "",
        "domain mixture by consumed tokens, 'TOKENS:domain=weight,...; TOKENS:...' (e.g. "
        "'0:prose=0.7,code=0.3; 2e6:prose=0.3,code=0.7'); needs a packed data.source; "
        "empty = one phase in the domains' natural proportions",
    )
    prefetch: int = opt(4, "global batches the loader prepares (reads) ahead in a thread of each worker", min=1, max=64)
    shuffle_block_kib: int = opt(
        1024,
        "the data order shuffles blocks of this many KiB of neighbouring rows (counted in uint16 tokens) and "
        "the rows inside each block: a rank reads whole blocks, never a few KB at a random offset "
        "(docs/data.md, 'Reading a corpus where it lies'); part of the data order",
        min=1,
        max=1 << 20,
    )
    storage_options: dict = opt_dict("fsspec options for reading data.source when it is an object-store URL")
    tokenizer: str = opt("", "path to an existing tokenizer.json; empty = train a byte-level BPE on the corpus")
    token_dtype: str = opt(
        "auto",
        "dtype of raw token files in data.source (OLMo / Dolma .npy memmaps have no "
        "header): auto = uint16 up to 65,536 tokens, else uint32 (OLMo's rule)",
        choices=["auto", "uint16", "uint32"],
    )
    eos_token: str = opt(
        "",
        "the token that ends every document (and stops generation); empty = the tokenizer's "
        "own, read from its folder (special_tokens_map.json, tokenizer_config.json, config.json)",
    )
    bos_token: str = opt("", "the token that begins a document; empty = the tokenizer's own, if it has one")
    add_bos: str = opt(
        "auto",
        "put the BOS token before every document: auto = as the tokenizer does (Llama 2 and "
        "3, Mistral: yes; Qwen2, GPT-2, raysc's own: no)",
        choices=["auto", "true", "false"],
    )
    tokenizer_sample_mb: float = opt(4.0, "megabytes of corpus text used to train the tokenizer", gt=0.0)
    max_corpus_mb: float = opt(6.0, "cap on the bundled corpus size in megabytes", gt=0.0)
    val_fraction: float = opt(0.01, "share of packed sequences held out for validation loss", min=0.0, max=0.5)
    cache_dir: str = opt(".cache/raysc", "where built corpora, tokenizers and token shards are cached")
