"""Checkpoints are data, never code: planted pickles never run, signed manifests refuse tampering before
anything is parsed, the previous (pickled) format is converted only deliberately."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from conftest import s3_options
from raysc.checkpoint.rank_state import BadRankState, StateNotData, load_rank_state, save_rank_state
from raysc.checkpoint.signing import KEY_ENV, PREVIOUS_KEYS_ENV, Signer
from raysc.checkpoint.staging import load_local, stage_shards
from raysc.checkpoint.store import CheckpointStore, CorruptCheckpoint
from raysc.fleet.records import read_jsonl

KEY = "k" * 8 + "0123456789abcdef"
OTHER_KEY = "z" * 24
REFUSALS = ("not DCP metadata", "not plain data", "unreadable rank state")


class Payload:
    """What an attacker plants: unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tiny_model_and_optimizer(seed: int = 0):
    from raysc.config import ModelConfig, OptimConfig
    from raysc.model.llama import build_model
    from raysc.train.optim import build_optimizer

    model = build_model(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1), 16, seed=seed)
    return model, build_optimizer(list(model.parameters()), OptimConfig())


def _stage(local: Path, extra: dict | None = None, lr=None):
    model, opt = _tiny_model_and_optimizer()
    if lr is not None:
        opt.param_groups[0]["lr"] = lr
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return stage_shards(local, model, opt, extra or {"step": 7, "rng": torch.get_rng_state()}, rank=0)


def _load(local: Path, step: int = 7) -> dict:
    model, opt = _tiny_model_and_optimizer(seed=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return load_local(local, model, opt, rank=0, step=step)


def _commit(store: CheckpointStore, local: Path, step: int) -> None:
    names, digests = _stage(local)
    store.discard_uncommitted(step)
    store.commit(step, store.upload(step, local, names, digests), {"tokens": step})


def _plant(uri: Path | str, step: int, name: str, data: bytes, fs=None) -> None:
    """Replace ``name`` in committed ``step`` and re-hash the manifest, as a writer to the store would
    (keeping whatever signature it had: without the key it cannot make a new one)."""
    prefix = f"{uri}/step_{step:08d}"
    if fs is None:
        Path(prefix, name).write_bytes(data)
        manifest = json.loads(Path(prefix, "manifest.json").read_text())
    else:
        fs.pipe_file(f"{prefix}/{name}", data)
        manifest = json.loads(fs.cat_file(f"{prefix}/manifest.json"))
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    body = json.dumps(manifest).encode()
    if fs is None:
        Path(prefix, "manifest.json").write_bytes(body)
    else:
        fs.pipe_file(f"{prefix}/manifest.json", body)


def test_rank_state_round_trips_data_and_refuses_everything_else(tmp_path):
    state = {
        "step": 3,
        "rng": torch.get_rng_state(),
        "betas": (0.9, 0.95),
        "by_domain": {0: [1, 2], 1: []},
        "nan": float("nan"),
        "cuda_rng": None,
        "nested": [{"a": (1, "x")}],
    }
    save_rank_state(tmp_path / "s.safetensors", state)
    back = load_rank_state(tmp_path / "s.safetensors")
    assert torch.equal(back.pop("rng"), state.pop("rng")) and back.pop("nan") != back.get("nan")
    state.pop("nan")
    assert back == state  # tuples stay tuples, int keys stay ints
    with pytest.raises(StateNotData, match=r"state.bad: a Payload is not data"):
        save_rank_state(tmp_path / "t.safetensors", {"bad": Payload(tmp_path / "m")})
    marker = tmp_path / "marker"
    (tmp_path / "p.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(BadRankState):
        load_rank_state(tmp_path / "p.safetensors")
    assert not marker.exists()


@pytest.mark.parametrize("where", [".metadata", "extra_rank0.safetensors", "optimizer value"])
def test_planted_pickles_never_run_on_load(tmp_path, where):
    marker = tmp_path / "marker"
    local = tmp_path / "ck"
    if where == "optimizer value":  # a non-tensor value inside a .distcp shard (DCP would torch.load it)
        _stage(local, lr=Payload(marker))
    else:
        _stage(local)
        (local / where).write_bytes(pickle.dumps(Payload(marker)))
    assert not marker.exists()  # writing it ran nothing either
    with pytest.raises(CorruptCheckpoint) as err:
        _load(local)
    assert not marker.exists()
    assert err.value.step == 7 and any(why in err.value.reason for why in REFUSALS), err.value
    clean = tmp_path / "clean"
    _stage(clean)
    assert _load(clean)["step"] == 7  # the same code loads an honest checkpoint


def test_signed_manifests_refuse_tampering_before_any_file_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(PREVIOUS_KEYS_ENV, raising=False)
    uri = tmp_path / "store"
    signed = CheckpointStore(str(uri), signer=Signer(KEY))
    _commit(signed, tmp_path / "s5", 5)
    _commit(signed, tmp_path / "s10", 10)
    manifest = signed.read_manifest(10)
    assert manifest["signature"]["alg"] == "hmac-sha256" and KEY not in json.dumps(manifest)
    assert signed.verify(10, checksums=True) is None and signed.signature_state(10).endswith("verified")

    marker = tmp_path / "marker"
    _plant(uri, 10, ".metadata", pickle.dumps(Payload(marker)))
    assert "bad signature" in signed.verify(10)
    with pytest.raises(CorruptCheckpoint, match="bad signature") as err:
        signed.fetch(10, tmp_path / "fetched")
    assert err.value.file == "manifest.json" and not (tmp_path / "fetched" / ".metadata").exists()
    assert signed.latest() == 5 and not marker.exists()

    # a forger without the key strips the signature: refused as unsigned when a key is set...
    path = uri / "step_00000005" / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "signature"}))
    assert "unsigned" in signed.verify(5)
    # ...and shown as unsigned, not silently trusted, where no key is configured
    assert CheckpointStore(str(uri)).signature_state(5) == "unsigned"
    assert CheckpointStore(str(uri)).verify(5) is None

    # rotation: a new key verifies the old one's checkpoints only while the old key is a previous key
    _commit(signed, tmp_path / "s20", 20)
    assert "signed with another key" in CheckpointStore(str(uri), signer=Signer(OTHER_KEY)).verify(20)
    assert CheckpointStore(str(uri), signer=Signer(OTHER_KEY, (KEY,))).verify(20) is None
    monkeypatch.setenv(PREVIOUS_KEYS_ENV, KEY)
    monkeypatch.setenv(KEY_ENV, OTHER_KEY)
    assert Signer.resolve().check(signed.read_manifest(20)) is None
    with pytest.raises(ValueError, match="at least 16"):
        Signer.resolve("short")


def test_manifest_file_names_cannot_escape_the_local_copy(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"))
    _commit(store, tmp_path / "s1", 1)
    path = tmp_path / "store" / "step_00000001" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][0]["path"] = "../../outside.py"
    path.write_text(json.dumps(manifest))
    assert "not a plain checkpoint file name" in store.verify(1)
    with pytest.raises(CorruptCheckpoint, match="not a plain checkpoint file name"):
        store.fetch(1, tmp_path / "local" / "a" / "b")
    assert not (tmp_path / "local" / "outside.py").exists()


def test_signing_key_never_reaches_disk(make_cfg, monkeypatch):
    from raysc.config.load import dump_config, load_config

    cfg = make_cfg(f'checkpoint.signing_key="{KEY}"')
    text = dump_config(cfg)
    assert KEY not in text and 'signing_key = "***"' in text
    saved = Path(cfg.run_dir)
    saved.mkdir(parents=True, exist_ok=True)
    (saved / "config.toml").write_text(text)
    again = load_config(saved / "config.toml")
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=KEY_ENV):  # a redacted key is never mistaken for "unsigned"
        Signer.resolve(again.checkpoint.signing_key)
    monkeypatch.setenv(KEY_ENV, KEY)
    assert Signer.resolve(again.checkpoint.signing_key).key == KEY


def _make_v3(store: CheckpointStore, tmp_path: Path, step: int, extra_obj) -> None:
    """A checkpoint as raysc-ckpt-v3 wrote it: per-rank state pickled in extra_rank0.pt."""
    local = tmp_path / f"v3_{step}"
    names, digests = _stage(local)
    (local / "extra_rank0.safetensors").unlink()
    torch.save(extra_obj, local / "extra_rank0.pt")
    names = [n for n in names if not n.endswith(".safetensors")] + ["extra_rank0.pt"]
    store.discard_uncommitted(step)
    files = store.upload(step, local, names, {k: v for k, v in digests.items() if k in names})
    manifest = store.commit(step, files, {"tokens": step})
    (Path(store.uri) / f"step_{step:08d}" / "manifest.json").write_text(
        json.dumps({**manifest, "format": "raysc-ckpt-v3"})
    )


def test_previous_format_is_reported_and_converted_only_deliberately(tmp_path, capsys, monkeypatch):
    from raysc.cli import main

    monkeypatch.delenv(KEY_ENV, raising=False)
    uri = tmp_path / "store"
    store = CheckpointStore(str(uri))
    extra = {
        "step": 4,
        "tokens": 100,
        "torch_rng": torch.get_rng_state(),
        "loader": {"cursor": 32},
        "scheduler": {"last_epoch": 4, "base_lrs": [0.001]},
        "cuda_rng": None,
    }
    _make_v3(store, tmp_path, 4, extra)
    assert store.latest() is None and "raysc ckpt convert" in store.verify(4)
    assert main(["ckpt", "verify", str(uri)]) == 1
    assert "raysc ckpt convert" in capsys.readouterr().out
    assert main(["ckpt", "convert", str(uri)]) == 0
    assert "converted (extra_rank0.safetensors)" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(uri)]) == 0
    assert not (uri / "step_00000004" / "extra_rank0.pt").exists()
    local = tmp_path / "fetched"
    store.fetch(4, local)
    back = _load(local, step=4)
    assert torch.equal(back.pop("torch_rng"), extra["torch_rng"])
    assert back == {k: v for k, v in extra.items() if k != "torch_rng"}

    marker = tmp_path / "marker"
    _make_v3(store, tmp_path, 8, {"step": 8, "evil": Payload(marker)})
    assert main(["ckpt", "convert", str(uri), "--step", "8"]) == 2
    assert "refusing to convert" in capsys.readouterr().err
    assert not marker.exists() and store.read_manifest(8)["format"] == "raysc-ckpt-v3"


def test_restores_fall_back_past_planted_payloads_on_s3_and_signed_local(
    ray_session, s3_server, make_cfg, tmp_path, monkeypatch
):
    """The attack end to end: payloads planted in the newest checkpoints of a real run, then `--resume`.
    S3 without a key: the parsers refuse both files. Local store with a key: the signature refuses first."""
    from raysc.fleet.driver import train

    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(marker))
    bucket = f"raysc-{uuid.uuid4().hex[:10]}"
    s3_server["client"].create_bucket(Bucket=bucket)
    monkeypatch.delenv(KEY_ENV, raising=False)
    args = ("checkpoint.every_steps=5", "checkpoint.keep_last=3")
    s3 = (f'checkpoint.uri="s3://{bucket}/run"', s3_options(s3_server["endpoint"]))
    cfg = make_cfg(*s3, *args, "train.steps=15", run="s3")
    train(cfg, progress=False)
    fs = CheckpointStore.for_config(cfg).storage.fs
    _plant(f"{bucket}/run", 15, ".metadata", payload, fs)
    _plant(f"{bucket}/run", 10, "extra_rank0.safetensors", payload, fs)
    shutil.rmtree(Path(cfg.data.cache_dir) / "checkpoints")  # a fresh node: no verified local copy
    summary = train(make_cfg(*s3, *args, "train.steps=15", run="s3"), resume=True, progress=False)
    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    corrupt = {e["step"]: e["error"] for e in events if e["kind"] == "checkpoint_corrupt"}
    assert "not DCP metadata" in corrupt[15] and "unreadable rank state" in corrupt[10], corrupt
    assert [e["step"] for e in events if e["kind"] == "resumed"][-1] == 5 and summary["steps_run"] == 10
    assert not marker.exists()

    monkeypatch.setenv(KEY_ENV, KEY)
    signed = make_cfg(*args, "train.steps=10", run="signed")
    train(signed, progress=False)
    _plant(signed.checkpoint_uri, 10, ".metadata", payload)
    summary = train(make_cfg(*args, "train.steps=10", run="signed"), resume=True, progress=False)
    events = read_jsonl(Path(signed.run_dir) / "events.jsonl")
    corrupt = [e for e in events if e["kind"] == "checkpoint_corrupt" or e["kind"] == "checkpoint_skipped"]
    assert corrupt and corrupt[-1]["step"] == 10 and "bad signature" in json.dumps(corrupt[-1])
    assert [e["step"] for e in events if e["kind"] == "resumed"][-1] == 5 and summary["steps_run"] == 5
    assert not marker.exists()
    for path in Path(signed.run_dir).rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="ignore"), path
