"""The supervisor's router-collapse check (``raysc.fleet.router_watch``, issue 58): a collapsed router is
named (layer, dead and busiest experts) once per collapse and after a full window only, and a healthy
tiny MoE trained 300 steps at the shipped config's routing settings raises nothing at the defaults,
while the same model with its router forced onto two experts is named within one window."""

from __future__ import annotations

import pytest

from raysc.config import load_config
from raysc.fleet.router_watch import RouterWatch

WINDOW = 100  # supervisor.router_window's default


def test_a_collapse_is_named_once_after_a_full_window_and_again_only_after_recovering():
    sup = load_config(None).supervisor
    assert (sup.router_window, sup.router_collapse_load, sup.router_collapse) == (WINDOW, 0.6, "warn")
    watch = RouterWatch(window=4, collapse_load=0.6, top_k=2)
    collapsed = {"1": [500, 490, 10, 0, 0, 0, 0, 0], "3": [130, 120, 125, 128, 126, 122, 124, 125]}
    found = [watch.observe(step, collapsed) for step in range(1, 9)]
    assert [len(f) for f in found] == [0, 0, 0, 1, 0, 0, 0, 0]  # a full window first; then said once
    [event] = found[3]
    assert event["step"] == 4 and event["layer"] == 1 and event["window_steps"] == 4
    assert event["dead_experts"] == [3, 4, 5, 6, 7] and event["busiest_experts"] == [0, 1]
    assert event["busiest_share"] == pytest.approx(990 / 1000)
    healthy = {"1": [125] * 8}
    assert not any(watch.observe(step, healthy) for step in range(9, 13))  # a healthy window re-arms
    assert [e["layer"] for s in range(13, 17) for e in watch.observe(s, collapsed)] == [1]
    # the busiest expert at 3.2x the mean every step (the worst for 8 experts top-2 is 4), nobody dead
    skewed = {"2": [400, 200, 100, 100, 100, 50, 49, 1]}
    assert [e["layer"] for s in range(4) for e in watch.observe(s, skewed)] == [2]
    # a fleet healed back to step 4 keeps the window's steps up to 4: the collapse is named at the same
    # step as without the restart (7, its window 4..7); not at 5 (the lost steps counted twice), nor at 8
    # (a window started afresh)
    fresh = RouterWatch(window=4, collapse_load=0.6, top_k=2)
    for step in range(1, 7):
        assert not fresh.observe(step, healthy if step < 4 else collapsed)
    fresh.rewind(4)  # steps 5 and 6 are lost: they run again
    assert not fresh.observe(5, collapsed) and not fresh.observe(6, collapsed)
    [again] = fresh.observe(7, collapsed)
    assert again["step"] == 7 and again["layer"] == 1


def _train(cfg, steps: int, collapse: bool) -> list[dict]:
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    packed, _, _ = prepare_data(cfg)
    t = Trainer(cfg, packed.train, measure_peak=False)
    if collapse:  # every token chooses experts 0 and 1: a selection bias no score can beat (and no update)
        t.model.layers["1"].mlp.router.expert_bias[:2] = 10.0
    return [t.train_step() for _ in range(steps)]


def test_a_healthy_moe_raises_nothing_in_300_steps_and_a_forced_collapse_is_named(make_cfg, one_torch_thread):
    """The routing of jobs/configs/tiny-moe.toml (8 experts, top-2, the switch loss and z-loss) on the
    tiny shape: 300 steps, every step's counts to a watch at the defaults: no event. The router of layer
    1 fixed on experts 0 and 1: named within one window, at its first full window."""
    shipped = load_config("jobs/configs/tiny-moe.toml").model
    moe = [
        f"model.{k}={getattr(shipped, k)}"
        for k in ("moe_experts", "moe_top_k", "moe_first_dense_layers", "moe_aux_loss_coeff", "moe_z_loss_coeff")
    ]
    cfg = make_cfg(*moe, "model.moe_ffn_dim=64", "train.steps=300")
    sup = cfg.supervisor
    healthy = RouterWatch(sup.router_window, sup.router_collapse_load, cfg.model.moe_top_k)
    steps = _train(cfg, 300, collapse=False)
    alarms = [e for m in steps for e in healthy.observe(m["step"], m["moe_tokens"])]
    loads = [m["moe_load_max"] for m in steps]
    print(f"healthy: load max/mean median {sorted(loads)[150]:.2f}, max {max(loads):.2f}; alarms {alarms}")
    assert alarms == []
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    forced = RouterWatch(sup.router_window, sup.router_collapse_load, cfg.model.moe_top_k)
    steps = _train(cfg, WINDOW, collapse=True)
    found = [e for m in steps for e in forced.observe(m["step"], m["moe_tokens"])]
    assert [(e["step"], e["layer"], e["busiest_experts"]) for e in found] == [(WINDOW, 1, [0, 1])], found
    assert found[0]["busiest_share"] == 1.0 and found[0]["dead_experts"] == [2, 3, 4, 5, 6, 7]
