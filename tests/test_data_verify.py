"""``raysc data verify``: the full read a user asks for, since a run identifies its corpus from metadata only.

- ``raysc pack`` records every file's size and SHA-256 in ``index.json``; ``verify`` reads the
  directory against them and names a shard whose bytes changed (same size: what a run's size check
  cannot see) and one that is missing, exit 1;
- a Megatron dataset and ``.npy`` token files: headers, sizes and every token id against
  ``model.vocab_size``; the truncated and the foreign file named.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from raysc.data import megatron

RAYSC = [sys.executable, "-m", "raysc.cli"]


def _verify(*args: str) -> tuple[int, dict]:
    done = subprocess.run([*RAYSC, "data", "verify", "--json", *args], capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_a_packed_directory_is_checked_against_the_checksums_pack_recorded(packed_corpus, tmp_path):
    index = packed_corpus["index"]
    shards = [s for d in index["domains"].values() for s in d["shards"]]
    assert shards and all(s in index["checksums"] for s in shards)
    assert all(s.removesuffix(".npy") + ".starts.npy" in index["checksums"] for s in shards)
    rc, out = _verify(packed_corpus["packed"])
    assert rc == 0 and out["ok"] and out["checksums_recorded"] and out["files"] == len(index["checksums"])
    copy = tmp_path / "packed"
    shutil.copytree(packed_corpus["packed"], copy)
    shard = copy / shards[0]
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 1  # one bit of one token: the size (all a run checks at start) is unchanged
    shard.write_bytes(bytes(blob))
    (copy / shards[-1]).unlink()
    rc, out = _verify(str(copy))
    assert rc == 1 and not out["ok"]
    problems = "\n".join(out["problems"])
    assert f"{shard} differs from what `raysc pack` wrote" in problems
    assert f"{copy / shards[-1]} is missing" in problems


def test_token_files_and_megatron_datasets_are_read_whole_and_bad_ones_named(tmp_path):
    ids = np.arange(3000, dtype=np.uint16) % 700
    np.save(tmp_path / "a.npy", ids)
    megatron.write_indexed(tmp_path / "m", [ids[:1000], ids[1000:]], np.uint16)
    config = tmp_path / "c.toml"
    config.write_text("[model]\nvocab_size = 1024\n")
    for source in ("a.npy", "m"):
        rc, out = _verify(str(tmp_path / source), "--config", str(config))
        assert rc == 0 and out["ok"] and out["bytes"] > 6000 and not out["checksums_recorded"]
    config.write_text("[model]\nvocab_size = 600\n")
    rc, out = _verify(str(tmp_path / "a.npy"), "--config", str(config))
    assert rc == 1 and f"{tmp_path / 'a.npy'} holds token id 699 but the vocabulary has 600" in out["problems"][0]
    bin_ = Path(tmp_path / "m.bin")
    bin_.write_bytes(bin_.read_bytes()[:100])
    rc, out = _verify(str(tmp_path / "m"))
    assert rc == 1 and f"{bin_} is truncated: 50 tokens, its index needs 3000" in out["problems"][0]
