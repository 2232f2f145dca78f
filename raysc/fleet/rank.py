"""``RankWorker``: one rank's work inside a ``TrainWorker`` actor (``raysc.fleet.worker``): its
model shard, its training steps, its part of every checkpoint.

The supervisor creates workers inside a placement group, hands them the
rendezvous address, and then drives them in chunks of steps (up to the next
checkpoint). Each step's metrics are pushed to the supervisor with a
fire-and-forget actor call, so reporting never waits on the supervisor.

Workers form a torch.distributed process group (gloo on CPU, NCCL on CUDA) even
at world size 1, so checkpointing and later parallel layouts use one code path.
This module holds the rank's setup, its training loop and reports, and its
silent-data-corruption checks; its part of every checkpoint is ``RankCheckpoints``
(``raysc.fleet.rank_checkpoint``) and its collective measurements (timeouts,
pre-flight probe, stress) are ``raysc.fleet.rank_collectives``'s.
This module imports torch; only the worker processes import it.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
from collections import deque
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from raysc.checkpoint.local_copies import node_copies_root
from raysc.checkpoint.store import CheckpointStore
from raysc.cluster.ports import free_port
from raysc.config.load import config_from_dict
from raysc.fleet import rank_collectives
from raysc.fleet.faults import Fault, FaultInjector
from raysc.fleet.messages import REPORT_EVERY_S, WorkerInfo
from raysc.fleet.rank_checkpoint import RankCheckpoints
from raysc.fleet.rank_heal import RankHeal, peer_failed
from raysc.fleet.reuse import forget_rank_caches
from raysc.fleet.stopping import StepVote
from raysc.parallel.describe import describe_shard
from raysc.parallel.dims import build_mesh
from raysc.train.cpu_threads import own_intraop_threads
from raysc.train.memory import PeakMemory
from raysc.train.signals import SilentCorruption
from raysc.train.trainer import Trainer

RECENT_STEPS = 64


def rendezvous_address() -> tuple[str, int, str]:
    """(node IP, a free port, node id): rank 0's answer is the rendezvous point."""
    return ray.util.get_node_ip_address(), free_port(), ray.get_runtime_context().get_node_id()


class RankWorker:
    def __init__(self, cfg_dict: dict, rank: int, world_size: int, supervisor: ray.actor.ActorHandle) -> None:
        self.rank = rank
        self.world_size = world_size
        self.supervisor = supervisor
        self.trainer: Trainer | None = None
        self.memory: PeakMemory | None = None
        self.checkpoints = RankCheckpoints(self)
        self._pending_reports: list[dict] = []
        self._training = threading.Lock()  # held while train() runs: repairs wait for it
        self.vote: StepVote | None = None
        self.rows: tuple = ()  # (train rows, validation rows, EOS id): a peer heal rebuilds the trainer on them
        self.gpu_ids: list = []
        # every rank's newest step metrics (loss and grad norm are global): a peer heal recovers from a
        # survivor the reports a lost rank 0 had not sent
        self.recent: deque[dict] = deque(maxlen=RECENT_STEPS)
        self.heal = RankHeal(self)
        self._configure(cfg_dict)

    def _configure(self, cfg_dict: dict) -> None:
        self.cfg = config_from_dict(cfg_dict, "supervisor")
        self.faults = FaultInjector(
            self.cfg.supervisor.inject,
            self.rank,
            self._announce,
            node_copies_root(self.cfg.data.cache_dir, ray.get_runtime_context().get_node_id()),
        )
        if self.trainer is not None:
            self._hook_faults()

    def _hook_faults(self) -> None:
        """Fire this rank's injected faults from inside the trainer's step (and its loss)."""
        self.trainer.step_hook = lambda step: self.faults.before_step(step, self.trainer.params)
        self.trainer.loss_hook = self.faults.after_loss
        self.trainer.phase_hook = self.faults.at_phase

    def address(self) -> tuple[str, int, str]:
        return rendezvous_address()

    def activate(self, cfg_dict: dict) -> None:
        """A prepared spare takes over: the run's current config (injected faults that fired are gone)."""
        self._configure(cfg_dict)

    def setup(
        self,
        master: tuple[str, int],
        data: dict,
        cfg_dict: dict | None = None,
        gpu_ids: list | None = None,
        init_weights: bool = True,
    ) -> WorkerInfo:
        """Join the process group and build this rank's model shard. A warm spare (started without
        resources, in the bundle of the rank it replaces) gets the current config (injected faults that
        fired are gone) and, on GPU, the device of the worker it replaces, before CUDA is first touched.
        ``init_weights=False``: the shard is allocated, not drawn (a peer heal sends its state)."""
        t_setup = [time.perf_counter()]
        if cfg_dict is not None:
            self._configure(cfg_dict)
        # this thread trains (Ray's default concurrency group); gloo's and DCP's threads get one each
        own_intraop_threads(max(1, int(self.cfg.parallel.cpus_per_worker)))
        if gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        self.join(master)
        t_setup.append(time.perf_counter())
        self.rows = (ray.get(data["train"]), ray.get(data["val"]), data["eos_id"])
        t_setup.append(time.perf_counter())
        self.build(init_weights)
        t_setup.append(time.perf_counter())
        self.side_groups()
        self.gpu_ids = gpu_ids or [str(g) for g in ray.get_gpu_ids()]
        return self.info(master, ("process_group", "data", "model", "checkpoint_group"), t_setup)

    def join(self, master: tuple[str, int]) -> None:
        """Join the run's default process group, whose store rank 0 hosts at ``master``."""
        backend = "nccl" if self.cfg.parallel.device == "cuda" else "gloo"
        if self.cfg.parallel.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly the GPU assigned to this actor
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.cfg.supervisor.start_timeout_s),
        )

    def build(self, init_weights: bool = True) -> None:
        """The device mesh, the ``Trainer`` over this rank's rows, and the hooks and meters on it."""
        train_rows, val_rows, eos_id = self.rows
        dims = self.cfg.parallel.dims
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")  # our flattened dims are stable
        mesh = (
            build_mesh(dims, "cuda" if self.cfg.parallel.device == "cuda" else "cpu") if dims.world_size > 1 else None
        )
        self.trainer = Trainer(
            self.cfg, train_rows, val_rows, rank=self.rank, mesh=mesh, eos_id=eos_id, init_weights=init_weights
        )
        self._hook_faults()
        self.memory = (
            PeakMemory(self.trainer.model_parts, self.trainer.optimizer, self.trainer.device)
            if self.cfg.parallel.device == "cuda" or self.cfg.train.measure_memory
            else None
        )

    def side_groups(self, flags: list[int] | None = None) -> None:
        """The checkpoint group, the stop/checkpoint vote's group (``flags``: requests it carries over)
        and the checkpoint store."""
        # checkpoint I/O gets its own gloo group: it cannot deadlock with training collectives
        self.checkpoints.group = dist.new_group(backend="gloo")
        # and stop / checkpoint-now requests theirs (raysc.fleet.stopping)
        self.vote = StepVote(dist.new_group(backend="gloo") if self.world_size > 1 else None)
        if flags:
            self.vote.flags = list(flags)
        self.checkpoints.store = CheckpointStore.for_config(self.cfg)

    def info(self, master: tuple[str, int], phases: tuple[str, ...], t_setup: list[float]) -> WorkerInfo:
        """What the supervisor learns of this rank once set up: ``phases`` timed by ``t_setup``."""
        return WorkerInfo(
            rank=self.rank,
            pid=os.getpid(),
            node=ray.util.get_node_ip_address(),
            node_id=ray.get_runtime_context().get_node_id(),
            replicas=self.trainer.replicas.enabled,
            gpu_ids=self.gpu_ids,
            coords=self.cfg.parallel.dims.coords(self.rank),
            built=describe_shard(self.trainer.shard, self.trainer.schedule),
            threads=torch.get_num_threads(),
            device=str(self.trainer.device),
            peak_flops=self.trainer.peak_flops,
            master=(master[0], master[1]),
            setup_s=dict(zip(phases, (round(b - a, 3) for a, b in zip(t_setup, t_setup[1:] + [time.perf_counter()])))),
        )

    # ---- checkpoints (raysc.fleet.rank_checkpoint) ----
    def fetch(self, uri: str, step: int, hot: dict | None) -> dict:
        return self.checkpoints.fetch(uri, step, hot)

    def load(self, uri: str, step: int) -> int:
        return self.checkpoints.load(uri, step)

    def save_start(self, step: int) -> dict:
        return self.checkpoints.save_start(step)

    def read_file(self, step: int, name: str) -> bytes:
        return self.checkpoints.read_file(step, name)

    def save_wait(self) -> dict:
        return self.checkpoints.save_wait()

    def save_pending(self) -> bool:
        return self.checkpoints.save_pending()

    # ---- training ----
    def _announce(self, fault: Fault) -> None:
        """Tell the supervisor (and wait for it to hear) before an injected fault fires."""
        ray.get(self.supervisor.fault_fired.remote(fault.spec, self.rank, fault.step))
        self._flush_reports()

    def request(self, kind: str) -> None:
        """Ask ``train`` to return early (``stop``), or to return so that the supervisor saves a
        checkpoint (``checkpoint``), at a step boundary all ranks agree on (``StepVote``)."""
        if self.vote is not None:
            self.vote.request(kind)

    def train(self, until_step: int) -> dict | None:
        """Run optimizer steps until ``until_step`` (or an agreed stop / checkpoint request, after a
        finished step); report them to the supervisor.

        Rank 0 sends its per-step metrics in batches at most every ``REPORT_EVERY_S``
        (one fire-and-forget call), which keeps the supervisor's share of a
        2-core machine negligible while hang detection keeps second resolution.
        Every ``supervisor.sdc_every_steps`` the replicas compare parameter fingerprints
        (``raysc.train.sdc``); a mismatch raises ``SilentCorruption`` on every rank.
        """
        with self._training:
            try:
                return self._train(until_step)
            except Exception as e:
                if self.cfg.supervisor.peer_heal and peer_failed(e):
                    self.heal.leave()  # a peer is gone and its replicas may heal it: the state held, groups left
                raise

    def _train(self, until_step: int) -> dict | None:
        last = None
        pending: list[dict] = []
        self._pending_reports = pending
        sent = time.monotonic()
        sdc_every = self.cfg.supervisor.sdc_every_steps if self.trainer.replicas.enabled else 0
        while self.trainer.step < until_step:
            if self.vote.poll() is not None:
                break  # every rank breaks after the same step; the supervisor sees it in the step reached
            if self.memory is not None:
                self.memory.before_step()
            last = self.trainer.train_step()
            self.recent.append(last)
            self.faults.after_step()
            if self.memory is not None:
                self.memory.after_step()
            if self.rank == 0:
                pending.append(last)
            if sdc_every and self.trainer.step % sdc_every == 0:
                t0 = time.perf_counter()
                try:
                    self.trainer.replicas.run(self.trainer.step)
                except SilentCorruption:
                    self._flush_reports()
                    raise
                last["sdc_s"] = time.perf_counter() - t0  # rank 0's dict is still in pending
            if self.rank == 0 and time.monotonic() - sent >= REPORT_EVERY_S:
                self.supervisor.report.remote(pending)
                pending, sent = [], time.monotonic()
                self._pending_reports = pending
        self.vote.finish()
        self._flush_reports()
        if last is not None and self.memory is not None:
            last = {**last, "memory": self.memory.report()}  # this rank's, for the run summary
        return last

    def _flush_reports(self) -> None:
        if self.rank == 0 and self._pending_reports:
            self.supervisor.report.remote(list(self._pending_reports))  # arguments are serialised now
            del self._pending_reports[:]  # the same list train() keeps: sent once, never twice

    # ---- silent data corruption: verdict, repair, re-check (called after train() raised) ----
    def sdc_verdict(self) -> dict:
        with self._training:  # train() has returned on this rank
            return {"rank": self.rank, "verdict": self.trainer.replicas.verdict}

    def sdc_repair(self) -> bool:
        with self._training:
            return self.trainer.replicas.repair(self.trainer.optimizer)

    def sdc_check(self) -> dict:
        with self._training:
            return self.trainer.replicas.run(self.trainer.step)

    # ---- timeout calibration, pre-flight (raysc.fleet.rank_collectives) ----
    def measure_collectives(self, iters: int = 5) -> dict:
        return rank_collectives.measure_collectives(self.trainer, iters)

    def probe(self, nbytes: int) -> dict:
        return rank_collectives.probe(self.trainer, self.rank, nbytes, self._training)

    def set_timeout(self, seconds: float) -> None:
        """The process-group timeout of every training collective (the default group and each mesh
        group); the checkpoint group keeps its own, longer one."""
        rank_collectives.set_timeout(seconds, keep=self.checkpoints.group)

    def stress(self, seconds: float) -> dict:
        return rank_collectives.stress(self.trainer, self.world_size, seconds)

    def skip_batches(self, n: int) -> int:
        """Move the data cursor past ``n`` global batches (after a rollback); returns the cursor."""
        self.trainer.loader.skip(n)
        return self.trainer.loader.cursor

    def val_loss(self) -> float | None:
        """The validation loss (collective). An injected fault at step ``train.steps + 1`` fires here: the
        drill for a failure in the run's final phase."""
        self.faults.before_step(self.cfg.train.steps + 1, self.trainer.params)
        return self.trainer.val_loss()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def detach(self, collect: bool = True) -> None:
        """Leave the run so that this process can serve another (``raysc.fleet.pool``): refused while a
        save is in flight or on a GPU (the CUDA context stays with the process); the prefetch and
        memory threads stop, every process group is destroyed and the model and optimizer freed
        (``collect``: collected now; a spare that takes over a rank at once leaves it to Python)."""
        if self.save_pending():
            raise RuntimeError(f"rank {self.rank}: a checkpoint save is still in flight")
        if self.cfg.parallel.device != "cpu":
            raise RuntimeError(f"rank {self.rank}: ran on {self.cfg.parallel.device}; not reusable")
        self._flush_reports()
        if self.memory is not None:
            self.memory.close()
        halt = getattr(getattr(self.trainer, "loader", None), "_halt", None)
        if halt is not None:
            halt()
        self.shutdown()
        self.trainer = self.memory = self.vote = self.checkpoints.store = None
        self.rows = ()
        self.recent.clear()
        forget_rank_caches()
        if collect:
            gc.collect()
