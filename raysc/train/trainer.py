"""The training state of one worker and its optimizer step.

``Trainer`` owns the model, AdamW, the LR schedule and the batch loader, and runs
one optimizer step with gradient accumulation, clipping and metrics. The same
class runs inside a ``TrainWorker`` actor and in a plain torch loop
(``benchmarks/train_overhead.py``), so the actor path adds nothing but Ray.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from raysc.config.schema import Config
from raysc.data.loader import BatchLoader
from raysc.model.flops import flops_per_token
from raysc.model.llama import build_model
from raysc.train.optim import build_optimizer, build_scheduler
from raysc.train.throughput import device_peak_flops


def resolve_device(cfg: Config) -> torch.device:
    if cfg.parallel.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.device='cuda' but this worker sees no CUDA device; "
                               "use parallel.device='cpu' or request GPUs for the workers")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def use_bf16(cfg: Config) -> bool:
    return cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and cfg.parallel.device == "cuda")


class Trainer:
    def __init__(self, cfg: Config, rows: np.ndarray, val_rows: np.ndarray | None = None,
                 dp_rank: int = 0, dp_size: int = 1, measure_peak: bool = True) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, cfg.rope_len, cfg.train.seed, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.steps, cfg.schedule)
        gb = cfg.train.global_batch_sequences
        self.loader = BatchLoader(rows, cfg.train.seed, gb, dp_rank, dp_size)
        self.val_rows = val_rows
        local = gb // dp_size
        self.micro = cfg.train.micro_batch or local
        self.n_micro = local // self.micro
        self.tokens_per_step = gb * cfg.train.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = device_peak_flops(self.device, cfg.train.peak_flops) if measure_peak else 0.0
        self.world_size = dp_size
        self.step = 0
        self.tokens = 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if use_bf16(self.cfg):
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        with self._autocast():
            logits = self.model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def train_step(self) -> dict:
        """One optimizer step over this rank's share of the next global batch."""
        t0 = time.perf_counter()
        batch = self.loader.next_batch().to(self.device, non_blocking=True)
        total = torch.zeros((), device=self.device)
        for mb in batch.split(self.micro):
            loss = self._loss(mb)
            (loss / self.n_micro).backward()
            total += loss.detach()
        max_norm = self.cfg.optim.clip_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = (total / self.n_micro).item()
        self.step += 1
        self.tokens += self.tokens_per_step
        dt = time.perf_counter() - t0
        tps = self.tokens_per_step / dt
        mfu = tps * self.flops_per_token / (self.peak_flops * self.world_size) if self.peak_flops else 0.0
        return {"step": self.step, "loss": loss_value, "grad_norm": float(grad_norm), "lr": lr,
                "tokens": self.tokens, "step_time": dt, "tokens_per_s": tps, "mfu": mfu,
                "epoch": self.loader.epoch, "time": time.time()}

    @torch.no_grad()
    def val_loss(self, max_sequences: int = 256) -> float | None:
        if self.val_rows is None or len(self.val_rows) == 0:
            return None
        was_training = self.model.training
        self.model.eval()
        rows = torch.from_numpy(self.val_rows[:max_sequences].astype(np.int64)).to(self.device)
        losses = [self._loss(mb) * len(mb) for mb in rows.split(self.micro)]
        self.model.train(was_training)
        return float(torch.stack(losses).sum() / len(rows))

    # ---- state outside the model/optimizer tensors (saved beside the DCP shards) ----
    def extra_state(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "loader": self.loader.state_dict(),
                "scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None}

    def load_extra_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.loader.load_state_dict(state["loader"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["cuda_rng"])
