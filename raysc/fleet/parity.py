"""The parity harness: does a parallel layout reproduce single-process training?

Runs the same config (seed, data, global batch) twice through the fleet — once at
world size 1, once under the given layout — and compares per-step loss and
grad norm and the final parameters (each checkpoint loaded into one full model,
DCP resharding whatever layout wrote it). A value matches when its relative
difference is at most ``rtol``; for a parameter tensor that is ‖a − b‖₂ / ‖a‖₂.
(An element-wise maximum would be the wrong yardstick: Adam divides each
gradient element by its own running RMS, so an element whose gradient is ~0
turns summation-order noise of a different batch split into a full-size update
of either sign; such elements are few, and the tensor norm weighs them by size.)

``raysc parity CONFIG --layout pp=2,tp=2`` prints the comparison and exits
non-zero on a mismatch; the tests run the layouts listed in docs/parallelism.md.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from raysc.config.load import ConfigError, load_config
from raysc.config.schema import ParallelConfig
from raysc.export.restore import load_run
from raysc.fleet.records import read_jsonl

LAYOUT_KEYS = {f.name for f in dataclasses.fields(ParallelConfig)} - {"device", "cpus_per_worker"}


def layout_overrides(layout: str) -> list[str]:
    """'pp=2,tp=2,pp_schedule=gpipe' -> ['parallel.pp=2', 'parallel.tp=2', 'parallel.pp_schedule="gpipe"']."""
    out = []
    for item in (x.strip() for x in layout.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ConfigError(f"--layout {layout!r}: {item!r} is not key=value (e.g. pp=2,tp=2)")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout: unknown key {key!r}; use {', '.join(sorted(LAYOUT_KEYS))}")
        if not value.lstrip("-").isdigit() and value not in ("true", "false"):
            value = f'"{value}"'
        out.append(f"parallel.{key}={value}")
    return out


@dataclass
class ParityReport:
    layout: str
    rtol: float
    steps: list[dict] = field(default_factory=list)
    params: dict[str, float] = field(default_factory=dict)
    run_dir: str = ""  # the layout's run (its events.jsonl holds the ``layout`` event)

    @property
    def worst_param(self) -> tuple[str, float]:
        return max(self.params.items(), key=lambda kv: kv[1]) if self.params else ("", 0.0)

    @property
    def ok(self) -> bool:
        steps_ok = all(s["loss_rel"] <= self.rtol and s["grad_norm_rel"] <= self.rtol for s in self.steps)
        return bool(self.steps) and steps_ok and self.worst_param[1] <= self.rtol

    def table(self) -> str:
        lines = [
            f"parity of {self.layout} against world size 1 (rtol {self.rtol:g})",
            "step  loss(ref)      loss(layout)   rel       grad_norm(ref) grad_norm(layout) rel",
        ]
        for s in self.steps:
            lines.append(
                f"{s['step']:4d}  {s['loss_ref']:.8f}  {s['loss']:.8f}  {s['loss_rel']:.1e}   "
                f"{s['grad_norm_ref']:.8f}     {s['grad_norm']:.8f}        {s['grad_norm_rel']:.1e}"
            )
        name, worst = self.worst_param
        lines.append(f"final parameters: {len(self.params)} tensors, worst {name} rel {worst:.1e}")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare_runs(ref_dir: Path, got_dir: Path, layout: str, rtol: float) -> ParityReport:
    ref = {m["step"]: m for m in read_jsonl(ref_dir / "metrics.jsonl")}
    got = {m["step"]: m for m in read_jsonl(got_dir / "metrics.jsonl")}
    report = ParityReport(layout, rtol, run_dir=str(got_dir))
    for step in sorted(ref):
        if step not in got:
            report.steps.append(
                {
                    "step": step,
                    "loss_ref": ref[step]["loss"],
                    "loss": float("nan"),
                    "loss_rel": float("inf"),
                    "grad_norm_ref": ref[step]["grad_norm"],
                    "grad_norm": float("nan"),
                    "grad_norm_rel": float("inf"),
                }
            )
            continue
        a, b = ref[step], got[step]
        report.steps.append(
            {
                "step": step,
                "loss_ref": a["loss"],
                "loss": b["loss"],
                "loss_rel": _rel(a["loss"], b["loss"]),
                "grad_norm_ref": a["grad_norm"],
                "grad_norm": b["grad_norm"],
                "grad_norm_rel": _rel(a["grad_norm"], b["grad_norm"]),
            }
        )
    ma, mb = load_run(ref_dir).model, load_run(got_dir).model
    pb = dict(mb.named_parameters())
    for name, p in ma.named_parameters():
        report.params[name] = (
            torch.linalg.vector_norm(p - pb[name]) / torch.linalg.vector_norm(p).clamp_min(1e-12)
        ).item()
    return report


def _common(overrides: list[str], steps: int) -> list[str]:
    """A parity run is a measurement: no periodic checkpoints, no injected faults, and no warm spares
    (an idle process per rank that a run without faults never uses; on a small machine their start-up
    competes with the ranks being compared)."""
    return [
        *overrides,
        f"train.steps={steps}",
        "checkpoint.every_steps=0",
        'supervisor.inject=""',
        "supervisor.warm_spares=false",
    ]


def ensure_reference(
    config: str | Path | None, overrides: list[str], steps: int, ref_dir: Path, progress: bool = False
) -> Path:
    """The world-size-1 run of ``config`` + ``overrides`` in ``ref_dir``, trained unless it is
    there. Whoever calls first decides its overrides: callers that share a ``ref_dir`` train it
    up front with the plain overrides (a layout run with extra overrides would otherwise do it)."""
    from raysc.fleet.driver import train

    if not (ref_dir / "metrics.jsonl").is_file():
        train(
            load_config(config, [*_common(overrides, steps), f'run.dir="{ref_dir}"']), progress=progress, overwrite=True
        )  # a reference that never finished is scratch
    return ref_dir


def run_parity(
    config: str | Path | None,
    layout: str,
    overrides: list[str] = (),
    steps: int = 10,
    rtol: float = 1e-4,
    work_dir: str | Path = "runs/parity",
    ref_dir: str | Path | None = None,
    progress: bool = False,
) -> ParityReport:
    """Train the reference (unless ``ref_dir`` holds one) and the layout, then compare."""
    from raysc.fleet.driver import train

    work = Path(work_dir)
    common = _common(overrides, steps)
    ref_path = ensure_reference(config, overrides, steps, Path(ref_dir) if ref_dir else work / "reference", progress)
    name = layout.replace(",", "_").replace("=", "") or "single"
    got_path = work / name
    # the layout's run directory is this harness's scratch: a run of the same layout before (other
    # overrides) left a committed final checkpoint there, which a fresh run would not overwrite
    shutil.rmtree(got_path, ignore_errors=True)
    cfg = load_config(config, [*common, *layout_overrides(layout), f'run.dir="{got_path}"'])
    train(cfg, progress=progress)
    return compare_runs(ref_path, got_path, layout, rtol)
