"""The training thread's intra-op threads, and one for every other thread of the process.

PyTorch's OpenMP backend keeps the intra-op thread count per thread: ``torch.set_num_threads``
sets the calling thread's count and the count that any other thread takes the first time it runs
a parallel op. Threads besides the training thread do run parallel ops and then live on: gloo's
run-loop threads copy a checkpoint's pickled save plans (DCP's plan exchange, larger than one
grain), a data prefetcher builds batches. Each such thread then keeps an OpenMP team of its own,
and once libgomp manages more threads than the process has CPUs it stops spinning at its barriers
(its "throttled" spin count, which ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` do not lift): every
parallel op of the training thread then waits on futexes. Measured on a 2-core machine (tiny
config, 2 threads): steps 0.109 s before the first checkpoint save, 0.157 s after it, for the rest
of the run; the same after one ``all_gather_object`` of 1 MB over a world-1 gloo group, and with
this module 0.105-0.108 s before and after either.

``own_intraop_threads(n)`` gives the calling thread ``n`` threads and every thread that has not yet
run a parallel op one. The training thread must call it (Ray runs an actor's ``__init__`` on another
thread than its methods). It relies on the per-thread count above (torch 2.13's OpenMP build;
``tests/test_cpu_threads.py`` checks it, so an upgrade that changes it fails there).
"""

from __future__ import annotations

import threading

import torch


def own_intraop_threads(threads: int) -> None:
    """``threads`` intra-op threads for the calling thread, one for threads that start their parallel
    work later."""
    torch.set_num_threads(threads)
    torch.get_num_threads()  # this thread's count is settled now, not at its first parallel op
    others = threading.Thread(target=torch.set_num_threads, args=(1,), name="raysc-intraop-default")
    others.start()
    others.join()
