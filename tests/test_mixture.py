"""The mixture loader: schedule prefixes within one sample, seeded per-domain epochs, the same global
stream at dp 1, 2 and 4 and across a resume (2 -> 4 -> 1), skip, and the prefetching wrapper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysc.config.syntax import parse_schedule
from raysc.data.mixture import MixtureLoader, Prefetcher

SEQ = 8


def _domains() -> dict[str, np.ndarray]:
    # every row starts with a tag: 1000 + domain index * 100 + row, so a batch says where it came from
    out = {}
    for i, (name, n) in enumerate((("code", 7), ("prose", 40), ("math", 13))):
        rows = np.zeros((n, SEQ + 1), dtype=np.int32)
        rows[:, 0] = 1000 + i * 1000 + np.arange(n)
        out[name] = rows
    return out


SCHEDULE = "0:prose=0.6,code=0.3,math=0.1; 800:prose=0.2,code=0.2,math=0.6"


def _loader(dp_rank=0, dp_size=1, batch=8) -> MixtureLoader:
    return MixtureLoader(
        _domains(),
        parse_schedule(SCHEDULE, list(_domains())),
        seed=7,
        global_batch=batch,
        tokens_per_sample=SEQ,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def test_every_prefix_meets_the_weights_within_one_sample_per_phase():
    loader = _loader()
    phases = parse_schedule(SCHEDULE)
    counts = {d: 0 for d in loader.names}
    phase, start = 0, 0
    for g in range(400):
        if phase + 1 < len(phases) and g * SEQ >= phases[phase + 1].start_tokens:
            phase, start, counts = phase + 1, g, {d: 0 for d in loader.names}
        domain, _ = loader._next_sample()
        counts[domain] += 1
        n = g - start + 1
        for d in loader.names:
            assert abs(counts[d] - phases[phase].weights.get(d, 0.0) * n) < 1.0, (g, d)
    assert phase == 1 and loader.epochs["code"] >= 2  # code (7 rows) ran out and started new epochs


def test_domain_epochs_are_seeded_permutations():
    loader = _loader()
    rows = [loader._next_sample() for _ in range(60)]
    code = [r for d, r in rows if d == "code"]
    assert sorted(code[:7]) == list(range(7)) and sorted(code[7:14]) == list(range(7))  # each epoch: all rows
    assert code[:7] != code[7:14]  # a new permutation per epoch
    again = _loader()
    assert [again._next_sample() for _ in range(60)] == rows  # deterministic


def _global(loaders) -> list[torch.Tensor]:
    return torch.cat([loader.next_batch() for loader in loaders])


def test_same_global_stream_at_any_dp_size_and_across_resume():
    single = _loader()
    ref = [single.next_batch() for _ in range(30)]
    for dp in (2, 4):
        loaders = [_loader(r, dp) for r in range(dp)]
        assert all(torch.equal(_global(loaders), ref[b]) for b in range(30))
    # 2 ranks for 10 batches, resume at 4 ranks for 10, then 1 rank
    two = [_loader(r, 2) for r in range(2)]
    got = [_global(two) for _ in range(10)]
    state = two[0].state_dict()
    four = [_loader(r, 4) for r in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    got += [_global(four) for _ in range(10)]
    one = _loader()
    one.load_state_dict(four[0].state_dict())
    got += [_global([one]) for _ in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    skipped = _loader()
    skipped.skip(25)
    assert torch.equal(skipped.next_batch(), ref[25])


def test_prefetcher_hands_out_the_same_batches_and_consumed_state():
    plain = _loader()
    ref = [plain.next_batch() for _ in range(12)]
    pre = Prefetcher(_loader(), depth=3)
    try:
        assert all(torch.equal(pre.next_batch(), ref[b]) for b in range(5))
        state = pre.state_dict()
        assert state["cursor"] == 5 * 8  # what was handed out, not what was prefetched
        pre.skip(2)  # the supervisor's skip_batches after a rollback
        assert pre.cursor == 7 * 8
        assert torch.equal(pre.next_batch(), ref[7])
        pre.load_state_dict(state)
        assert torch.equal(pre.next_batch(), ref[5])
    finally:
        pre.close()


def test_bad_schedules_are_explained():
    with pytest.raises(ValueError, match="phase starting at 0"):
        parse_schedule("100:prose=1")
    with pytest.raises(ValueError, match="unknown domain"):
        parse_schedule("0:poetry=1", ["prose", "code"])
    with pytest.raises(ValueError, match="TOKENS:domain=weight"):
        parse_schedule("0:prose")
