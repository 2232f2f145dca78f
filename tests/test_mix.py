"""Mixture tuning (``raysc mix tune``): the proposal distribution, the regression and its search on
losses of known shape, and the command end to end on the packed bundled corpus."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from raysc.config.syntax import parse_schedule
from raysc.mix import proposals, regression


def test_dirichlet_mixtures_centre_on_the_natural_shares_and_respect_the_floor():
    natural = {"code": 0.2, "prose": 0.5, "web": 0.3}
    w = proposals.dirichlet_mixtures(natural, 20_000, 4.0, seed=3, floor=0.01)
    assert w.shape == (20_000, 3) and np.allclose(w.sum(axis=1), 1.0) and w.min() >= 0.01 - 1e-12
    assert np.allclose(w.mean(axis=0), [0.2, 0.5, 0.3], atol=0.01)  # names in order: code, prose, web
    assert np.array_equal(w, proposals.dirichlet_mixtures(natural, 20_000, 4.0, seed=3, floor=0.01))
    wide = proposals.dirichlet_mixtures(natural, 20_000, 1.0, seed=3, floor=0.01)
    assert wide.std(axis=0).min() > w.std(axis=0).max() * 0.9  # smaller concentration = wider
    with pytest.raises(ValueError, match="floor"):
        proposals.dirichlet_mixtures(natural, 2, 4.0, seed=0, floor=0.4)


def test_schedules_parse_and_the_two_phase_one_switches_where_asked():
    names = ["code", "prose"]
    one = parse_schedule(proposals.schedule(names, np.array([0.25, 0.75])))
    assert len(one) == 1 and one[0].weights == pytest.approx({"code": 0.25, "prose": 0.75})
    two = parse_schedule(proposals.two_phase_schedule(names, np.array([0.5, 0.5]), np.array([0.1, 0.9]), 40960))
    assert [p.start_tokens for p in two] == [0, 40960]
    assert two[1].weights == pytest.approx({"code": 0.1, "prose": 0.9})


def _draws(n: int, seed: int) -> np.ndarray:
    return proposals.dirichlet_mixtures({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, n, 4.0, seed)


def test_regression_recovers_a_diminishing_returns_optimum():
    """Loss = 3 − Σ a_d log w_d has its optimum at w ∝ a = (0.6, 0.3, 0.1): from 12 noisy proxies the
    fit picks the log-linear model and the search lands near that optimum, inside the simplex."""
    rng = np.random.default_rng(0)
    w = _draws(12, seed=1)
    a = np.array([0.6, 0.3, 0.1])
    y = 3 - np.log(w) @ a + rng.normal(0, 0.002, len(w))
    best, fits = regression.choose(w, y)
    assert best.kind == "loglinear" and fits["loglinear"].loo_rmse < fits["linear"].loo_rmse
    assert best.loo_spearman > 0.9
    tuned, predicted = regression.best_mixture(best, _draws(100_000, seed=2), top_k=100)
    assert np.allclose(tuned, a, atol=0.08), tuned
    assert predicted < float(best.predict(np.full(3, 1 / 3))[0])


def test_regression_keeps_a_linear_optimum_where_proxies_were_trained():
    """Loss linear in the weights (domain c best) is fitted by the linear model; the answer moves
    toward c but stays inside the range of shares the proxies trained on, not the untried corner."""
    w = _draws(10, seed=4)
    y = w @ np.array([4.0, 3.8, 3.2])
    best, _ = regression.choose(w, y)
    assert best.kind == "linear" and best.loo_rmse < 1e-3
    tuned, _ = regression.best_mixture(best, regression.within(_draws(100_000, seed=5), w), top_k=100)
    assert tuned.argmax() == 2 and tuned[2] > 0.5
    assert np.all(tuned >= w.min(axis=0) - 1e-9) and np.all(tuned <= w.max(axis=0) + 1e-9)
    corner, _ = regression.best_mixture(best, _draws(100_000, seed=5), top_k=100)
    assert corner[2] > w[:, 2].max()  # without the range, the answer leaves what any proxy tried
    with pytest.raises(ValueError, match="at least 6"):
        regression.choose(w[:5], y[:5])


def test_mix_tune_end_to_end_on_the_packed_corpus(packed_corpus, make_cfg, tmp_path):
    """Five proxies of 16 steps on prose and code, target prose, then one validation seed: the files
    are written, the tuned mixture is a schedule `raysc train` accepts and leans toward the target,
    the fitted predictions are the ones plotted, and a second call reuses every finished run."""
    from raysc.mix.tune import TuneOptions, tune_mixture

    overrides = [
        f'data.source="{packed_corpus["packed"]}"',
        "data.val_fraction=0.05",
        "optim.lr=5e-3",
        "checkpoint.async=false",
    ]
    cfg = make_cfg(*overrides, run="mix")
    base = _overrides_of(cfg, overrides)
    # as many at once as the machine has cores: the session's Ray counts 8 CPUs, and five proxies starting
    # at once on 2 cores beside the other lane overran the 60 s start bound in a CI run
    opts = TuneOptions(
        target="prose",
        proxies=5,
        steps=16,
        validate_seeds=[1],
        eval_rows=16,
        out=str(tmp_path / "t"),
        concurrency=os.cpu_count() or 1,
    )
    lines: list[str] = []
    report = tune_mixture(None, base, opts, log=lines.append)
    out = tmp_path / "t"
    assert json.loads((out / "mix_tune.json").read_text())["schedule"] == report["schedule"]
    assert (out / "predicted_vs_measured.png").stat().st_size > 10_000
    fragment = (out / "schedule.toml").read_text()
    assert f'schedule = "{report["schedule"]}"' in fragment and report["two_phase_schedule"] in fragment
    weights = parse_schedule(report["schedule"], ["code", "prose"])[0].weights
    natural = report["natural"]
    assert report["proxies"][0]["weights"] == pytest.approx(natural, abs=1e-6)
    assert all(set(p["losses"]) == {"code", "prose"} and not p["reused"] for p in report["proxies"])
    assert weights["prose"] > natural["prose"]  # more of the target domain lowers its loss
    v = report["validation"]
    assert set(v["arms"]) == {"natural", "tuned", "two_phase"} and v["tuned_lower_on_target"], v
    assert v["tuned_minus_natural"]["code"] > 0  # the trade-off: less code, worse code loss
    assert sum("left" in line for line in lines) == 5 + 3  # one progress line per run
    again = tune_mixture(None, base, opts, log=lambda *_: None)
    assert all(p["reused"] for p in again["proxies"]) and again["schedule"] == report["schedule"]


def _overrides_of(cfg, extra: list[str]) -> list[str]:
    """The make_cfg overrides as a list (TINY, the cache and run directories, then ``extra``)."""
    from conftest import TINY

    return [*TINY, f'data.cache_dir="{cfg.data.cache_dir}"', f'run.dir="{cfg.run_dir}"', *extra]


def test_heldout_rows_are_the_validation_split_training_holds_out(tmp_path):
    """Each domain's first held-out rows are the rows training's split holds out, read from only
    the shards that contain them (a domain's later shards are never opened)."""
    from raysc.config import load_config
    from raysc.data.packing import split_rows
    from raysc.mix.proxies import heldout_rows

    index = {"domains": {}}
    full = {}
    for d, base in (("code", 0), ("prose", 10_000)):
        shards = [np.arange(base + 100 * i, base + 100 * (i + 1))[:, None].repeat(3, axis=1) for i in range(4)]
        names = []
        for i, rows in enumerate(shards):
            np.save(tmp_path / f"{d}-{i}.npy", rows)
            names.append(f"{d}-{i}.npy")
        index["domains"][d] = {"shards": names, "tokens": 1, "sequences": 400}
        full[d] = np.concatenate(shards)
    index["domains"]["prose"]["shards"][3] = "missing.npy"  # never read: rows 0..159 lie in shards 0-1
    (tmp_path / "index.json").write_text(json.dumps(index))
    cfg = load_config(None, [f'data.source="{tmp_path}"', "data.val_fraction=0.25"])
    rows = heldout_rows(cfg, max_rows=40)
    for d in ("code", "prose"):
        want = split_rows(full[d], 0.25)[1][:40]
        assert rows[d].shape == (40, 3) and np.array_equal(rows[d].numpy(), want)
    with pytest.raises(ValueError, match="val_fraction"):
        heldout_rows(load_config(None, [f'data.source="{tmp_path}"', "data.val_fraction=0"]), max_rows=4)


def test_mix_tune_refuses_bad_input_before_any_run(tmp_path, capsys):
    """Through the CLI: a plain corpus, an unknown target, too few proxies and no held-out split
    each stop with exit code 2 and a message naming the fix, before Ray or a proxy starts."""
    from raysc.cli import main

    packed = tmp_path / "packed"
    packed.mkdir()
    for d in ("code", "prose"):
        np.save(packed / f"{d}.npy", np.zeros((40, 65), dtype=np.int32))
    (packed / "index.json").write_text(
        json.dumps({"domains": {d: {"shards": [f"{d}.npy"], "tokens": 2600} for d in ("code", "prose")}})
    )
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\nsource = "{packed}"\nval_fraction = 0.1\n[run]\ndir = "{tmp_path / "run"}"\n')
    cases = [
        (["--set", 'data.source="bundled"'], "raysc pack"),
        (["--target", "poetry"], "['poetry'] are not in"),
        (["--proxies", "4"], "at least 5"),
        (["--set", "data.val_fraction=0"], "data.val_fraction > 0"),
    ]
    for extra, message in cases:
        args = ["mix", "tune", str(config), *(["--target", "prose"] if "--target" not in extra else []), *extra]
        assert main(args) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "run").exists()  # nothing written


def test_an_interrupt_cancels_the_queued_runs(monkeypatch, tmp_path):
    """Ctrl-C while proxies run: the queued ones never start, the interrupt reaches the caller."""
    import time

    from raysc.mix import proxies as px

    started: list[str] = []

    def fake_run(config_path, overrides, p, out_dir, rows):
        started.append(p.name)
        time.sleep(0.05)
        return {"name": p.name, "schedule": p.schedule, "losses": {"prose": 1.0}, "reused": False}

    def interrupt(_line: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(px, "run_one", fake_run)
    runs = [px.Proxy(f"p{i}", "0:prose=1", 0, 1) for i in range(8)]
    with pytest.raises(KeyboardInterrupt):
        px.run_all(None, [], runs, tmp_path, {}, concurrency=1, target="prose", log=interrupt)
    time.sleep(0.2)
    assert 1 <= len(started) <= 2, started  # the first, and at most the one its thread had picked up
