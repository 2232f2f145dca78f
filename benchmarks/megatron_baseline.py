"""The Megatron-LM baseline for the data benchmarks: how long megatron-core's own ``GPTDataset`` takes to build its
document / sample / shuffle indices over an indexed dataset (``PREFIX.bin``/``PREFIX.idx``) and hand out its first
sample, built the way a Megatron pre-training run builds it (``BlendedMegatronDatasetBuilder`` over a single-prefix
blend, a train-only split, a fresh cache directory, one process and no ``torch.distributed``)."""

from __future__ import annotations

import os
import shutil
import time


class _Tokenizer:
    """The smallest stand-in for a ``MegatronTokenizerBase`` that ``GPTDataset`` reads: ``eod`` for the masks,
    ``pad`` for padding (-1 is megatron's own sentinel, never a token in the data), ``vocab_size`` for the token
    dtype code (uint16 below 65537), and ``unique_identifiers`` for the JSON description hashed into the cache names."""

    def __init__(self, eod: int = 0, pad: int = -1, vocab_size: int = 65536) -> None:
        self.eod = eod
        self.pad = pad
        self.vocab_size = vocab_size
        self.unique_identifiers = {"class": "raysc-benchmark", "eod": eod, "pad": pad, "vocab_size": vocab_size}


def _dir_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def gpt_dataset_times(prefix: str, seq_len: int, samples: int, cache_dir: str, seed: int = 1234) -> dict:
    """Build megatron-core's ``GPTDataset`` of at least ``samples`` sequences of ``seq_len`` tokens over ``prefix``,
    caching its indices in ``cache_dir`` (wiped first, so nothing is reused), and time it.

    Returns ``index_build_s`` (the builder's ``build()``: opening the indexed dataset and building, shuffling and
    saving the document / sample / shuffle indices), ``first_sample_s`` (from the start of ``build()`` to
    ``dataset[0]`` in hand), ``samples`` (``len(dataset)``, which rounds up to whole epochs' worth of sequences) and
    ``index_bytes`` (everything megatron wrote into ``cache_dir``)."""
    from megatron.core.datasets import helpers  # noqa: F401  (the C++ helpers; imported here, outside the timing)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    shutil.rmtree(cache_dir, ignore_errors=True)
    os.makedirs(cache_dir)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=cache_dir,
        mmap_bin_files=True,
        create_attention_mask=False,  # the data path alone: raysc builds its masks in the model, not the loader
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    start = time.perf_counter()
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()
    built = time.perf_counter()
    train[0]
    first = time.perf_counter()
    return {
        "index_build_s": built - start,
        "first_sample_s": first - start,
        "samples": len(train),
        "index_bytes": _dir_bytes(cache_dir),
    }
