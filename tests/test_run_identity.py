"""A fresh run never silently inherits another run's checkpoints: refused at start, --overwrite deletes
nothing before this run commits, restore and export take only the run's own checkpoints. Through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from raysc.checkpoint.store import CheckpointStore
from raysc.config.load import dump_config
from raysc.fleet.records import read_jsonl


def _owners(cfg) -> dict[int, str]:
    store = CheckpointStore.for_config(cfg)
    return {s: store.read_manifest(s)["run_id"] for s in store.steps()}


def test_fresh_run_refuses_overwrite_replaces_only_after_commit_and_export_keeps_runs_apart(
    ray_session, make_cfg, tmp_path, capsys
):
    from raysc.cli import main

    a = make_cfg("train.steps=10", "checkpoint.every_steps=5", run="a")
    path = tmp_path / "a.toml"
    path.write_text(dump_config(a))
    assert main(["train", str(path), "--no-progress"]) == 0
    first = json.loads((Path(a.run_dir) / "run.json").read_text())["run_id"]
    assert _owners(a) == {5: first, 10: first}

    capsys.readouterr()
    assert main(["train", str(path), "--no-progress"]) == 1  # the same command again: refused before step 1
    err = capsys.readouterr().err
    assert "already holds committed checkpoints (steps [5, 10])" in err and first in err
    assert "--resume" in err and "--overwrite" in err and "run.dir" in err
    assert _owners(a) == {5: first, 10: first}

    # --overwrite that dies before its first commit: the old checkpoints are all still there
    assert (
        main(
            [
                "train",
                str(path),
                "--no-progress",
                "--overwrite",
                "--inject",
                "kill@2",
                "--set",
                "supervisor.max_restarts=0",
            ]
        )
        == 1
    )
    assert _owners(a) == {5: first, 10: first}
    # ...and one that commits: the other run's checkpoints go only after its own first commit
    assert (
        main(
            [
                "train",
                str(path),
                "--no-progress",
                "--overwrite",
                "--set",
                "checkpoint.every_steps=3",
                "--set",
                "train.steps=6",
            ]
        )
        == 0
    )
    second = json.loads((Path(a.run_dir) / "run.json").read_text())["run_id"]
    assert second != first and _owners(a) == {3: second, 6: second}
    events = read_jsonl(Path(a.run_dir) / "events.jsonl")
    deleted = [e for e in events if e["kind"] == "previous_run_deleted"]
    committed = CheckpointStore.for_config(a).read_manifest(3)["time"]  # this run's first commit
    assert deleted[-1]["steps"] == [5, 10] and deleted[-1]["time"] >= committed

    # a foreign checkpoint in a run's store (newer than its own) is neither restored nor exported
    b = make_cfg("train.steps=4", "checkpoint.every_steps=2", run="b")
    path_b = tmp_path / "b.toml"
    path_b.write_text(dump_config(b))
    assert main(["train", str(path_b), "--no-progress"]) == 0
    shutil.copytree(Path(a.checkpoint_uri) / "step_00000006", Path(b.checkpoint_uri) / "step_00000006")
    capsys.readouterr()
    assert main(["export", b.run_dir, "--out", str(tmp_path / "hf")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    assert main(["export", b.run_dir, "--step", "6", "--out", str(tmp_path / "hf6")]) == 2
    assert f"written by run {second}" in capsys.readouterr().err
    assert main(["train", str(path_b), "--no-progress", "--resume", "--set", "train.steps=5"]) == 0
    events = read_jsonl(Path(b.run_dir) / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [4]
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert skipped[0]["step"] == 6 and "written by run" in skipped[0]["reason"]
    own = {s for s, o in _owners(b).items() if o != second}
    assert _owners(b)[6] == second and max(own) == 5  # the other run's checkpoint untouched, never counted
