"""The training state of one worker and its optimizer step.

``Trainer`` owns this rank's model shard, AdamW, the LR schedule and the batch
loader, and runs one optimizer step: gradient accumulation (or a pipeline
schedule), global gradient clipping, and metrics whose loss and grad norm are the
global values. At world size 1 it is a plain torch loop; the same class runs
inside a ``TrainWorker`` actor and in ``benchmarks/train_overhead.py``. With
``train.document_mask`` every forward also gets each token's document id, computed
from the EOS tokens of the whole row (``raysc.model.documents``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from raysc.config.schema import Config
from raysc.data.fingerprint import PRIME, rows_fingerprint
from raysc.data.loader import build_loader
from raysc.model.documents import document_ids
from raysc.model.flops import flops_per_token
from raysc.parallel.clip import clip_grad_norm
from raysc.parallel.cp import shard_sequence
from raysc.parallel.parallelize import build_model_shard
from raysc.parallel.pp import build_schedule
from raysc.train.compile import compile_blocks
from raysc.train.moe_routing import MoERouting
from raysc.train.optim import build_optimizer, build_scheduler
from raysc.train.sdc import ReplicaCheck
from raysc.train.stability import SpikeDetector, SpikeRollback
from raysc.train.throughput import device_peak_flops


def resolve_device(cfg: Config) -> torch.device:
    if cfg.parallel.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "parallel.device='cuda' but this worker sees no CUDA device; "
                "use parallel.device='cpu' or request GPUs for the workers"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def use_bf16(cfg: Config) -> bool:
    return cfg.compute_dtype == "bf16"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Trainer:
    def __init__(
        self,
        cfg: Config,
        rows: np.ndarray | dict[str, np.ndarray],
        val_rows: np.ndarray | None = None,
        rank: int = 0,
        mesh=None,
        measure_peak: bool = True,
        eos_id: int | None = None,
        init_weights: bool = True,
    ) -> None:
        """``eos_id``: the token that ends every packed document (needed with ``train.document_mask``);
        ``init_weights=False``: the parameters are allocated, not drawn (a peer heal copies them in)."""
        self.cfg = cfg
        if cfg.train.document_mask and eos_id is None:
            raise ValueError("train.document_mask needs the tokenizer's EOS id (the Trainer got none)")
        self.eos_id = eos_id if cfg.train.document_mask else None
        self.dims = cfg.parallel.dims
        self.rank = rank
        self.mesh = mesh
        self.coords = self.dims.coords(rank)
        self.device = resolve_device(cfg)
        torch.manual_seed(cfg.train.seed)
        self.shard = build_model_shard(cfg, self.dims, rank, mesh, self.device, use_bf16(cfg), init_weights)
        # the worker's fault injector (drills) sets these, else None: step_hook(step) runs at the start
        # of each step, inside its timing (a straggler's delay shows in step_time); loss_hook(loss) is
        # applied to every training loss
        self.step_hook: Callable[[int], None] | None = None
        self.loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
        # phase_hook(step, phase) at each phase inside a step (raysc.config.faults.PHASES), for drills
        self.phase_hook: Callable[[int, str], None] | None = None
        self.model_parts = self.shard.parts
        for part in self.model_parts:
            part.restart_positions = cfg.train.document_positions
        self.model = self.model_parts[0]
        if cfg.train.compile:
            compile_blocks(self.model_parts)
        named = [(n, p) for m in self.model_parts for n, p in m.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = build_optimizer(named, cfg.optim, cfg.model)  # names: μP groups by parameter name
        self.scheduler = build_scheduler(self.optimizer, cfg.train.steps, cfg.schedule)
        gb = cfg.train.global_batch_sequences
        self.loader = build_loader(cfg, rows, self.dims.dp_rank(rank), self.dims.dp)
        self._domain_epochs = getattr(self.loader, "epochs", None)  # mixture only: per-domain passes
        self.val_rows = val_rows
        local = gb // self.dims.dp
        self.pp_group = mesh["pp"].get_group() if self.dims.pp > 1 else None
        if self.dims.pp > 1:
            self.n_micro = cfg.parallel.pp_microbatches or self.dims.pp
            self.micro = local // self.n_micro
            self.schedule = build_schedule(
                self.model_parts,
                self.shard.stage_ids,
                self.shard.num_stages,
                cfg.parallel.pp_schedule,
                self.n_micro,
                self._loss,
                self.device,
                self.pp_group,
            )
        else:
            self.micro = cfg.train.micro_batch or local
            self.n_micro = local // self.micro
            self.schedule = None
        # a mixture of experts' routing: counts, load-balancing losses, the selection bias (inactive when dense)
        self.moe = MoERouting(
            self.model_parts,
            cfg.model.moe_layers,
            self.n_micro,
            1.0 if self.schedule is not None else 1.0 / self.n_micro,  # a schedule scales the gradients itself
            cfg.model.moe_bias_update_rate,
            self.dims.world_size > 1,
            copies=self.dims.tp,  # the ranks of a TP group route the same tokens
        )
        self.tokens_per_step = gb * cfg.train.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = (
            device_peak_flops(self.device, cfg.train.peak_flops, Path(cfg.data.cache_dir) / "cpu_peak.json")
            if measure_peak
            else 0.0
        )
        self.world_size = self.dims.world_size
        self.step = 0
        self.tokens = 0
        sup = cfg.supervisor
        self.detector = SpikeDetector(sup.spike_window, sup.spike_sigma, sup.spike_min_history, sup.spike_patience)
        self.skipped_steps = 0
        # rollback policy: the step that last raised SpikeRollback. A flagged run that starts again
        # at or before it (after the rollback and the data skip) is not rolled back a second time:
        # it falls back to the skip policy, whose patience bound accepts a persistent level. Kept in
        # this process, not in checkpoints (a restore must not forget it).
        self.rolled_back_at = 0
        # what a step changes outside the parameters and optimizer state, as it was when the step under way
        # began: ``discard_partial_step`` puts it back (a peer heal re-runs the step a lost rank interrupted).
        # Kept only where peer healing is on (``supervisor.peer_heal``): no other path undoes a step
        self._step_start: dict | None = None
        # replicas of this rank's parameter shard: the ranks that differ only in dp_replicate
        self.replicas = ReplicaCheck(
            self.params, mesh["dp_replicate"].get_group() if mesh is not None and self.dims.dp_replicate > 1 else None
        )

    # ---- pieces of a step ----
    def _autocast(self) -> contextlib.AbstractContextManager:
        if use_bf16(self.cfg):
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_ctx(self) -> contextlib.AbstractContextManager:
        """Vocab-parallel cross-entropy on TP-sharded logits (no logit all-gather)."""
        return loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext()

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (passed through ``loss_hook`` when one is set)."""
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if self.model_parts[0].training:  # a training step's, not validation's
            self._phase("forward")
        return loss if self.loss_hook is None else self.loss_hook(loss)

    def _phase(self, phase: str, step: int | None = None) -> None:
        """The drills' hook at ``phase`` of the step under way (``step``: after it was counted)."""
        if self.phase_hook is not None:
            self.phase_hook(self.step + 1 if step is None else step, phase)

    def _inputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inputs, targets (this CP rank's chunks of them) and, with document masking, the document ids of
        the whole input row (every CP rank masks its queries against all keys)."""
        x, y = batch[:, :-1], batch[:, 1:]
        docs = document_ids(x, self.eos_id) if self.eos_id is not None else None
        if self.dims.cp > 1:
            x, y = (
                shard_sequence(x, self.coords["cp"], self.dims.cp),
                shard_sequence(y, self.coords["cp"], self.dims.cp),
            )
        return x, y, docs

    @staticmethod
    def _kwargs(docs: torch.Tensor | None) -> dict:
        """The model's keyword inputs: a pipeline schedule splits them into microbatches for every stage."""
        return {} if docs is None else {"documents": docs}

    def _micro(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None):
        """(inputs, targets, model kwargs) of each microbatch."""
        parts = docs.split(self.micro) if docs is not None else [None] * len(x.split(self.micro))
        return zip(x.split(self.micro), y.split(self.micro), (self._kwargs(d) for d in parts))

    def _global_mean(self, local_loss: torch.Tensor) -> float:
        """Average the loss over the ranks that computed it (last stage; every dp, cp and tp rank)."""
        if self.world_size == 1:
            return local_loss.item()
        contrib = local_loss.detach().clone() if self.shard.has_last_stage else torch.zeros_like(local_loss)
        dist.all_reduce(contrib)
        return (contrib / (self.dims.dp * self.dims.cp * self.dims.tp)).item()

    def _step_totals(self, local_loss: torch.Tensor, fingerprint: int) -> tuple[float, int]:
        """The step's mean loss (as ``_global_mean``) and the fingerprint of its global batch's rows
        (``raysc.data.fingerprint``), in one all-reduce: every rank of a data-parallel index loaded
        the same rows, so the sum counts each slice world/dp times."""
        if self.world_size == 1:
            return local_loss.item(), fingerprint
        loss = (
            local_loss.detach().double()
            if self.shard.has_last_stage
            else torch.zeros((), dtype=torch.float64, device=self.device)
        )
        both = torch.stack(
            [loss.reshape(()), torch.tensor(float(fingerprint), dtype=torch.float64, device=self.device)]
        )
        dist.all_reduce(both)
        copies = self.world_size // self.dims.dp
        mean, total = both.tolist()
        return mean / (self.dims.dp * self.dims.cp * self.dims.tp), int(round(total)) // copies % PRIME

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            last = self.shard.has_last_stage
            args = (x,) if self.shard.has_first_stage else ()
            self.schedule.step(*args, target=y if last else None, losses=losses if last else None, **self._kwargs(docs))
            if not last:
                return torch.zeros((), device=self.device)
            return torch.stack([_local(loss.detach()) for loss in losses]).mean()
        total = torch.zeros((), device=self.device)
        for xb, yb, kw in self._micro(x, y, docs):
            with self._autocast():
                logits = self.model(xb, **kw)
            loss = self._loss(logits, yb)
            (loss / self.n_micro).backward()
            total += _local(loss.detach())
        return total / self.n_micro

    def train_step(self) -> dict:
        """One optimizer step over this rank's share of the next global batch."""
        t0 = time.perf_counter()
        if self.cfg.supervisor.peer_heal:
            self._step_start = self._progress_state()
        if self.step_hook is not None:
            self.step_hook(self.step + 1)
        rows = self.loader.next_batch()
        self._phase("data")
        fingerprint = rows_fingerprint(rows)  # on the host copy: no device sync before the forward
        batch = rows.to(self.device, non_blocking=True)
        x, y, docs = self._inputs(batch)
        with self._loss_ctx(), self._autocast():
            local_loss = self._forward_backward(x, y, docs)
        self._phase("backward")
        grad_norm = clip_grad_norm(self.params, self.cfg.optim.clip_norm or math.inf, self.pp_group)
        self._phase("clip")
        lr = self.scheduler.get_last_lr()[0]
        loss_value, fingerprint = self._step_totals(local_loss, fingerprint)  # the same on every rank
        if self.moe.active:
            self.moe.reduce()  # the step's tokens per expert, summed over the ranks (before the update)
        self._phase("totals")
        spike = None
        if self.cfg.supervisor.spike_policy != "off":
            spike = self.detector.check(loss_value, float(grad_norm))
        if spike is None:
            self.optimizer.step()
        else:
            self.skipped_steps += 1  # every rank skips: the same inputs give the same decision
        routing = self.moe.finish(updated=spike is None) if self.moe.active else {}
        self._phase("update")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._phase("end", self.step)
        self.tokens += self.tokens_per_step
        dt = time.perf_counter() - t0
        tps = self.tokens_per_step / dt
        mfu = tps * self.flops_per_token / (self.peak_flops * self.world_size) if self.peak_flops else 0.0
        sup = self.cfg.supervisor
        if spike is not None and sup.spike_policy == "rollback" and spike["consecutive"] >= sup.spike_patience:
            first = self.step - spike["consecutive"] + 1
            if first > self.rolled_back_at:  # at most one rollback for the same window
                self.rolled_back_at = self.step
                raise SpikeRollback(self.step, first, spike)
        metrics = {
            "step": self.step,
            "loss": loss_value,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": self.tokens,
            "step_time": dt,
            "tokens_per_s": tps,
            "mfu": mfu,
            "epoch": self.loader.epoch,
            "time": time.time(),
            "skipped": spike,
            "dp": self.dims.dp,
            "data_fp": fingerprint,
            "data_wait_s": round(getattr(self.loader, "wait_s", 0.0), 6),  # the step waited for its batch
        }
        metrics.update(routing)
        if self.detector.shift is not None:
            metrics["level_shift"] = self.detector.shift  # a persistent loss level was accepted
        if self._domain_epochs is not None and self.loader.epochs != self._domain_epochs:
            self._domain_epochs = self.loader.epochs
            metrics["domain_epochs"] = self._domain_epochs  # a domain ran out and started a new permutation
        return metrics

    @torch.no_grad()
    def val_loss(self, max_sequences: int = 256) -> float | None:
        """Mean loss on held-out rows (None when there are none); under pipeline parallelism the
        last stage computes it through the schedule's forward-only ``eval``."""
        if self.val_rows is None or len(self.val_rows) == 0:
            return None
        for part in self.model_parts:
            part.eval()
        rows = torch.from_numpy(self.val_rows[:max_sequences].astype(np.int64)).to(self.device)
        x, y, docs = self._inputs(rows)
        with self._loss_ctx():
            if self.schedule is not None:
                total = self._pipeline_val_sum(x, y, docs)
            else:
                total = torch.zeros((), device=self.device)
                for xb, yb, kw in self._micro(x, y, docs):
                    with self._autocast():
                        total += _local(self._loss(self.model(xb, **kw), yb)) * len(xb)
        for part in self.model_parts:
            part.train()
        return self._global_mean(total / len(rows))

    def _pipeline_val_sum(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        """Sum of per-row losses through the pipeline (zero off the last stage). One row per
        microbatch, so every call has the same shapes and any row count works: the last call is
        padded with copies of its last row, whose losses are dropped."""
        total = torch.zeros((), device=self.device)
        first, last, n = self.shard.has_first_stage, self.shard.has_last_stage, self.n_micro
        for start in range(0, len(x), n):
            real = min(n, len(x) - start)
            xb, yb, db = (t[start : start + n] if t is not None else None for t in (x, y, docs))
            if real < n:
                xb, yb, db = (
                    torch.cat([t, t[-1:].expand(n - real, -1)]) if t is not None else None for t in (xb, yb, db)
                )
            losses: list[torch.Tensor] = []
            with self._autocast():
                self.schedule.eval(
                    *((xb,) if first else ()),
                    target=yb if last else None,
                    losses=losses if last else None,
                    **self._kwargs(db),
                )
            total += sum((_local(loss) for loss in losses[:real]), torch.zeros((), device=self.device))
        return total

    # ---- a step interrupted by a peer's failure ----
    def _progress_state(self) -> dict:
        """The state a step advances before its update: the step count, the data position, the spike
        detector, the skip count and the RNG."""
        return {
            "step": self.step,
            "loader": self.loader.state_dict(),
            "detector": self.detector.state_dict(),
            "skipped_steps": self.skipped_steps,
            "torch_rng": torch.get_rng_state(),
        }

    def discard_partial_step(self) -> bool:
        """Undo a step that a failed collective interrupted before its update: gradients dropped, the data
        position, spike detector, skip count and RNG as they were at the step's start (the parameters and
        optimizer state are untouched until the update, which no collective follows inside a step).
        False when no step was under way (the last one completed)."""
        start = self._step_start
        if start is None or start["step"] != self.step:
            return False
        self.optimizer.zero_grad(set_to_none=True)
        self.moe.reset()  # the routing counts the undone step gathered
        self.loader.load_state_dict(start["loader"])
        self.detector.load_state_dict(start["detector"])
        self.skipped_steps = start["skipped_steps"]
        torch.set_rng_state(start["torch_rng"])
        self._step_start = None
        return True

    # ---- state outside the model/optimizer tensors (saved beside the DCP shards) ----
    def extra_state(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "loader": self.loader.state_dict(),
            "detector": self.detector.state_dict(),
            "skipped_steps": self.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
        }

    def load_extra_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.loader.load_state_dict(state["loader"])
        self._domain_epochs = getattr(self.loader, "epochs", None)
        if "detector" in state:
            self.detector.load_state_dict(state["detector"])
            self.skipped_steps = int(state.get("skipped_steps", 0))
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["cuda_rng"])
