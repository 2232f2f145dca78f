"""The training thread keeps its intra-op threads, and a checkpoint's collectives leave no OpenMP
team behind (raysc.train.cpu_threads): without it every CPU run trained 35-45% slower after its
first checkpoint save."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, os, threading
import torch
import torch.distributed as dist
from raysc.cluster.ports import free_port
from raysc.train.cpu_threads import own_intraop_threads

own_intraop_threads(2)
seen = {}
def later_thread():
    seen["later"] = torch.get_num_threads()
t = threading.Thread(target=later_thread); t.start(); t.join()
(torch.ones(1 << 20) * 2).sum()  # the training thread's own team
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
group = dist.new_group(backend="gloo")
dist.all_gather_object([None], b"x", group=group)  # gloo's run-loop threads have started
before = len(os.listdir("/proc/self/task"))
dist.all_gather_object([None], bytes(1 << 20), group=group)  # as large as a checkpoint's save plans
after = len(os.listdir("/proc/self/task"))
dist.destroy_process_group()
print(json.dumps({"main": torch.get_num_threads(), "later": seen["later"], "before": before, "after": after}))
"""


def test_training_thread_keeps_its_threads_and_collectives_start_no_team():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["main"] == 2, got  # the thread that trains keeps the count it asked for
    assert got["later"] == 1, got  # a thread that starts later gets one
    # a living thread with a team of its own would be one more thread, and slow every later step
    assert got["after"] == got["before"], got
