"""``TrainWorker``: the Ray actor that owns one model shard and runs training steps.

The supervisor creates workers inside a placement group, hands them the
rendezvous address, and then drives them in chunks of steps (up to the next
checkpoint). Each step's metrics are pushed to the supervisor with a
fire-and-forget actor call, so reporting never waits on the supervisor.

Workers form a torch.distributed process group (gloo on CPU, NCCL on CUDA) even
at world size 1, so checkpointing and later parallel layouts use one code path.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from raysc.checkpoint import store
from raysc.config.load import config_from_dict
from raysc.fleet.faults import fire, parse_faults
from raysc.parallel.dims import ParallelDims, build_mesh
from raysc.train.trainer import Trainer

REPORT_EVERY_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote
class TrainWorker:
    def __init__(self, cfg_dict: dict, rank: int, world_size: int, supervisor: ray.actor.ActorHandle) -> None:
        self.cfg = config_from_dict(cfg_dict, "supervisor")
        self.rank = rank
        self.world_size = world_size
        self.supervisor = supervisor
        self.trainer: Trainer | None = None
        self.faults = {f.step: f for f in parse_faults(self.cfg.supervisor.inject) if f.rank == rank}
        threads = max(1, int(self.cfg.parallel.cpus_per_worker))
        torch.set_num_threads(threads)

    def address(self) -> tuple[str, int, str]:
        """(node IP, a free port, node id): rank 0's answer is the rendezvous point."""
        return ray.util.get_node_ip_address(), free_port(), ray.get_runtime_context().get_node_id()

    def setup(self, master: tuple[str, int], data: dict, resume_from: str | None) -> dict:
        """Join the process group, build the model and optionally restore a checkpoint."""
        backend = "nccl" if self.cfg.parallel.device == "cuda" else "gloo"
        if self.cfg.parallel.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly the GPU assigned to this actor
        dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.cfg.supervisor.start_timeout_s))
        train_rows = ray.get(data["train"])
        val_rows = ray.get(data["val"])
        dims = ParallelDims.from_config(self.cfg.parallel)
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")  # our flattened dims are stable
        mesh = build_mesh(dims, "cuda" if self.cfg.parallel.device == "cuda" else "cpu") \
            if dims.world_size > 1 else None
        self.trainer = Trainer(self.cfg, train_rows, val_rows, rank=self.rank, mesh=mesh)
        restored = None
        if resume_from:
            extra = store.load_shards(Path(resume_from), self.trainer.shard.state_module(), self.trainer.optimizer,
                                      self.rank)
            self.trainer.load_extra_state(extra)
            restored = self.trainer.step
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "coords": dims.coords(self.rank),
                "threads": torch.get_num_threads(), "device": str(self.trainer.device),
                "peak_flops": self.trainer.peak_flops, "restored_step": restored}

    def train(self, until_step: int) -> dict | None:
        """Run optimizer steps until ``until_step``; report them to the supervisor.

        Rank 0 sends its per-step metrics in batches at most every ``REPORT_EVERY_S``
        (one fire-and-forget call), which keeps the supervisor's share of a
        2-core machine negligible while hang detection keeps second resolution.
        """
        last = None
        pending: list[dict] = []
        sent = time.monotonic()
        while self.trainer.step < until_step:
            fault = self.faults.pop(self.trainer.step + 1, None)
            if fault is not None:
                fire(fault)
            last = self.trainer.train_step()
            if self.rank == 0:
                pending.append(last)
                if time.monotonic() - sent >= REPORT_EVERY_S:
                    self.supervisor.report.remote(pending)
                    pending, sent = [], time.monotonic()
        if pending:
            self.supervisor.report.remote(pending)
        return last

    def save(self, path: str) -> None:
        """Write this rank's shards into ``path`` (the supervisor commits the manifest)."""
        store.save_shards(Path(path), self.trainer.shard.state_module(), self.trainer.optimizer,
                          self.trainer.extra_state(), self.rank)
        dist.barrier()

    def val_loss(self) -> float | None:
        return self.trainer.val_loss()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
