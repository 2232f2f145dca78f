"""The checkpoint store on a local path: commit rules, retention, verified fetch, hot copy, interval advice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysc.checkpoint.storage import Storage, StorageError, redact
from raysc.checkpoint.store import CheckpointStore, CorruptCheckpoint
from raysc.fleet.checkpointing import parse_resume_from, young_interval_s


def _save(store: CheckpointStore, tmp: Path, step: int, payload: bytes = b"x" * 1000) -> None:
    local = tmp / f"stage{step}"
    local.mkdir()
    (local / "__0_0.distcp").write_bytes(payload + bytes([step]))
    (local / ".metadata").write_bytes(b"meta")
    store.discard_uncommitted(step)
    files = store.upload(step, local, ["__0_0.distcp", ".metadata"])
    store.commit(step, files, {"tokens": step})


def test_only_committed_checkpoints_exist_and_retention_keeps_long_term(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    for step in (10, 20, 30, 40, 50):
        _save(store, tmp_path, step)
    (tmp_path / "ck" / "step_00000060").mkdir()  # an uncommitted leftover
    (tmp_path / "ck" / "step_00000060" / "__0_0.distcp").write_bytes(b"half")
    assert store.steps() == [10, 20, 30, 40, 50] and store.latest() == 50
    assert store.retention(keep_last=2, keep_every=20, protect=10) == [30]
    assert store.steps() == [10, 20, 40, 50]
    assert store.discard_uncommitted(60) and not (tmp_path / "ck" / "step_00000060").exists()
    assert not store.discard_uncommitted(50)  # committed: never rewritten
    manifest = tmp_path / "ck" / "step_00000050" / "manifest.json"
    old = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**old, "format": "raysc-ckpt-v2"}))  # written by an older raysc
    assert "format 'raysc-ckpt-v2'" in store.verify(50) and store.latest() == 40


def test_fetch_verifies_and_prefers_the_hot_copy(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    _save(store, tmp_path, 5)
    good = (tmp_path / "ck" / "step_00000005" / "__0_0.distcp").read_bytes()
    hot = {"__0_0.distcp": lambda: good, ".metadata": lambda: b"meta"}
    _, source = store.fetch(5, tmp_path / "a", hot)
    assert source == "hot"
    _, source = store.fetch(5, tmp_path / "a", hot)
    assert source == "local"  # intact local copies are reused
    lost = {"__0_0.distcp": lambda: (_ for _ in ()).throw(RuntimeError("object lost"))}
    _, source = store.fetch(5, tmp_path / "b", lost)
    assert source == "store"  # a lost hot object falls back to the durable store
    stale = {"__0_0.distcp": lambda: b"wrong bytes"}
    _, source = store.fetch(5, tmp_path / "c", stale)
    assert source == "store" and (tmp_path / "c" / "__0_0.distcp").read_bytes() == good

    (tmp_path / "ck" / "step_00000005" / "__0_0.distcp").write_bytes(b"y" * 1001)  # altered after commit
    with pytest.raises(CorruptCheckpoint, match="__0_0.distcp: sha256 mismatch") as e:
        store.fetch(5, tmp_path / "d")
    assert e.value.step == 5 and not (tmp_path / "d" / "__0_0.distcp").exists()


def test_probe_names_the_problem(tmp_path):
    Storage(str(tmp_path / "ok"), {}).probe()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="checkpoint.uri"):
        Storage(str(blocker / "sub"), {}).probe()


def test_secrets_are_redacted_and_helpers():
    opts = {"endpoint_url": "http://x", "secret": "s", "key": "k", "client_kwargs": {"aws_session_token": "t"}}
    assert json.dumps(redact(opts)).count("***") == 3 and "http://x" in json.dumps(redact(opts))
    assert young_interval_s(save_s=30, mtbf_s=24 * 3600) == pytest.approx((2 * 24 * 3600 * 30) ** 0.5)
    assert parse_resume_from("s3://b/run/step_00000100") == ("s3://b/run", 100)


def test_staging_checksums_the_bytes_dcp_wrote_and_catches_later_corruption(tmp_path):
    """The manifest digest is taken while DCP writes: it equals the file's SHA-256, the upload does
    not hash again, and a staged file that changes before upload is caught (size now, sha on load)."""
    import warnings

    from raysc.checkpoint.staging import stage_shards
    from raysc.config import ModelConfig, OptimConfig
    from raysc.hashing import file_sha256
    from raysc.model.llama import build_model
    from raysc.train.optim import build_optimizer

    model = build_model(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1), 16, seed=0)
    opt = build_optimizer(list(model.parameters()), OptimConfig())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        names, digests = stage_shards(tmp_path / "s", model, opt, {"step": 1}, rank=0)
    assert set(names) == set(digests) >= {".metadata", "__0_0.distcp", "extra_rank0.safetensors"}
    for name in names:
        path = tmp_path / "s" / name
        assert digests[name] == (path.stat().st_size, file_sha256(path))

    store = CheckpointStore(str(tmp_path / "ck"))
    shard = tmp_path / "s" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # altered on local disk after DCP wrote it, same size
    shard.write_bytes(bytes(data))
    files = store.upload(1, tmp_path / "s", names, digests)
    store.commit(1, files, {})
    assert store.verify(1) is None and "sha256 mismatch" in store.verify(1, checksums=True)
    shard.write_bytes(bytes(data[:-5]))  # truncated on local disk
    with pytest.raises(OSError, match="staging corrupted"):
        store.upload(2, tmp_path / "s", names, digests, retries=0)


def test_ckpt_cli_takes_a_run_directory_and_says_in_one_line_when_the_store_cannot_be_read(
    tmp_path, capsys, monkeypatch
):
    """`raysc ckpt list RUN_DIR` lists the run's own checkpoint.uri (a README walk passed the run directory
    and got "no committed checkpoints"); an unreachable endpoint is one line and exit 2, not a traceback."""
    from raysc.cli import main
    from raysc.cluster.ports import free_port
    from raysc.config import load_config
    from raysc.config.load import dump_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, [f'run.dir="{run}"', f'checkpoint.uri="{tmp_path / "store"}"'])
    (run / "config.toml").write_text(dump_config(cfg))
    store = CheckpointStore(str(tmp_path / "store"))
    store.storage.write_bytes(f"{store.prefix(5)}/a.bin", b"x")
    store.commit(5, [{"path": "a.bin", "size": 1, "sha256": __import__("hashlib").sha256(b"x").hexdigest()}], {})
    assert main(["ckpt", "list", str(run), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [r["step"] for r in json.loads(out)] == [5] and "is a run directory" in err
    port = free_port()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")  # credentials there, the endpoint not
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    options = json.dumps(
        {"endpoint_url": f"http://127.0.0.1:{port}", "config_kwargs": {"retries": {"max_attempts": 1}}}
    )
    assert main(["ckpt", "list", "s3://bucket/run", "--storage-options", options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot list checkpoints under s3://bucket/run: ") and err.count("\n") == 1, err
    assert f"127.0.0.1:{port}" in err and "AWS_ENDPOINT_URL" in err
