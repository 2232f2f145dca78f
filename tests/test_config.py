"""Configuration: loading, overrides, and an error that names key, origin and fix for each mistake."""

from pathlib import Path

import pytest

from raysc.config import ConfigError, config_hash, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "jobs" / "configs").glob("*.toml")))
def test_example_configs_load(name):
    cfg = load_config(ROOT / "jobs" / "configs" / f"{name}.toml")
    assert cfg.run.name == name
    assert cfg.train.global_batch_sequences > 0


def test_overrides_apply_with_types():
    cfg = load_config(
        ROOT / "jobs/configs/tiny.toml",
        ["train.steps=50", "optim.lr=3e-4", "model.tie_embeddings=true", "run.name=exp1"],
    )
    assert cfg.train.steps == 50 and cfg.optim.lr == 3e-4
    assert cfg.model.tie_embeddings is True and cfg.run.name == "exp1"
    assert cfg.optim.clip_norm == 1.0  # the documented default
    assert cfg.run_dir == "runs/exp1"


def test_int_accepted_for_float_and_tokens_replace_default_batch():
    cfg = load_config(None, ["optim.lr=1", "train.global_batch_tokens=4096", "train.seq_len=128"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.global_batch == 0 and cfg.train.global_batch_sequences == 32


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(ROOT / "jobs/configs/small.toml", ["train.steps=7"])
    p = tmp_path / "resolved.toml"
    p.write_text(dump_config(cfg))
    again = load_config(p)
    assert again == cfg and config_hash(again) == config_hash(cfg)


def _error(tmp_path, toml: str = "", overrides=()) -> str:
    path = None
    if toml:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    msg = _error(tmp_path, "[train]\nstesp = 10\n")
    assert "bad.toml" in msg and "train.stesp" in msg and "Did you mean 'steps'" in msg


def test_unknown_section(tmp_path):
    msg = _error(tmp_path, "[trian]\nsteps = 10\n")
    assert "unknown section '[trian]'" in msg and "Did you mean 'train'" in msg


def test_wrong_type(tmp_path):
    msg = _error(tmp_path, '[train]\nsteps = "many"\n')
    assert "train.steps" in msg and "expected int" in msg and "bad.toml" in msg
    msg = _error(tmp_path, "[model]\ntie_embeddings = 1\n")
    assert "model.tie_embeddings" in msg and "expected bool" in msg
    msg = _error(tmp_path, "[train]\nsteps = true\n")
    assert "expected int" in msg


def test_impossible_values(tmp_path):
    assert "must be >= 1" in _error(tmp_path, overrides=["train.steps=0"])
    assert "--set: train.steps" in _error(tmp_path, overrides=["train.steps=0"])
    assert "must be > 0.0" in _error(tmp_path, overrides=["optim.lr=-1"])
    assert "choose one of" in _error(tmp_path, overrides=['parallel.device="tpu"'])
    assert "must be a finite number" in _error(tmp_path, overrides=["optim.lr=nan"])


def test_cross_key_rules(tmp_path):
    assert "not divisible by model.n_heads" in _error(tmp_path, overrides=["model.dim=100", "model.n_heads=3"])
    assert "must divide model.n_heads" in _error(tmp_path, overrides=["model.n_heads=4", "model.n_kv_heads=3"])
    assert "multiple of train.seq_len" in _error(
        tmp_path, overrides=["train.global_batch_tokens=1000", "train.seq_len=128"]
    )
    assert "exactly one of" in _error(tmp_path, overrides=["train.global_batch=8", "train.global_batch_tokens=1024"])
    assert "micro_batch=3" in _error(tmp_path, overrides=["train.global_batch=8", "train.micro_batch=3"])
    assert "needs parallel.device='cuda'" in _error(tmp_path, overrides=['train.dtype="bf16"'])
    for switch in ("model.attention_bias=true", 'model.rope_scaling="llama3"'):  # μP: raysc's own Llama only
        assert "set model.mup = false" in _error(tmp_path, overrides=["model.mup=true", switch])


def test_layout_rules_name_the_numbers(tmp_path):
    assert "model.n_kv_heads=2 is not divisible by parallel.tp=4" in _error(tmp_path, overrides=["parallel.tp=4"])
    assert "n_layers=4 is not divisible by parallel.pp×pp_virtual_stages=2×4" in _error(
        tmp_path, overrides=["parallel.pp=2", "parallel.pp_virtual_stages=4", 'parallel.pp_schedule="interleaved_1f1b"']
    )
    assert "2×parallel.cp=6" in _error(tmp_path, overrides=["parallel.cp=3", "train.seq_len=128"])
    assert "dp×microbatches=2×3" in _error(
        tmp_path, overrides=["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_microbatches=3"]
    )
    assert "needs at least pp=4 microbatches" in _error(
        tmp_path, overrides=["parallel.pp=4", "parallel.pp_microbatches=2"]
    )
    assert "needs an interleaved schedule" in _error(tmp_path, overrides=["parallel.pp_virtual_stages=2"])
    assert "sequence_parallel needs parallel.tp > 1" in _error(tmp_path, overrides=["parallel.sequence_parallel=true"])
    assert "tie_embeddings cannot be used" in _error(tmp_path, overrides=["parallel.pp=2", "model.tie_embeddings=true"])
    cfg = load_config(None, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2"])
    assert cfg.parallel.world_size == 8


def test_malformed_toml_and_missing_file(tmp_path):
    assert "not valid TOML" in _error(tmp_path, "[train\nsteps=1")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="must be section.key"):
        load_config(None, ["steps=3"])


def test_config_reference_doc_is_current():
    from raysc.config.reference import render

    assert (ROOT / "docs/config.md").read_text() == render(), (
        "docs/config.md is stale: run `python -m raysc.config.reference > docs/config.md`"
    )
