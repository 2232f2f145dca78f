"""The spike detector: NaN/Inf always flag; a loss above the band flags (one-sided); the grad norm
alone never does; a persistent new level is accepted after `patience` skips; the rollback policy
rolls back once per window; no flagged step on the demo config at its defaults; state round-trips."""

import json
import math
import random

import pytest

from raysc.train.stability import SpikeDetector, SpikeRollback


def _noise(d: SpikeDetector, n: int, rng: random.Random, loss: float = 3.0, grad: float = 1.0) -> None:
    for _ in range(n):
        assert d.check(loss + rng.gauss(0, 0.05), grad * math.exp(rng.gauss(0, 0.1))) is None


def test_flags_nonfinite_and_loss_spikes_not_noise_nor_progress():
    rng = random.Random(0)
    d = SpikeDetector(window=32, sigma=6.0, min_history=8)
    assert d.check(float("nan"), 1.0)["reason"] == "nonfinite"  # even before the warm-up
    assert d.check(3.0, float("inf"))["reason"] == "nonfinite"
    _noise(d, 100, rng)
    ev = d.check(3.0 * 1000, 1.0)
    assert ev["reason"] == "spike" and ev["z_loss"] > 6 and ev["consecutive"] == 1
    assert d.check(3.0, 1.0) is None and d.consecutive == 0
    # the gradient norm alone never skips an update (it is reported); a falling loss is progress
    assert d.check(3.0, 50.0) is None and d.last_z["grad_norm"] > 6
    assert d.check(0.5, 1.0) is None and d.last_z["loss"] < -6
    assert d.check(float("inf"), 1.0)["reason"] == "nonfinite"


def test_a_spike_does_not_widen_the_band_for_the_next():
    """Flagged values stay out of the window: after a 1000x spike a 1.5x one is still caught
    (a window that takes every value, as OLMo-core's does, would be blind to it for 128 steps)."""
    rng = random.Random(1)
    d = SpikeDetector(window=128, sigma=6.0, min_history=16)
    _noise(d, 150, rng)
    assert d.check(3000.0, 1.0)["reason"] == "spike"
    _noise(d, 5, rng)
    assert d.check(4.5, 1.0)["reason"] == "spike"


@pytest.mark.parametrize("patience", [1, 3, 5])
def test_a_sustained_loss_level_is_accepted_after_patience_skips(patience):
    """A legitimate upward shift of the loss level (a harder data phase, z ≈ 10 against the old
    band): exactly the first `patience` steps are skipped, then the level is accepted and the band,
    translated with its width, still catches a real spike at the new level."""
    rng = random.Random(2)
    d = SpikeDetector(window=128, sigma=6.0, min_history=16, patience=patience)
    _noise(d, 200, rng)
    flagged = [i for i in range(100) if d.check(3.5 + rng.gauss(0, 0.05), 1.0) is not None]
    assert flagged == list(range(patience))
    assert d.consecutive == 0 and d.run == []
    mean = sum(d.loss) / len(d.loss)
    assert abs(mean - 3.5) < 0.05  # the band moved to the new level ...
    assert d.check(3.5 * 10, 1.0)["reason"] == "spike"  # ... and kept its width


def test_the_level_shift_is_reported_on_the_step_that_accepts_it():
    rng = random.Random(3)
    d = SpikeDetector(window=64, sigma=6.0, min_history=16, patience=2)
    _noise(d, 64, rng)
    assert d.check(4.0, 1.0) and d.check(4.0, 1.0)
    assert d.check(4.0, 1.0) is None and d.shift["after_skips"] == 2 and d.shift["level_shift"] > 0.9
    assert d.check(4.0, 1.0) is None and d.shift is None


def test_nonfinite_is_never_accepted_as_a_level():
    d = SpikeDetector(window=32, sigma=6.0, min_history=8, patience=2)
    _noise(d, 40, random.Random(4))
    assert all(d.check(float("nan"), 1.0)["reason"] == "nonfinite" for _ in range(20))
    assert d.consecutive == 20


def test_a_rising_grad_norm_level_with_a_falling_loss_is_never_flagged():
    """The demo's shape (docs/resilience.md): the gradient norm climbs 20x as warm-up ends, with
    single-step jumps, while the loss falls."""
    rng = random.Random(5)
    d = SpikeDetector(window=128, sigma=6.0, min_history=16)
    for i in range(400):
        grad = (0.7 if i < 30 else 15.0) * math.exp(rng.gauss(0, 0.1)) * (20 if i == 27 else 1)
        assert d.check(7.6 - 3 * (1 - math.exp(-i / 60)) + rng.gauss(0, 0.1), grad) is None, i


def test_state_round_trip_gives_identical_decisions():
    a = SpikeDetector(window=16, sigma=3.0, min_history=4, patience=2)
    for i in range(20):
        a.check(2.0 + 0.01 * math.sin(i), 1.0 + 0.01 * math.cos(i))
    a.check(9.0, 1.0)  # mid-way through a flagged run
    b = SpikeDetector(window=16, sigma=3.0, min_history=4, patience=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # plain JSON data
    assert b.run == a.run == [9.0] and b.consecutive == 1
    for x in (2.0, 9.5, 9.2, 2.5, 9.0, 2.01):
        assert a.check(x, 1.0) == b.check(x, 1.0)
    assert a.state_dict() == b.state_dict()


def test_rollback_policy_rolls_back_once_per_window(make_cfg):
    """Trainer-level: three flagged steps raise SpikeRollback; after the restore (detector, loader,
    scheduler back to before them) the same flagged run is not rolled back again: it is skipped
    `patience` times and then accepted as a level, so the policy cannot loop."""
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    cfg = make_cfg("train.steps=40", 'supervisor.spike_policy="rollback"', "supervisor.spike_patience=3")
    packed, _, _ = prepare_data(cfg)
    t = Trainer(cfg, packed.train, measure_peak=False)
    for _ in range(20):
        assert t.train_step()["skipped"] is None
    saved = json.loads(json.dumps(t.detector.state_dict()))
    extra = t.extra_state()

    def flagged_run(n: int, factor: float = 50.0) -> list:
        out = []
        t.loss_hook = lambda loss: loss * factor  # a loss level `factor` times higher, sustained
        try:
            for _ in range(n):
                out.append(t.train_step())
        finally:
            t.loss_hook = None
        return out

    with pytest.raises(SpikeRollback) as e:
        flagged_run(3)
    assert (e.value.first_step, e.value.step) == (21, 23)
    t.load_extra_state(extra)
    t.detector.load_state_dict(saved)
    again = flagged_run(4)  # the same window after the "restore": no second rollback
    assert [m["skipped"] is not None for m in again] == [True, True, True, False]
    assert again[-1]["level_shift"]["after_skips"] == 3
    # a new flagged run after the rolled-back window is rolled back again
    t.train_step()
    with pytest.raises(SpikeRollback) as e:
        flagged_run(3, 1e4)
    assert e.value.first_step == 26


def test_no_flagged_step_on_the_demo_config_at_its_defaults(tmp_path):
    """The shipped demo (raysc/demo.toml, unchanged: lr 3e-3, warm-up 40, clip 1.0, the default
    detector and skip policy), its first 100 of 400 steps in the single-process loop: the old
    detector skipped steps 28-36 here (a 20x grad-norm jump at step 28 with a falling loss)."""
    from pathlib import Path

    import torch

    from raysc.config import load_config
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "raysc/demo.toml", [f'data.cache_dir="{root / ".cache/raysc"}"', f'run.dir="{tmp_path}"'])
    assert cfg.supervisor.spike_policy == "skip" and cfg.optim.lr == 3e-3  # the defaults, not tuned ones
    # one intra-op thread: beside the other lane a 2-thread team spins at its barriers (77 s of CPU against
    # 31 s for the same steps; docs/operations.md, "Where the suite's time goes")
    torch.set_num_threads(1)
    packed, _, _ = prepare_data(cfg)
    t = Trainer(cfg, packed.train, measure_peak=False)
    ms = [t.train_step() for _ in range(100)]
    assert [m["step"] for m in ms if m["skipped"] or "level_shift" in m] == []
    grads = sorted(m["grad_norm"] for m in ms)
    assert grads[-1] > 8 * grads[len(grads) // 2]  # the hard case is in these steps
    assert ms[-1]["loss"] < ms[0]["loss"] - 1.5
