"""The spike detector: flags NaN/Inf always and |z| > sigma after its warm-up, keeps its state."""

import math
import random

from raysc.train.stability import SpikeDetector


def test_flags_nonfinite_spikes_and_not_noise():
    rng = random.Random(0)
    d = SpikeDetector(window=32, sigma=6.0, min_history=8)
    assert d.check(float("nan"), 1.0)["reason"] == "nonfinite"  # even before the warm-up
    for _ in range(100):
        assert d.check(3.0 + rng.gauss(0, 0.05), 1.0 + rng.gauss(0, 0.05)) is None
    ev = d.check(3.0 * 1000, 1.0)
    assert ev["reason"] == "spike" and ev["z_loss"] > 6 and ev["consecutive"] == 1
    assert d.check(3.0, 50.0)["consecutive"] == 2  # a grad-norm spike alone also counts
    assert d.check(3.0, 1.0) is None and d.consecutive == 0
    assert d.check(float("inf"), 1.0)["reason"] == "nonfinite"


def test_state_round_trip_gives_identical_decisions():
    a = SpikeDetector(window=16, sigma=3.0, min_history=4)
    for i in range(20):
        a.check(2.0 + 0.01 * math.sin(i), 1.0 + 0.01 * math.cos(i))
    b = SpikeDetector(window=16, sigma=3.0, min_history=4)
    b.load_state_dict(a.state_dict())
    for x in (2.0, 2.5, 9.0, 2.01):
        assert a.check(x, 1.0) == b.check(x, 1.0)
