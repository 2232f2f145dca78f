"""``raysc mix tune``: a domain mixture chosen on evidence, and checked before anyone trusts it.

1. The domains of ``data.source`` (a ``raysc pack`` directory) and their natural token shares.
2. ``proxies`` runs of the config for ``steps`` steps, the first on the natural mixture and the rest
   on mixtures drawn around it (``proposals.dirichlet_mixtures``), all with the config's seed so that
   only the mixture differs; up to ``concurrency`` at once on the cluster (``proxies.run_all``).
3. Each proxy's held-out loss per domain; a regression of the ``target`` domain's loss on the mixture
   (``regression.choose``) and the best mixture it predicts (``regression.best_mixture``).
4. The fragments: ``schedule`` (the tuned mixture throughout) and ``two_phase_schedule`` (natural
   early, tuned for the last ``late_fraction`` of the config's tokens), in ``schedule.toml``.
5. Validation ("always validate on a small scale first"): fresh runs of the natural, tuned and
   two-phase schedules for ``validate_steps`` on each seed of ``validate_seeds``, every domain's
   held-out loss reported so the trade-off is visible.
6. ``mix_tune.json`` (everything above) and ``predicted_vs_measured.png``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import numpy as np

from raysc.config.load import load_config
from raysc.config.schema import Config
from raysc.data.shards import read_index
from raysc.fleet.errors import RunFailed
from raysc.mix import proposals, regression
from raysc.mix.plot import predicted_vs_measured
from raysc.mix.proxies import Proxy, heldout_rows, run_all

ARMS = ("natural", "tuned", "two_phase")


@dataclass
class TuneOptions:
    target: str
    domains: list[str] = field(default_factory=list)  # empty = every domain of the data
    proxies: int = 12
    steps: int = 0  # 0 = the config's train.steps
    concentration: float = 4.0
    seed: int = 0  # of the mixture draws
    candidates: int = 100_000
    top_k: int = 100
    late_fraction: float = 0.2
    validate_seeds: list[int] = field(default_factory=lambda: [1])
    validate_steps: int = 0  # 0 = steps
    eval_rows: int = 64
    concurrency: int = 0  # 0 = as many as the cluster's CPUs (GPUs) hold
    out: str = ""  # "" = <run.dir>/mix_tune


def auto_concurrency(cfg: Config) -> int:
    """Proxies the cluster runs at once: its CPUs (GPUs on cuda) over one run's need."""
    import ray

    res = ray.cluster_resources()
    n = int(res.get("CPU", 1) // max(1, cfg.parallel.cpus_per_worker * cfg.parallel.world_size))
    if cfg.parallel.device == "cuda":
        n = min(n, int(res.get("GPU", 0) // cfg.parallel.world_size))
    return max(1, n)


def mixing_domains(cfg: Config, opts: TuneOptions) -> tuple[list[str], dict[str, float]]:
    index = read_index(cfg.data.source, dict(cfg.data.storage_options)) if cfg.data.source != "bundled" else None
    if index is None:
        raise ValueError(
            f"mix tune needs per-domain token shards, but data.source={cfg.data.source!r} is not a "
            f"`raysc pack` directory; run `raysc curate` and `raysc pack` and set data.source to it"
        )
    have = sorted(index["domains"])
    names = sorted(opts.domains) or have
    unknown = sorted(set(names + [opts.target]) - set(have))
    if unknown:
        raise ValueError(f"domain(s) {unknown} are not in {cfg.data.source}; it has {have}")
    if len(names) < 2:
        raise ValueError(f"mix tune needs at least two domains to mix; got {names}")
    return names, proposals.natural_weights({k: index["domains"][k]["tokens"] for k in names})


def tune_mixture(
    config_path: str | None, overrides: list[str], opts: TuneOptions, log: Callable[[str], None] = print
) -> dict:
    from raysc.cluster.fit import require_fleet_fit
    from raysc.fleet.driver import ensure_ray

    t0 = time.perf_counter()
    cfg = load_config(config_path, overrides)
    names, natural = mixing_domains(cfg, opts)
    steps = opts.steps or cfg.train.steps
    if opts.proxies < regression.min_proxies(len(names)):
        raise ValueError(
            f"--proxies {opts.proxies} is too few for {len(names)} domains; use at least "
            f"{regression.min_proxies(len(names))}"
        )
    if not 0 <= opts.late_fraction < 1:
        raise ValueError(f"--late-fraction must be in [0, 1), not {opts.late_fraction}")
    rows = heldout_rows(cfg, opts.eval_rows)
    out = Path(opts.out or f"{cfg.run_dir}/mix_tune")
    out.mkdir(parents=True, exist_ok=True)
    ensure_ray()
    require_fleet_fit("each proxy run", cfg.parallel, cfg.parallel.world_size, log=log)  # raysc.cluster.fit's rule
    concurrency = opts.concurrency or auto_concurrency(cfg)
    nat = np.array([natural[k] for k in names])
    mixtures = np.vstack([nat, proposals.dirichlet_mixtures(natural, opts.proxies - 1, opts.concentration, opts.seed)])
    proxies = [
        Proxy(f"proxy-{i:03d}", proposals.schedule(names, w), cfg.train.seed, steps) for i, w in enumerate(mixtures)
    ]
    log(
        f"mix: {len(proxies)} proxies of {steps} steps on {names} (natural {proposals.weights_text(names, nat)}), "
        f"{concurrency} at a time, target {opts.target!r} -> {out}"
    )
    results = run_all(config_path, overrides, proxies, out / "proxies", rows, concurrency, opts.target, log)
    ok = [i for i, r in enumerate(results) if "error" not in r]
    if len(ok) < regression.min_proxies(len(names)):
        errors = "; ".join(f"{r['name']}: {r['error']}" for r in results if "error" in r)
        raise RunFailed(
            f"only {len(ok)} of {len(results)} proxies finished, too few to fit {len(names)} domains "
            f"({errors}); their run directories are under {out / 'proxies'}"
        )
    w = mixtures[ok]
    y = np.array([results[i]["losses"][opts.target] for i in ok])
    best_fit, fits = regression.choose(w, y)
    candidates = proposals.dirichlet_mixtures(natural, opts.candidates, opts.concentration, opts.seed + 1)
    nat_predicted = float(best_fit.predict(nat)[0])
    tuned, predicted = regression.best_mixture(best_fit, regression.within(candidates, w), opts.top_k)
    if predicted >= nat_predicted:  # the fit predicts no gain: keep the natural mixture
        tuned, predicted = nat, nat_predicted
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    fragment = {
        "schedule": proposals.schedule(names, tuned),
        "two_phase_schedule": proposals.two_phase_schedule(
            names, nat, tuned, round((1 - opts.late_fraction) * cfg.train.steps * tokens_per_step)
        ),
    }
    log(
        f"mix: {best_fit.kind} fit (leave-one-out RMSE {best_fit.loo_rmse:.4f}, Spearman "
        f"{best_fit.loo_spearman:.2f}); tuned {proposals.weights_text(names, tuned)}, predicted {opts.target} "
        f"loss {predicted:.4f} vs natural {nat_predicted:.4f}"
    )
    report = {
        "config": config_path,
        "overrides": overrides,
        "target": opts.target,
        "domains": names,
        "natural": dict(zip(names, nat.round(6).tolist())),
        "steps": steps,
        "tokens_per_proxy": steps * tokens_per_step,
        "concentration": opts.concentration,
        "concurrency": concurrency,
        "proxies": [
            {
                **results[i],
                "weights": dict(zip(names, mixtures[i].round(6).tolist())),
                **({"loo_predicted": float(best_fit.loo[ok.index(i)])} if i in ok else {}),
            }
            for i in range(len(results))
        ],
        "fit": best_fit.summary(),
        "fits": {k: f.summary() for k, f in fits.items()},
        "tuned": {
            "weights": dict(zip(names, tuned.round(6).tolist())),
            "predicted_loss": predicted,
            "natural_predicted_loss": nat_predicted,
        },
        **fragment,
    }
    write_fragment(out / "schedule.toml", report, opts)
    if opts.validate_seeds:
        report["validation"] = validate(
            config_path, overrides, opts, names, nat, tuned, steps, rows, out, concurrency, tokens_per_step, log
        )
    validation_points = (
        [
            (
                f"{arm}, {report['validation']['steps']} steps",
                float(best_fit.predict(arm_w)[0]),
                report["validation"]["arms"][arm]["target_loss"],
            )
            for arm, arm_w in (("natural", nat), ("tuned", tuned))
        ]
        if opts.validate_seeds
        else []
    )
    report["plot"] = str(
        predicted_vs_measured(
            out / "predicted_vs_measured.png",
            y.tolist(),
            best_fit.loo.tolist(),
            best_fit.kind,
            opts.target,
            validation_points,
        )
    )
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "mix_tune.json").write_text(json.dumps(report, indent=1))
    return report


def validate(
    config_path: str | None,
    overrides: list[str],
    opts: TuneOptions,
    names: list[str],
    nat: np.ndarray,
    tuned: np.ndarray,
    steps: int,
    rows: dict,
    out: Path,
    concurrency: int,
    tokens_per_step: int,
    log: Callable[[str], None],
) -> dict:
    """Fresh runs of the natural, tuned and two-phase schedules on each seed, every domain scored."""
    v_steps = opts.validate_steps or steps
    switch = round((1 - opts.late_fraction) * v_steps * tokens_per_step)
    schedules = {
        "natural": proposals.schedule(names, nat),
        "tuned": proposals.schedule(names, tuned),
        "two_phase": proposals.two_phase_schedule(names, nat, tuned, switch),
    }
    runs = [Proxy(f"{arm}-seed{s}", schedules[arm], s, v_steps) for s in opts.validate_seeds for arm in ARMS]
    log(f"mix: validating {len(runs)} runs of {v_steps} steps (seeds {opts.validate_seeds})")
    results = {
        r["name"]: r
        for r in run_all(config_path, overrides, runs, out / "validation", rows, concurrency, opts.target, log)
    }
    failed = [r for r in results.values() if "error" in r]
    if failed:
        raise RunFailed(
            "validation run(s) failed: "
            + "; ".join(f"{r['name']}: {r['error']}" for r in failed)
            + f"; their run directories are under {out / 'validation'}"
        )
    arms = {}
    for arm in ARMS:
        per_seed = [results[f"{arm}-seed{s}"]["losses"] for s in opts.validate_seeds]
        arms[arm] = {
            "schedule": schedules[arm],
            "per_seed": per_seed,
            "mean": {d: mean(p[d] for p in per_seed) for d in sorted(per_seed[0])},
            "target_loss": mean(p[opts.target] for p in per_seed),
        }
    t = opts.target
    pairs = [
        (results[f"tuned-seed{s}"]["losses"][t], results[f"natural-seed{s}"]["losses"][t]) for s in opts.validate_seeds
    ]
    summary = {
        "steps": v_steps,
        "seeds": opts.validate_seeds,
        "arms": arms,
        **{
            f"{arm}_minus_natural": {d: arms[arm]["mean"][d] - arms["natural"]["mean"][d] for d in arms[arm]["mean"]}
            for arm in ("tuned", "two_phase")
        },
        "tuned_lower_on_target": arms["tuned"]["target_loss"] < arms["natural"]["target_loss"],
        "tuned_lower_every_seed": all(a < b for a, b in pairs),
    }
    log(
        "mix: validation, mean held-out loss per domain: "
        + "; ".join(f"{arm} " + ", ".join(f"{d} {x:.4f}" for d, x in arms[arm]["mean"].items()) for arm in ARMS)
    )
    return summary


def write_fragment(path: Path, report: dict, opts: TuneOptions) -> None:
    t = report["tuned"]
    path.write_text(
        f"# raysc mix tune: target {opts.target!r}, {len(report['proxies'])} proxies of {report['steps']} steps, "
        f"{report['fit']['kind']} fit (leave-one-out RMSE {report['fit']['loo_rmse']})\n"
        f"# predicted {opts.target} loss {t['predicted_loss']:.4f} (natural {t['natural_predicted_loss']:.4f}); "
        f"validate before a long run\n"
        f'[data]\nschedule = "{report["schedule"]}"\n'
        f"# two-phase variant: natural proportions first, the tuned mixture for the last "
        f"{opts.late_fraction:.0%} of the tokens\n"
        f'# schedule = "{report["two_phase_schedule"]}"\n'
    )
