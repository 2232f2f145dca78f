"""Does start-up and memory stay flat as the corpus grows? A tiny run on OLMo-style ``.npy`` token files
of growing size, read where they lie (issue 57), and the loader alone.

Per corpus size (``BENCH_DATA_SIZES``, tokens, default 10 M and 1.6 B; written once as uint16 ``.npy``
files under ``.cache/bench-data``, random ids with an EOS every ~500 tokens):

- ``raysc train`` of the tiny config for 5 steps on that file, as a user runs it (its own local Ray with
  the machine's CPUs), ``BENCH_DATA_REPEATS`` (3) times (medians; the largest memory growth and wait): the
  wall time to the first step (from the command's start to the first row of
  ``metrics.jsonl``), the whole wall time, and the growth of the machine's used memory (``MemTotal -
  MemAvailable``, sampled every 0.2 s, peak minus before), plus the p99 of the steps' ``data_wait_s``;
- the loader alone in this process (no Ray, no model): global batches of 8 rows of 2,049 tokens through
  ``BatchLoader`` over the file's ``TokenRows``, tokens per second, and the resident-memory growth of
  this process (the loader's memory);
- with ``BENCH_DATA_S3=1`` (sizes up to 200 M tokens: moto holds objects in memory), the same loader over
  the file served by the local S3 server (moto) behind a proxy adding ``BENCH_DATA_S3_LATENCY_MS`` (20)
  to every request, 2 ranks: GET requests per MiB delivered, read amplification (bytes fetched / bytes
  used) and tokens per second;
- with ``BENCH_DATA_S3=1``, start-up on many files: ``BENCH_DATA_FILES`` (256) token files in the S3
  server behind the proxy, described one at a time and ``DESCRIBE_THREADS`` at a time;
- what a user would pick instead, on the same tokens as a Megatron ``.bin/.idx`` (each EOS ends a
  document): megatron-core's ``GPTDataset`` built for one epoch of 2,048-token samples, its index build
  time and time to the first sample (``megatron_baseline.py``), beside ours: describing the file, the
  loader built and the first global batch read.

Before this issue the supervisor loaded the whole corpus (~24 bytes of RAM per token): a 1.6 B-token
file was OOM-killed at 21 GB on a 24 GB machine. Prints JSON on its last line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")
CACHE = ROOT / ".cache" / "bench-data"
VOCAB = 2048  # the tiny config's model.vocab_size
EOS = 0


def _used_bytes() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = {k: int(v.split()[0]) for k, v in info.items()}
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def corpus(tokens: int) -> Path:
    """A uint16 token file of ``tokens`` ids (numpy's format), written once in 64 M-token pieces."""
    path = CACHE / f"tokens-{tokens}.npy"
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=(tokens,))
    rng = np.random.default_rng(0)
    for lo in range(0, tokens, 1 << 26):
        hi = min(tokens, lo + (1 << 26))
        piece = rng.integers(1, VOCAB, hi - lo, dtype=np.uint16)
        piece[rng.random(hi - lo) < 0.002] = EOS
        arr[lo:hi] = piece
    arr.flush()
    del arr
    tmp.replace(path)
    return path


def tokenizer() -> Path:
    from raysc.data.tokenizer import train_tokenizer

    path = CACHE / "tokenizer.json"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, VOCAB).save(str(path))
    return path


def train_run(source: Path, tok: Path) -> dict:
    """``raysc train`` of the tiny config, 5 steps on ``source``: wall to the first step, memory growth."""
    run_dir = Path(tempfile.mkdtemp(prefix="data-scale-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    before, peak, stop = _used_bytes(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _used_bytes())
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [RAYSC, "train", "jobs/configs/tiny.toml", "--no-progress"]
        + [
            x
            for s in ("train.steps=5", f'data.source="{source}"', f'data.tokenizer="{tok}"', f'run.dir="{run_dir}"')
            for x in ("--set", s)
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = None
    while proc.poll() is None:
        if first is None and (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size:
            first = time.monotonic() - t0
        time.sleep(0.05)
    wall = time.monotonic() - t0
    stop.set()
    sampler.join()
    out = proc.stdout.read()
    metrics = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if proc.returncode == 0 else []
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode:
        return {"error": out[-1500:]}
    waits = sorted(m["data_wait_s"] for m in metrics)
    return {
        "first_step_s": round(first or wall, 2),
        "wall_s": round(wall, 2),
        "memory_growth_gb": round((peak[0] - before) / 1e9, 3),
        "data_wait_p99_ms": round(1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3),
    }


def megatron_copy(path: Path) -> Path:
    """The tokens of ``path`` as a Megatron dataset (``.bin`` the same ids, ``.idx`` a document per EOS),
    written once beside it, in 64 M-token pieces."""
    from raysc.data.megatron import CODES, HEADER

    prefix = path.with_suffix("")
    prefix = prefix.with_name(prefix.name + "_text_document")
    if prefix.with_suffix(".idx").is_file():
        return prefix
    tokens = np.load(path, mmap_mode="r")
    ends = []
    with open(prefix.with_suffix(".bin.tmp"), "wb") as out:
        for lo in range(0, len(tokens), 1 << 26):
            piece = np.asarray(tokens[lo : lo + (1 << 26)])
            out.write(piece.tobytes())
            ends.append(np.flatnonzero(piece == EOS) + lo + 1)
    ends = np.concatenate(ends)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]])
    import struct

    with open(prefix.with_suffix(".idx.tmp"), "wb") as out:
        out.write(HEADER + struct.pack("<QBQQ", 1, CODES[np.dtype(np.uint16)], len(ends), len(ends) + 1))
        out.write((ends - starts).astype(np.int32).tobytes())
        out.write((starts * 2).astype(np.int64).tobytes())
        out.write(np.arange(len(ends) + 1, dtype=np.int64).tobytes())
    prefix.with_suffix(".bin.tmp").replace(prefix.with_suffix(".bin"))
    prefix.with_suffix(".idx.tmp").replace(prefix.with_suffix(".idx"))
    return prefix


def first_sample(path: Path, prefix: Path) -> dict:
    """Time to the first sample: megatron-core's ``GPTDataset`` (one epoch of samples) against ours (the
    file described, the loader built, the first global batch of 8 rows read), side by side."""
    from megatron_baseline import gpt_dataset_times

    from raysc.data.loader import BatchLoader
    from raysc.data.order import block_rows
    from raysc.data.streamed import token_rows

    t0 = time.perf_counter()
    rows, _ = token_rows([str(path)], 2048, np.dtype(np.uint16), VOCAB)
    BatchLoader(rows, 0, 8, 0, 1, block=block_rows(rows.seq_len, 1024)).next_batch()
    ours = time.perf_counter() - t0
    cache = Path(tempfile.mkdtemp(prefix="gpt-index-"))
    try:
        theirs = gpt_dataset_times(str(prefix), 2048, len(rows), str(cache))
    except Exception as e:  # noqa: BLE001 (reported, the rest of the benchmark goes on)
        theirs = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"raysc_first_sample_s": round(ours, 4), "megatron_gpt_dataset": theirs}


def loader_alone(rows, batches: int = 200) -> dict:
    """Tokens per second and resident-memory growth of ``BatchLoader`` over ``rows`` (dp 1, 8 rows a batch)."""
    from raysc.data.loader import BatchLoader
    from raysc.data.order import block_rows

    rss0 = _rss()
    loader = BatchLoader(rows, 0, 8, 0, 1, block=block_rows(rows.seq_len, 1024))
    loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    dt = time.perf_counter() - t0
    return {
        "tokens_per_s": round(batches * 8 * (rows.seq_len + 1) / dt),
        "loader_rss_mb": round((_rss() - rss0) / 1e6, 1),
    }


def s3_loader(path: Path) -> dict:
    """Two ranks' loaders over ``path`` in the local S3 server: GETs per MiB delivered, read amplification."""
    import pickle

    import boto3
    from common import S3_KEY, S3_REGION, S3_SECRET, LatencyProxy, start_s3

    from raysc.data.loader import BatchLoader
    from raysc.data.order import block_rows
    from raysc.data.streamed import token_rows

    server, endpoint, bucket = start_s3()
    try:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name=S3_REGION,
        ).upload_file(str(path), bucket, "tokens.npy")
        host, port = endpoint.removeprefix("http://").split(":")
        proxy = LatencyProxy((host, int(port)), float(os.environ.get("BENCH_DATA_S3_LATENCY_MS", "20")) / 1000)
        options = {"endpoint_url": proxy.endpoint, "key": S3_KEY, "secret": S3_SECRET}
        rows, _ = token_rows([f"s3://{bucket}/tokens.npy"], 2048, np.dtype(np.uint16), VOCAB, options)
        block = block_rows(2048, 1024)
        rows.read_unit = block
        copies = [pickle.loads(pickle.dumps(rows)) for _ in range(2)]
        loaders = [BatchLoader(copies[r], 0, 8, r, 2, block=block) for r in range(2)]
        t0 = time.perf_counter()
        for _ in range(block):  # one window
            for loader in loaders:
                loader.next_batch()
        dt = time.perf_counter() - t0
        used = sum(c.reader.stats.bytes_used for c in copies)
        fetched = sum(c.reader.stats.bytes_fetched for c in copies)
        gets = sum(c.reader.stats.requests for c in copies)
        return {
            "gets_per_mib": round(gets / (used / (1 << 20)), 3),
            "read_amplification": round(fetched / used, 3),
            "tokens_per_s": round(block * 8 * 2049 / dt),
            "latency_ms": proxy.delay_s * 1000,
        }
    finally:
        server.stop()


def _summary(runs: list[dict]) -> dict:
    """The median wall times, the largest memory growth and data wait of several ``train_run``s (or the
    first error)."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    return {
        "runs": len(runs),
        "first_step_s": statistics.median(r["first_step_s"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "memory_growth_gb": max(r["memory_growth_gb"] for r in runs),
        "data_wait_p99_ms": max(r["data_wait_p99_ms"] for r in runs),
    }


def describe_many(files: int) -> dict:
    """Start-up on a corpus of many files in the S3 server behind the latency proxy: ``files`` token files
    of 64 K tokens described (a HEAD, a header GET and a sample GET each) one at a time and
    ``DESCRIBE_THREADS`` at a time, side by side."""
    import io

    import boto3
    from common import S3_KEY, S3_REGION, S3_SECRET, LatencyProxy, start_s3

    from raysc.data import streamed

    server, endpoint, bucket = start_s3()
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name=S3_REGION,
        )
        rng = np.random.default_rng(0)
        for i in range(files):
            buf = io.BytesIO()
            np.save(buf, rng.integers(1, VOCAB, 1 << 16, dtype=np.uint16))
            client.put_object(Bucket=bucket, Key=f"tokens/part-{i:05d}.npy", Body=buf.getvalue())
        host, port = endpoint.removeprefix("http://").split(":")
        proxy = LatencyProxy((host, int(port)), float(os.environ.get("BENCH_DATA_S3_LATENCY_MS", "20")) / 1000)
        options = {"endpoint_url": proxy.endpoint, "key": S3_KEY, "secret": S3_SECRET}
        urls = streamed.list_token_files(f"s3://{bucket}/tokens", options)
        out = {"files": len(urls), "latency_ms": proxy.delay_s * 1000}
        default = streamed.DESCRIBE_THREADS
        for threads in (1, default):
            streamed.DESCRIBE_THREADS = threads
            t0 = time.perf_counter()
            streamed.token_rows(urls, 2048, np.dtype(np.uint16), VOCAB, options)
            out[f"describe_s_{threads}_threads"] = round(time.perf_counter() - t0, 2)
        streamed.DESCRIBE_THREADS = default
        return out
    finally:
        server.stop()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from raysc.data.streamed import token_rows

    sizes = [int(float(x)) for x in os.environ.get("BENCH_DATA_SIZES", "1e7,1.6e9").split(",")]
    tok = tokenizer()
    out: dict = {"sizes": {}}
    for tokens in sizes:
        path = corpus(tokens)
        rows, _ = token_rows([str(path)], 2048, np.dtype(np.uint16), VOCAB)
        res = {"file_gb": round(path.stat().st_size / 1e9, 2), "loader": loader_alone(rows)}
        res["first_sample"] = first_sample(path, megatron_copy(path))
        runs = [train_run(path, tok) for _ in range(int(os.environ.get("BENCH_DATA_REPEATS", "3")))]
        res["train"] = _summary(runs)
        if os.environ.get("BENCH_DATA_S3") == "1" and tokens <= 2e8:
            res["s3"] = s3_loader(path)
        out["sizes"][str(tokens)] = res
        print(json.dumps({str(tokens): res}), flush=True)
    firsts = [r["train"].get("first_step_s") for r in out["sizes"].values()]
    if len(firsts) >= 2 and all(firsts):
        out["first_step_ratio_largest_to_smallest"] = round(firsts[-1] / firsts[0], 3)
    if os.environ.get("BENCH_DATA_S3") == "1":
        out["describe_many_files"] = describe_many(int(os.environ.get("BENCH_DATA_FILES", "256")))
        print(json.dumps({"describe_many_files": out["describe_many_files"]}), flush=True)
    out["median_loader_tokens_per_s"] = statistics.median(r["loader"]["tokens_per_s"] for r in out["sizes"].values())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
