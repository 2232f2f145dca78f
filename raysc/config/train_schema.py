"""The ``[optim]``, ``[schedule]`` and ``[train]`` sections: the AdamW optimizer, the learning-rate
schedule, and the training loop itself (steps, batch sizes, precision, compile, logging, graceful stop)."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt


@dataclass
class OptimConfig:
    lr: float = opt(3e-3, "peak learning rate", gt=0.0)
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay on matrices", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=0.999999)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=0.999999)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0.0)
    clip_norm: float = opt(1.0, "clip the global gradient norm to this value; 0 disables", min=0.0)


@dataclass
class ScheduleConfig:
    warmup_steps: int = opt(20, "linear warmup from 0 to optim.lr", min=0)
    decay: str = opt("cosine", "shape after warmup", choices=["cosine", "linear", "constant"])
    min_lr_ratio: float = opt(0.1, "floor of the decay as a fraction of optim.lr", min=0.0, max=1.0)


@dataclass
class TrainConfig:
    steps: int = opt(300, "optimizer steps", min=1)
    seq_len: int = opt(128, "tokens per training sequence", min=2)
    global_batch: int = opt(16, "sequences per optimizer step (or set global_batch_tokens instead)", min=0)
    global_batch_tokens: int = opt(0, "tokens per optimizer step; must be a multiple of seq_len", min=0)
    micro_batch: int = opt(0, "sequences per forward pass on one worker; 0 = whole local batch", min=0)
    seed: int = opt(1234, "seeds the model init, the data order and every RNG", min=0)
    document_mask: bool = opt(
        False,
        "block-causal attention: a token attends only to earlier tokens of its own "
        "document (boundaries at the tokenizer's EOS in each packed row)",
    )
    document_positions: bool = opt(False, "with document_mask: rotary positions restart at 0 at each document")
    dtype: str = opt(
        "auto", "compute precision: auto = fp32 on cpu, bf16 autocast on cuda", choices=["auto", "fp32", "bf16"]
    )
    compile: bool = opt(
        False,
        "compile each transformer block with torch.compile (inductor) before the first "
        "step (raysc.train.compile): faster steps and less activation memory; the first "
        "step pays the compile (seconds on a GPU, ~30 s for a tiny model on 2 CPU cores)",
    )
    peak_flops: float = opt(0.0, "peak FLOP/s of one device for MFU; 0 = GPU table or measured CPU matmul", min=0.0)
    log_every: int = opt(10, "print a progress line every N steps", min=1)
    require_preflight: bool = opt(
        False, "refuse to start unless <run.dir>/preflight.json (raysc preflight) passed for this same config"
    )
    measure_memory: bool = opt(
        False,
        "report every rank's peak memory in the run summary (always on with CUDA: "
        "the allocator's peak; on CPU it samples glibc's heap every 2 ms)",
    )
    save_on_stop: bool = opt(
        True,
        "on SIGINT / SIGTERM to the driver (Ctrl-C, ray job stop): save a checkpoint of "
        "the step reached unless it is committed, then exit 130 / 143",
    )
    stop_timeout_s: float = opt(
        300.0,
        "longest graceful stop (finish the step, save, shut down); then the run is "
        "aborted, keeping the last committed checkpoint",
        gt=0.0,
    )

    @property
    def global_batch_sequences(self) -> int:
        if self.global_batch:
            return self.global_batch
        return self.global_batch_tokens // self.seq_len
