"""A plain-text corpus (JSONL, ``.gz``, ``.zst``, Parquet) tokenized once, in parallel Ray tasks, into token files
that the ranks read where they lie.

The corpus is cut into chunks: a plain ``.jsonl`` file into byte ranges of about ``CHUNK_BYTES`` ending
at line ends (found by reading a line at each cut, not the file), a compressed or Parquet file whole. A Ray task per
chunk reads its lines, encodes the documents with ``raysc.data.packing.encode_corpus`` (each document
``[BOS] ids EOS``, the tokenizer's own post-processor not run) and writes them as one flat ``.npy`` of
ids, ``part-<chunk>.npy``, under ``<data.cache_dir>/text/<key>``; only counts come back. The parts
joined in chunk order are the token stream ``encode_corpus`` gives for the whole corpus, so
``raysc.data.row_source.TokenRows`` over them cuts exactly the rows ``raysc.data.packing.pack_tokens``
cut in memory. ``manifest.json``, written last by the caller, marks the cache complete; the key
is the files' identities (path, size, modification time: no byte hashed), the tokenizer's SHA-256 and
the special tokens, so a changed file or tokenizer is a new cache and a second run starts at once.

On a cluster of several machines the cache must be where every node sees it: ``unseen_by`` asks each
node whether the cache directory exists there. Where a node does not (a node-local ``data.cache_dir``),
the tasks run on this node only and ``raysc.data.prepare`` ships a small corpus's rows through Ray's
object store (the same rows in the same order) or refuses a large one, naming the fix.

Why tasks and not Ray Data (which ``raysc pack`` uses): the parts must keep the corpus order (part
``i`` is chunk ``i``; pack's shards need no order), and inside a run the fleet has already reserved the
CPUs it uses, so the tasks ask for none (``num_cpus=0``) and at most as many run at once as the cluster
has CPUs, where Ray Data would wait for CPUs the reservation holds. Without Ray (``prepare_data``
called from a tool outside a run) the chunks are encoded in this process, into the same cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raysc.data.compressed import read_bytes, split_codec
from raysc.data.corpus import parquet_texts, parse_records
from raysc.data.special_tokens import SpecialTokens

CHUNK_BYTES = 64 << 20  # plain JSONL bytes per task
ENCODE_DOCS = 1024  # documents encoded at once in a task (bounds the tokenizer's per-token objects)
FORMAT = "raysc-text-cache-v1"


@dataclass(frozen=True)
class Chunk:
    """Lines ``[start, end)`` (bytes, at line starts) of a plain JSONL file; a compressed file whole (end -1)."""

    path: str
    start: int
    end: int


def chunks(files: list[Path], chunk_bytes: int | None = None) -> list[Chunk]:
    """The corpus's chunks (of about ``chunk_bytes``, default ``CHUNK_BYTES``), in corpus order."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    out = []
    for f in files:
        size = f.stat().st_size
        whole = bool(split_codec(f.name)[1]) or f.suffix == ".parquet"
        if whole or size <= chunk_bytes:
            out.append(Chunk(str(f), 0, -1 if whole else size))
            continue
        cuts = [0]
        with open(f, "rb") as fh:
            for pos in range(chunk_bytes, size, chunk_bytes):
                fh.seek(pos - 1)
                cut = pos - 1 + len(fh.readline())  # the first line start at or after pos
                if cut < size and cut > cuts[-1]:
                    cuts.append(cut)
        out += [Chunk(str(f), a, b) for a, b in zip(cuts, [*cuts[1:], size])]
    return out


def chunk_texts(chunk: Chunk) -> list[str]:
    """The documents' texts of ``chunk``; a damaged compressed file or a bad line raises, naming the file
    (and the line, counted from the file's start)."""
    if chunk.path.endswith(".parquet"):
        return parquet_texts(chunk.path)
    if chunk.end < 0:
        data, damaged = read_bytes(chunk.path)
        if damaged:
            raise ValueError(
                f"data.source file {chunk.path!r}: {damaged}; fetch it again, or run `raysc curate` over "
                f"the corpus, which counts damaged files in its report and keeps what they hold"
            )
    else:
        with open(chunk.path, "rb") as fh:
            fh.seek(chunk.start)
            data = fh.read(chunk.end - chunk.start)
    try:
        return [rec["text"] for rec in parse_records(data, chunk.path)]
    except ValueError:
        if chunk.start <= 0:
            raise
        with open(chunk.path, "rb") as fh:  # name the line as the file counts it
            before = fh.read(chunk.start).count(b"\n")
        return [rec["text"] for rec in parse_records(data, chunk.path, before + 1)]


def encode_chunk(chunk: Chunk, tokenizer_json: str, special: dict, out: str) -> dict:
    """Encode ``chunk``'s documents and write their ids to ``out`` (nothing for an empty chunk); the counts."""
    from tokenizers import Tokenizer

    from raysc.data.packing import encode_corpus

    tok = Tokenizer.from_str(tokenizer_json)
    marks = SpecialTokens.from_dict(special)
    texts = chunk_texts(chunk)
    pieces = [
        encode_corpus(texts[i : i + ENCODE_DOCS], tok, tok.get_vocab_size(), marks)
        for i in range(0, len(texts), ENCODE_DOCS)
    ]
    tokens = sum(len(p) for p in pieces)
    if tokens:
        tmp = f"{out}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.save(fh, np.concatenate(pieces))
        os.replace(tmp, out)
    return {"tokens": int(tokens), "documents": len(texts)}


def cache_key(files: list[Path], corpus_id: str, tokenizer_json: str, special: SpecialTokens) -> str:
    """The cache's key: the corpus (``corpus_id``, and each file's path, size and modification time), the
    tokenizer's SHA-256 and the special tokens."""
    h = hashlib.sha256(f"{FORMAT}\n{corpus_id}\n".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    h.update(hashlib.sha256(tokenizer_json.encode()).digest())
    h.update(json.dumps(special.to_dict(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def text_cache(
    files: list[Path],
    corpus_id: str,
    tokenizer_path: Path,
    special: SpecialTokens,
    cache_dir: str | Path,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The corpus tokenized into ``<cache_dir>/text/<key>`` (encoded now unless cached): its manifest,
    ``parts`` being the part files' paths in corpus order."""
    tokenizer_json = Path(tokenizer_path).read_text()
    key = cache_key(files, corpus_id, tokenizer_json, special)
    base = Path(cache_dir) / "text" / key
    manifest = base / "manifest.json"
    if manifest.is_file():
        return _resolved(json.loads(manifest.read_text()), base, not unseen_by(manifest))
    base.mkdir(parents=True, exist_ok=True)
    probe = base / f".probe-{os.urandom(8).hex()}"  # new: no other node can have one of its own
    probe.touch()
    shared = not unseen_by(probe)
    probe.unlink()
    todo = chunks(files)
    outs = [str(base / f"part-{i:05d}.npy") for i in range(len(todo))]
    args = [(c, tokenizer_json, special.to_dict(), o) for c, o in zip(todo, outs)]
    counts = _run(args, progress, anywhere=shared)
    kept = [(Path(o).name, c) for o, c in zip(outs, counts) if c["tokens"]]
    meta = {
        "format": FORMAT,
        "key": key,
        "corpus": corpus_id,
        "files": [str(f) for f in files],
        "chunks": [asdict(c) for c in todo],
        "parts": [name for name, _ in kept],
        "part_tokens": [c["tokens"] for _, c in kept],
        "tokens": sum(c["tokens"] for c in counts),
        "documents": sum(c["documents"] for c in counts),
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        "special_tokens": special.to_dict(),
    }
    tmp = manifest.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(manifest)  # last: the cache is complete
    return _resolved(meta, base, shared)


def _resolved(meta: dict, base: Path, shared: bool) -> dict:
    """The manifest with the parts' paths, and whether every node of the cluster sees them (``shared``)."""
    return {**meta, "dir": str(base), "parts": [str(base / p) for p in meta["parts"]], "shared": shared}


def unseen_by(path: Path, timeout_s: float = 60.0) -> list[str]:
    """The alive Ray nodes (ids) on which ``path``, written on this node, does not exist: a node-local
    ``data.cache_dir`` on a cluster of several machines (nodes sharing a file system, or on one machine,
    see it). Empty without Ray or on one node; a node that does not answer in ``timeout_s`` counts as not
    seeing it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        return []
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return []
    probe = ray.remote(num_cpus=0)(os.path.exists)
    refs = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(str(path)): n
        for n in nodes
    }
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    seen = {refs[r] for r in ready if ray.get(r)}
    return [n for n in nodes if n not in seen]


def _run(args: list[tuple], progress: Callable[[str], None] | None, anywhere: bool = True) -> list[dict]:
    """``encode_chunk`` of every chunk: Ray tasks (at most the cluster's CPUs at once; on this node unless
    ``anywhere``, when the cache is on a disk only this node sees) when Ray is up, else here; the counts in
    chunk order. A task's error is raised as itself (it names the file)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    say = progress or (lambda _msg: None)
    if not ray.is_initialized():
        out = []
        for i, a in enumerate(args):
            out.append(encode_chunk(*a))
            say(f"tokenized {i + 1}/{len(args)} chunks")
        return out
    task = ray.remote(num_cpus=0, max_retries=2)(encode_chunk)  # the fleet holds the CPUs; see the docstring
    width = max(1, int(ray.cluster_resources().get("CPU", 1)))
    if not anywhere:
        here = ray.get_runtime_context().get_node_id()
        task = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
        cpus = [n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == here]
        width = max(1, int(cpus[0] if cpus else 1))
    results: dict[int, dict] = {}
    pending: dict = {}
    nxt = 0
    while nxt < len(args) or pending:
        while nxt < len(args) and len(pending) < width:
            pending[task.remote(*args[nxt])] = nxt
            nxt += 1
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                for other in pending:
                    ray.cancel(other)
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, Exception) else e) from None
            say(f"tokenized {len(results)}/{len(args)} chunks, {sum(r['tokens'] for r in results.values()):,} tokens")
    return [results[i] for i in range(len(args))]


READ_ALL_FACTOR = 16  # a corpus of at most this many times data.tokenizer_sample_mb is read whole to sample from


def tokenizer_documents(files: list[Path], sample_mb: float, seed: int) -> list[str]:
    """Documents to train a tokenizer on (``raysc.data.tokenizer.sample_texts`` then takes its seeded
    ``sample_mb`` of them): every document of a corpus whose files hold at most ``READ_ALL_FACTOR`` x
    ``sample_mb`` MB; of a larger one, whole files in a seeded order until 4 x ``sample_mb`` MB of text, so
    the memory this takes is bounded whatever the corpus size."""
    import random

    if sum(f.stat().st_size for f in files) <= READ_ALL_FACTOR * sample_mb * 1e6:
        return [t for c in chunks(files, 1 << 62) for t in chunk_texts(c)]
    order = list(files)
    random.Random(seed).shuffle(order)
    texts: list[str] = []
    for c in chunks(order):
        texts += chunk_texts(c)
        if sum(map(len, texts)) >= 4 * sample_mb * 1e6:
            break
    return texts
