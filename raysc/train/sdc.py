"""Silent-data-corruption checks: compare parameter fingerprints across data-parallel replicas.

Ranks that differ only in their ``dp_replicate`` coordinate hold bit-identical
parameter shards after every optimizer step (their gradients are all-reduced, so
every replica applies the same update). Every ``supervisor.sdc_every_steps`` each
rank fingerprints its local parameter shards, the replicas of a shard exchange
fingerprints (one small all-gather over the ``dp_replicate`` group) and vote:

- all equal: the check passes;
- a strict majority agrees (three or more replicas): the others are corrupt and
  are restored from a healthy replica by broadcast (``repair``);
- no majority (two replicas disagree): nobody can tell which is right, so the run
  rolls back to the newest checkpoint taken at or before the last passing check.

The fingerprint is exact rather than statistical: each tensor's bytes are read
as integers of the element's width and summed in int64, so flipping any single
bit changes that tensor's sum by ±2^k and is always detected (two flips could
cancel; a float checksum would miss low mantissa bits). One pass over the
parameters, on the device that holds them, no host copy of the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raysc.train.signals import SilentCorruption

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its bytes read as integers of the element width."""
    sums = []
    for t in tensors:
        t = local_tensor(t).detach().contiguous().reshape(-1)
        sums.append(torch.sum(t.view(_INT_VIEW[t.element_size()]), dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def vote(prints: list[list[int]]) -> dict:
    """Decide from the fingerprints of each replica (list index = replica index) which replicas
    are bad and which healthy one restores them (``source`` None when there is no majority)."""
    groups: dict[tuple, list[int]] = {}
    for replica, fp in enumerate(prints):
        groups.setdefault(tuple(fp), []).append(replica)
    n = len(prints)
    if len(groups) == 1:
        return {"ok": True, "bad": [], "source": None, "replicas": n}
    best = max(groups.values(), key=len)
    ref = prints[best[0]]
    differing = sorted({i for fp in prints for i, v in enumerate(fp) if v != ref[i]})
    if len(best) * 2 > n:  # a strict majority agrees: the rest are the corrupt minority
        return {
            "ok": False,
            "bad": [r for r in range(n) if r not in best],
            "source": best[0],
            "replicas": n,
            "tensors": differing[:8],
        }
    return {"ok": False, "bad": list(range(n)), "source": None, "replicas": n, "tensors": differing[:8]}


class ReplicaCheck:
    """The SDC check of one rank: its replica group, the vote, and the repair by broadcast."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.params = params
        self.group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else []
        self.verdict: dict | None = None

    @property
    def enabled(self) -> bool:
        return len(self.ranks) > 1

    def run(self, step: int) -> dict:
        """Collective over every rank: exchange fingerprints inside the replica group, then agree
        world-wide whether any group disagreed. Raises ``SilentCorruption`` on every rank if so."""
        fp = fingerprint(self.params)
        gathered = [torch.empty_like(fp) for _ in self.ranks]
        dist.all_gather(gathered, fp, group=self.group)
        verdict = vote([g.tolist() for g in gathered])
        verdict["global_ranks"] = list(self.ranks)
        flag = torch.tensor([0 if verdict["ok"] else 1], dtype=torch.int64, device=fp.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank takes the same branch
        self.verdict = verdict
        if flag.item():
            raise SilentCorruption(
                step,
                {}
                if verdict["ok"]
                else {k: verdict[k] for k in ("bad", "source", "replicas", "global_ranks", "tensors")},
            )
        return verdict

    @torch.no_grad()
    def repair(self, optimizer: torch.optim.Optimizer) -> bool:
        """Broadcast parameters and optimizer state from the healthy replica chosen by the vote to
        the rest of this rank's replica group (a collective over that group only; groups whose
        check passed do nothing). False if this group has no majority to restore from."""
        v = self.verdict or {"ok": True}
        if v["ok"]:
            return True
        if v["source"] is None:
            return False
        src = self.ranks[v["source"]]
        tensors = [local_tensor(p) for p in self.params]
        device = tensors[0].device
        for state in optimizer.state.values():  # AdamW moments; its CPU step counters agree already
            tensors += [local_tensor(t) for t in state.values() if torch.is_tensor(t) and t.device == device]
        for t in tensors:
            dist.broadcast(t.detach(), src=src, group=self.group)
        return True


@torch.no_grad()
def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 22) -> None:
    """Fault injection: flip one bit of element ``index`` of ``t``'s local data, in place (bit 0 =
    the lowest mantissa bit, 8 * element size - 1 = the sign bit)."""
    flat = local_tensor(t).detach().reshape(-1)
    width = 8 * flat.element_size()
    if not 0 <= bit < width:
        raise ValueError(f"bit {bit} is outside a {width}-bit element")
    ints = flat.view(_INT_VIEW[flat.element_size()])
    # the top bit as a signed integer of that width (1 << (width - 1) overflows it), except uint8
    ints[index] ^= (1 << bit) - (1 << width if bit == width - 1 and ints.is_signed() else 0)
