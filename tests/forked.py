"""Gloo ranks for tests, forked from a small server process (``run_forked``), not from pytest.

Not spawned: a fresh interpreter per rank re-imports torch (about 2 s of CPU each on this machine),
which costs more than most checks. Not forked from the test process either: late in the suite that
process holds a large, fragmented heap (vLLM, transformers, llama.cpp, Ray, every earlier test's
leftovers), and a child forked from it inherits it. glibc's ``mallinfo2``, which the memory checks
sample every 2 ms (``raysc.train.memory``), walks every free chunk of that heap (measured here: 40 ms
a call with 200,000 free chunks, 1 us on a clean heap) and the children's garbage collections walk
every inherited object. The forked tests ran 2.5-3.4x slower in the suite than alone (CI at 9916901:
the plan memory check 116 s against 34 s, the start-up memory check 57 s against 23 s).

So the ranks fork from multiprocessing's forkserver: one clean interpreter per session that has
imported torch and the trainer once; each rank imports only its test module. Arguments and results
travel by pickle (a ``Manager`` dict or a file), so a rank sees nothing of the test process but
them and the environment the forkserver started with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "raysc.train.trainer", "raysc.parallel.dims"]


def run_forked(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the session's forkserver; raises if any
    of them fails. ``fn`` must be a module-level function of an importable module (a test module)."""
    mp.set_forkserver_preload(PRELOAD)  # read when the forkserver first starts; later calls change nothing
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
