"""Where a command's CPU goes on this machine, by process title: every process's CPU time sampled while
the command runs.

``python benchmarks/cpu_by_process.py [--period 1] -- pytest -q tests/test_training.py`` runs the command
and reads ``/proc/*/stat`` every ``--period`` seconds; each CPU-time increase since the last sample is
credited to the process's title at that moment (a Ray worker is ``default_worker.py`` while it starts,
``ray::IDLE``, then ``ray::TrainWorker.__init__`` while its actor imports, ``ray::TrainWorker.train`` ...),
so one process's life splits by what it was doing. Processes that were running before the command are
left out; a process born and gone between two samples is missed (a short period keeps that small).
Kernel threads and this machine's own agents show up too: compare them with an idle run. The last line
is JSON: the wall seconds, the command's exit status, CPU seconds by title, largest first, and for each
title its command lines (their first 160 characters) that took the most of its CPU, up to three (to
tell what a title such as ``raysc`` was).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time

TICK = os.sysconf("SC_CLK_TCK")
# first match wins: a raylet's command line names default_worker.py (the command it starts workers with)
KINDS = (
    "raylet/raylet",
    "gcs_server",
    "default_worker.py",
    "setup_worker.py",
    "dashboard/agent.py",
    "dashboard/dashboard.py",
    "runtime_env/agent",
    "log_monitor",
    "autoscaler/_private/monitor.py",
    "raysc train",
    "raysc serve",
    "ray start",
    "ray job",
    "prometheus",
    "grafana",
    "mlflow",
    "pytest",
    "execnet",
    "multiprocessing.spawn",
    "raysc",
)


def command_line(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def title(pid: int, cmd: str) -> str:
    """A process's kind from its command line ``cmd``: its ``ray::`` title, a known Ray or raysc part,
    else the command's start."""
    if not cmd:
        try:
            return "[" + open(f"/proc/{pid}/comm").read().strip() + "]"
        except OSError:
            return "?"
    m = re.match(r"(ray::\S+)", cmd)
    if m:
        return m.group(1)
    if "exec(eval(sys.stdin" in cmd or "execnet" in cmd:
        return "execnet (pytest-xdist worker)"
    return next((k for k in KINDS if k in cmd), cmd[:60])


def cpu_seconds() -> dict[int, float]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--period", type=float, default=1.0)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to measure after --")
    before = set(cpu_seconds())  # not the command's
    last: dict[int, float] = {}
    total: dict[str, float] = {}
    by_line: dict[str, dict[str, float]] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    while True:
        done = proc.poll() is not None
        for pid, cpu in cpu_seconds().items():
            if pid in before:
                continue
            line = command_line(pid)
            kind, spent = title(pid, line), max(0.0, cpu - last.get(pid, 0.0))
            total[kind] = total.get(kind, 0.0) + spent
            if spent:
                lines, key = by_line.setdefault(kind, {}), line[:160]
                lines[key] = lines.get(key, 0.0) + spent
            last[pid] = cpu
        if done:
            break
        time.sleep(a.period)
    ranked = dict(sorted(((k, round(v, 1)) for k, v in total.items() if v >= 0.05), key=lambda kv: -kv[1]))
    for kind, sec in list(ranked.items())[:25]:
        print(f"{sec:9.1f}  {kind}")
    print(
        json.dumps(
            {
                "command": cmd,
                "rc": proc.returncode,
                "wall_s": round(time.monotonic() - t0, 1),
                "cpu_s_total": round(sum(ranked.values()), 1),
                "cpu_s": ranked,
                "command_lines": {
                    k: dict(
                        sorted(((c, round(v, 1)) for c, v in by_line.get(k, {}).items()), key=lambda kv: -kv[1])[:3]
                    )
                    for k in ranked
                },
            }
        )
    )


if __name__ == "__main__":
    main()
