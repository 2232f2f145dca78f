"""MinHash signatures and LSH (``raysc.curate.minhash``): both schemes against their definitions in Python
integers, their Jaccard estimates against exact Jaccard, LSH candidate rates against theory."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from conftest import mutate_words
from raysc.curate.minhash import MinHasher, candidate_probability, jaccard


@pytest.mark.parametrize("scheme", ["one_permutation", "k_permutations"])
@pytest.mark.parametrize("length", [400, 30])  # 30 words: 26 shingles in 112 bins, most bins densified
def test_minhash_estimates_jaccard_and_lsh_follows_theory(scheme, length):
    rng = random.Random(0)
    base = [" ".join(f"w{rng.randrange(5000)}" for _ in range(length)) for _ in range(80)]
    mh = MinHasher(scheme=scheme)
    assert np.array_equal(mh.signatures(base[:3]), MinHasher(scheme=scheme).signatures(base[:3]))  # deterministic
    sent = pickle.dumps(mh)  # as Ray sends it to the read tasks: its parameters, the same signatures
    assert len(sent) < 1000 and np.array_equal(pickle.loads(sent).signatures(base[:3]), mh.signatures(base[:3]))
    for frac in (0.01, 0.05, 0.3):
        pairs = [(b, mutate_words(b, frac, rng)) for b in base]
        sig = mh.signatures([t for p in pairs for t in p])
        est = (sig[0::2] == sig[1::2]).mean(axis=1)
        exact = np.array([jaccard(a, b) for a, b in pairs])
        assert abs((est - exact).mean()) < 0.03, frac  # unbiased
        assert np.abs(est - exact).mean() < 0.05, frac
        keys = mh.band_keys(sig)
        candidates = (keys[0::2] == keys[1::2]).any(axis=1).mean()
        assert abs(candidates - candidate_probability(exact, 14, 8).mean()) < 0.15, frac
    unrelated = mh.signatures(base[:40])
    assert (unrelated[0::2] == unrelated[1::2]).mean() < 0.02  # Jaccard ~0: (nearly) no value in common
    assert (mh.signatures(["same words here", "same words here"])[0] == mh.signatures(["same words here"])[0]).all()
    with pytest.raises(ValueError, match="bands × dedup.rows must equal"):
        MinHasher(num_perm=100, bands=14, rows=8)
    with pytest.raises(ValueError, match="dedup.minhash = 'oph': use one of one_permutation, k_permutations"):
        MinHasher(scheme="oph")


def _texts_and_small_slices(monkeypatch) -> list[str]:
    """Documents of 0 to 3,000 words, hashed 2 at a time (``signatures`` works in slices of documents)."""
    import raysc.curate.minhash as minhash

    monkeypatch.setattr(minhash, "_DOCS_PER_SLICE", 2)
    rng = random.Random(1)
    return [" ".join(f"w{rng.randrange(300)}" for _ in range(n)) for n in (0, 3, 5, 40, 3000, 7, 1)]


def test_signatures_are_the_min_of_each_multiply_shift_hash(monkeypatch):
    """k_permutations: each signature value is min over the document's shingles of ((a·h + b) mod 2^64) >> 32,
    as Python integers compute it: the vectorised blocks (here several: one document longer than a block),
    the slices of documents and the shift taken after the minimum change no value."""
    texts = _texts_and_small_slices(monkeypatch)
    mh = MinHasher(scheme="k_permutations")
    hashes, starts = mh.shingle_hashes(texts)
    ends = [*starts[1:], len(hashes)]
    want = [
        [min(((int(a) * int(h) + int(b)) % 2**64) >> 32 for h in hashes[lo:hi]) for a, b in zip(mh._a, mh._b)]
        for lo, hi in zip(starts, ends)
    ]
    assert mh.signatures(texts).tolist() == want


def _mix(x: int) -> int:
    """splitmix64's finaliser, in Python integers."""
    m = 2**64 - 1
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 & m
    x ^= x >> 27
    x = x * 0x94D049BB133111EB & m
    return x ^ x >> 31


def test_one_permutation_signatures_follow_their_definition(monkeypatch):
    """one_permutation, as Python integers compute it: a shingle's mixed hash picks bin (high 32 bits × k)
    >> 32 and offers its low 32 bits (2^32 - 1 taken as 2^32 - 2); a bin keeps the minimum; an empty bin
    copies the first bin of its sequence (``_jump``) that has a shingle of its own. Documents of 1 to 3,000
    shingles (the short ones: nearly every bin copied)."""
    texts = _texts_and_small_slices(monkeypatch)
    mh = MinHasher()
    hashes, starts = mh.shingle_hashes(texts)
    ends = [*starts[1:], len(hashes)]
    k, want = mh.num_perm, []
    for lo, hi in zip(starts, ends):
        own: dict[int, int] = {}
        for h in hashes[lo:hi]:
            x = _mix(int(h) ^ int(mh._key))
            b = ((x >> 32) * k) >> 32
            own[b] = min(own.get(b, 2**32), min(x & 0xFFFFFFFF, 2**32 - 2))
        want.append([own[i] if i in own else own[next(int(j) for j in mh._jump[i] if int(j) in own)] for i in range(k)])
    got = mh.signatures(texts)
    assert got.tolist() == want
    assert len(set(got[-1].tolist())) == 1 and len(set(got[3].tolist())) > 20  # 1 shingle: every bin its value
