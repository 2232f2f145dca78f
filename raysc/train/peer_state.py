"""A rank's training state as a peer heal moves it: out of a ``Trainer`` whose process groups are
broken, into a rebuilt one, and from a surviving replica to the rank that replaces a lost one.

A rank's state is its local parameter shards, its optimizer state, a mixture of experts' selection
biases and what ``Trainer.extra_state``
holds (step, tokens, data position, spike detector, LR schedule, RNG), plus the optimizer's
param-group hyperparameters: ``LambdaLR.load_state_dict`` restores the schedule's counter but not the
``lr`` it last set, which the next update reads.

``state_tensors`` lists the tensors in one fixed order (the trainer's parameters, then each one's
optimizer state by key, then the selection biases), the order a replica broadcasts them in: replicas of a shard differ only in
their ``dp_replicate`` coordinate, so their local shapes are the same and no metadata travels with the
tensors. The optimizer state's structure (which keys, which are per-element tensors) travels once, in
``HeldState.optim`` through Ray, with its 0-dim counters (AdamW's ``step``, kept on the host).
We write this rather than use torch's ``_pg_transport`` (private, and it pickles its metadata into the
stream) or a DCP round trip (the checkpoint path a peer heal exists to avoid).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from raysc.train.sdc import local_tensor


@dataclass
class HeldState:
    """A rank's state outside any process group: ``tensors`` (plain local tensors, in ``state_tensors``
    order; empty where only the structure is sent), ``optim`` (per parameter: state key -> None for a
    tensor of the parameter's device and shape class, or the value of a 0-dim host tensor),
    ``groups`` (param-group hyperparameters), ``extra`` (``Trainer.extra_state``)."""

    optim: list[dict]
    groups: list[dict]
    extra: dict
    rolled_back_at: int = 0
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def small(self) -> HeldState:
        """The same state without its tensors: what a replacement gets through Ray."""
        return HeldState(self.optim, self.groups, self.extra, self.rolled_back_at)


def _is_moved(value: object) -> bool:
    """An optimizer-state entry that travels as a tensor (not as a 0-dim host counter)."""
    return torch.is_tensor(value) and value.dim() > 0


def state_tensors(trainer) -> list[torch.Tensor]:
    """The local tensors of ``trainer``'s parameters, then of their optimizer state (keys sorted), then a
    mixture of experts' selection biases (buffers a step moves: ``raysc.train.moe_routing``)."""
    tensors = [local_tensor(p).detach() for p in trainer.params]
    for p in trainer.params:
        state = trainer.optimizer.state.get(p, {})
        tensors += [local_tensor(state[k]) for k in sorted(state) if _is_moved(state[k])]
    for part in trainer.model_parts:
        tensors += [b for name, b in part.named_buffers() if name.endswith("router.expert_bias")]
    return tensors


def hold(trainer) -> HeldState:
    """``trainer``'s state as plain local tensors and host values, to outlive its process groups."""
    optim = []
    for p in trainer.params:
        state = trainer.optimizer.state.get(p, {})
        optim.append({k: None if _is_moved(v) else v.clone() for k, v in sorted(state.items())})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    return HeldState(optim, groups, trainer.extra_state(), trainer.rolled_back_at, state_tensors(trainer))


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a state tensor of ``param``: a DTensor on its mesh and placements when it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


@torch.no_grad()
def install(trainer, held: HeldState) -> None:
    """Give the freshly built ``trainer`` the state ``held`` describes: optimizer state entries
    allocated, hyperparameters, extra state and, when ``held`` carries tensors, their values (without,
    the tensors are then filled by ``receive``)."""
    for p, entries in zip(trainer.params, held.optim, strict=True):
        local = local_tensor(p)
        trainer.optimizer.state[p] = {
            k: _like(p, torch.empty_like(local)) if v is None else v.clone() for k, v in entries.items()
        }
    for group, hyper in zip(trainer.optimizer.param_groups, held.groups, strict=True):
        group.update(hyper)
    trainer.load_extra_state(held.extra)
    trainer.rolled_back_at = held.rolled_back_at
    if held.tensors:
        for dst, src in zip(state_tensors(trainer), held.tensors, strict=True):
            dst.copy_(src)


@torch.no_grad()
def broadcast_state(trainer, src: int, group) -> int:
    """Broadcast ``trainer``'s state tensors from global rank ``src`` over ``group`` (its replicas);
    returns the bytes sent by ``src``."""
    import torch.distributed as dist

    tensors = state_tensors(trainer)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)
    return sum(t.numel() * t.element_size() for t in tensors)
