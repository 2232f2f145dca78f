"""``train.compile``: the blocks compiled in place train like the eager model and keep its checkpoint
names (raysc/train/compile.py). On CPU (inductor's C++ backend); benchmarks/gpu.sh measures the speed."""

from __future__ import annotations

import pytest
import torch

from raysc.data.prepare import prepare_data
from raysc.train.trainer import Trainer


def test_compiled_blocks_train_like_eager_and_keep_the_checkpoint_names(make_cfg):
    from torch._dynamo.utils import counters

    eager_cfg = make_cfg("train.steps=3", run="eager")
    packed, _, _ = prepare_data(eager_cfg)
    eager = Trainer(eager_cfg, packed.train, measure_peak=False)
    want = [eager.train_step() for _ in range(3)]

    torch._dynamo.reset()
    counters.clear()
    compiled = Trainer(
        make_cfg("train.steps=3", "train.compile=true", run="compiled"), packed.train, measure_peak=False
    )
    got = [compiled.train_step() for _ in range(3)]
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # inductor compiled the blocks
    for w, g in zip(want, got):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), (w["loss"], g["loss"])
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), (w["grad_norm"], g["grad_norm"])
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())  # checkpoints load either way
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-3, atol=1e-5), name


def test_compile_with_tensor_parallelism_is_refused_before_anything_starts():
    from raysc.config import load_config
    from raysc.config.load import ConfigError

    with pytest.raises(ConfigError, match=r"train.compile is not supported with parallel.tp=2.*train.compile=false"):
        load_config(None, ["train.compile=true", "parallel.tp=2", "model.n_heads=4", "model.n_kv_heads=2"])
    load_config(None, ["train.compile=true", "parallel.dp_shard=2"])  # sharded data parallelism compiles
