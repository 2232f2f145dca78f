"""Meta-device construction: every rank's freshly materialised shards are exactly the matching slices
of the one-process model, for FSDP, TP, PP, CP and combined layouts, and every layout's validation
loss is the one-process loss, and so are the first step's loss and global grad norm (4 gloo processes, no Ray)."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from forked import run_forked
from raysc.cluster.ports import free_port
from raysc.config import load_config
from raysc.fleet.parity import layout_overrides
from raysc.model.llama import build_model
from raysc.parallel import materialise as mat
from raysc.parallel.dims import build_mesh
from raysc.parallel.parallelize import build_model_shard
from raysc.train.trainer import Trainer

# vocabulary 270: uneven FSDP shards (68/67 over 2 ranks of a TP half, 68,68,68,66 over 4)
MODEL = [
    "model.vocab_size=270",
    "model.dim=48",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.seed=7",
]
LAYOUTS = [  # four ranks each
    "dp_shard=4",
    "dp_replicate=2,tp=2",
    "dp_replicate=2,pp=2,pp_schedule=1f1b",
    "dp_replicate=2,cp=2",
    "dp_shard=2,tp=2",
    "pp=2,dp_shard=2",
    "pp=2,tp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2",
    "cp=2,tp=2,sequence_parallel=true",
]


ROWS = np.random.default_rng(0).integers(0, 270, size=(16, 33))  # 7 validation rows: not a multiple of
VAL = ROWS[:7]  # the microbatch count, so the pipeline's padded last call is exercised


def _check_layout(rank: int, layout: str, ref_val: float, ref_step: dict) -> list[str]:
    cfg = load_config(None, [*MODEL, *layout_overrides(layout)])
    ref = dict(build_model(cfg.model, cfg.rope_len, cfg.train.seed).named_parameters())
    dims = cfg.parallel.dims
    trainer = Trainer(cfg, ROWS, VAL, rank=rank, mesh=build_mesh(dims, "cpu"), measure_peak=False)
    shard = trainer.shard
    errors = []
    held, local = set(), 0
    for part in shard.parts:
        if not (torch.equal(part.rope_cos, build_model(cfg.model, cfg.rope_len, 0).rope_cos)):
            errors.append("rope tables")
        for name, p in part.named_parameters():
            held.add(name)
            if isinstance(p, DTensor):  # torch's own slicing of the full tensor, no communication
                want = distribute_tensor(ref[name].detach(), p.device_mesh, p.placements, src_data_rank=None)
                got, want = p.to_local(), want.to_local()
            else:
                got, want = p, ref[name]
            if p.is_meta or not torch.equal(got, want):
                errors.append(f"{name}: differs")
            local += got.numel()
    if local >= sum(t.numel() for t in ref.values()):
        errors.append(f"holds {local} parameters: not a shard")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    if set().union(*everyone) != set(ref):
        errors.append(f"not every parameter is held: {set(ref) - set().union(*everyone)}")
    val = trainer.val_loss()
    if val is None or abs(val - ref_val) > 1e-5 * ref_val:
        errors.append(f"val_loss {val} != one process's {ref_val}")
    step = trainer.train_step()  # a pipeline trains again after its forward-only eval
    for key in ("loss", "grad_norm"):  # the grad norm: clip.py's grouped reductions over every kind of shard
        if abs(step[key] - ref_step[key]) > 1e-5 * ref_step[key]:
            errors.append(f"first {key} {step[key]} != one process's {ref_step[key]}")
    return [f"rank {rank} {layout}: {e}" for e in errors]


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    mat.CHUNK_ELEMS = 1000  # every matrix drawn in several blocks
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60)
    )
    one = Trainer(load_config(None, MODEL), ROWS, VAL, measure_peak=False)
    ref_val, ref_step = one.val_loss(), one.train_step()
    errors = []
    for layout in LAYOUTS:
        errors += _check_layout(rank, layout, ref_val, ref_step)
    dist.destroy_process_group()
    assert not errors, "\n".join(errors[:20])


def test_every_rank_materialises_exactly_its_slice_of_the_one_process_model():
    run_forked(_rank, (free_port(),), nprocs=4)


@pytest.mark.parametrize("extra", [[], ["model.tie_embeddings=true"], ["model.mup=true", "model.mup_base_width=24"]])
def test_one_process_shard_equals_build_model_and_a_changed_order_does_not(extra, monkeypatch):
    monkeypatch.setattr(mat, "CHUNK_ELEMS", 1000)
    cfg = load_config(None, [*MODEL, *extra])
    ref = build_model(cfg.model, cfg.rope_len, cfg.train.seed).state_dict()
    model = build_model_shard(cfg, cfg.parallel.dims, 0, None, torch.device("cpu"), bf16=False).parts[0]
    got = model.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert (model.output.weight is model.embed.weight) == cfg.model.tie_embeddings  # to_empty kept the tie
    with torch.device("meta"):
        meta = type(model)(cfg.model, cfg.rope_len)
    order = mat.init_order(meta)
    mat.materialise([meta], order[::-1], cfg.model, cfg.train.seed, torch.device("cpu"))
    assert not torch.equal(meta.embed.weight, ref["embed.weight"])


@pytest.mark.parametrize("shape", [(7, 13), (33, 5), (2, 7), (100, 3), (40, 48), (1, 40)])
def test_row_blocks_draw_what_one_normal_call_draws(shape, monkeypatch):
    monkeypatch.setattr(mat, "CHUNK_ELEMS", 20)
    one, blocks = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    want = torch.empty(shape).normal_(0.0, 0.02, generator=one)
    got = torch.cat(
        [
            torch.empty((e - s, shape[1])).normal_(0.0, 0.02, generator=blocks)
            for s, e in mat.row_blocks(torch.Size(shape))
        ]
    )
    assert torch.equal(got, want) and torch.equal(one.get_state(), blocks.get_state())
