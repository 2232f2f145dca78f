"""Peak memory of one rank's training, comparable with the planner's estimate.

CUDA: the caching allocator's ``max_memory_allocated`` (tensor bytes; the CUDA context and
NCCL buffers are not in it, as they are not in the estimate).

CPU: torch has no allocator statistics, so we read glibc's ``mallinfo2`` (bytes in use,
heap plus mmapped chunks, which is where every CPU tensor lives) at every module's forward
end and from a 2 ms sampling thread, and keep the maximum. That figure also holds the
process's own heap (Python objects, the data rows, gloo buffers); it is removed by
measuring the heap at a quiescent point after a step and subtracting what the tensors that
persist across steps (this rank's parameter shards and optimizer state, counted exactly)
occupy there: ``step peak = peak − (quiescent − persistent)``. What remains is measured:
gradients, activations, FSDP buffers and temporaries.

Start-up (``StartupPeak``): the same reading from before the model is built to the end of the first
step — materialising the shard, the first step's gathered FSDP units, gradients and the optimizer
state it creates — minus what was in use when the window opened. Nothing is subtracted for the heap:
the figure is an upper bound on what start-up adds to the rank.

Why our own: ``torch.profiler``'s CPU memory events do not give a usable timeline of live
bytes (tested: deltas only per op, not allocations), and ``ru_maxrss`` never goes down.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc_in_use():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return in_use


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def persistent_bytes(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """This rank's parameter shards and optimizer state, counted tensor by tensor."""
    seen, total = set(), 0
    for m in parts:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += _local_bytes(p)
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return total


class _Sampler:
    """The maximum of ``in_use()`` seen by a sampling thread and by ``sample`` calls (each module's
    forward end), within a CPU budget.

    ``mallinfo2`` walks every free chunk of every glibc arena and holds the arena's lock while it
    does: about 1 us on a fresh rank, 40 ms measured on a heap with 200,000 free chunks (a
    fragmented long-lived process). Read every 2 ms and at every module's end regardless, such a
    heap turned a rank's step into mostly readings (the suite's memory checks ran 3x slower when
    their processes inherited one). So the gap between readings grows with their measured cost:
    at least 2 ms on the thread, and never less than ``cost / BUDGET``: the readings take at most
    ``BUDGET`` of a core. On a fresh heap the hooks still read at nearly every module's end; on a
    fragmented one the peak is sampled more coarsely (``readings`` and ``reading_s`` say how much
    was spent).

    A reading's cost is the CPU time of the thread that made it, not the wall time: on a loaded
    machine a reading preempted by another process took 10 ms of wall time for microseconds of
    work, its 20x gap silenced the hooks and the thread for a whole step, and the step's
    backward peak went unseen (CI: every rank at half the planner's estimate).
    """

    BUDGET = 0.05  # the share of one core the readings may take
    INTERVAL_S = 0.002  # the thread's gap between readings on a cheap heap

    def __init__(self, in_use) -> None:
        self.in_use = in_use
        self.readings, self.reading_s, self._gap_s, self._next = 0, 0.0, 0.0, 0.0
        self.longest_s = 0.0  # the costliest single reading
        self._reading = threading.Lock()  # the thread and the hooks: one reading at a time, not two at once
        self.peak = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _read(self) -> int:
        t0 = time.thread_time()
        value = self.in_use()
        cost = time.thread_time() - t0
        self.readings += 1
        self.reading_s += cost
        self.longest_s = max(self.longest_s, cost)
        self._gap_s = cost / self.BUDGET
        self._next = time.perf_counter() + self._gap_s
        return value

    def sample(self) -> None:
        """One reading, unless the last one was less than its cost's budget ago."""
        if time.perf_counter() >= self._next and self._reading.acquire(blocking=False):
            try:
                self.peak = max(self.peak, self._read())
            finally:
                self._reading.release()

    def _run(self) -> None:
        while not self._stop.wait(max(self.INTERVAL_S, self._gap_s)):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._reading:
            self.peak = max(self.peak, self._read())


class StartupPeak:
    """Peak bytes a rank adds from ``__init__`` (before its model is built) to ``stop()`` (after its first
    step): the CUDA allocator's peak, or glibc's in-use bytes sampled every 2 ms, minus those at start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sampler = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self._start = torch.cuda.memory_allocated(device)
            return
        in_use = _libc_in_use()
        if in_use is None:
            raise RuntimeError("no glibc mallinfo2 in this process: start-up memory cannot be measured on CPU")
        self._sampler = _Sampler(in_use)
        self._start = self._sampler.peak

    def peak(self) -> int:
        """The peak bytes above those in use when the window opened, so far (the window stays open)."""
        if self._sampler is None:
            return torch.cuda.max_memory_allocated(self.device) - self._start
        self._sampler.sample()
        return self._sampler.peak - self._start

    def stop(self) -> int:
        """Close the window; its peak bytes above those in use when it opened."""
        if self._sampler is not None:
            self._sampler.stop()
        return self.peak()


class PeakMemory:
    """Tracks the peak of each training step: ``before_step`` opens a window, ``after_step`` closes it."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.parts, self.optimizer, self.device = parts, optimizer, device
        self.steps = 0
        self.step_peaks: list[int] = []  # per step from the second (AdamW state exists)
        in_use = None if device.type == "cuda" else _libc_in_use()
        self.available = device.type == "cuda" or in_use is not None
        self._sampler = _Sampler(in_use) if in_use is not None else None
        self._hooks = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        elif self._sampler is not None:
            for m in parts:
                for mod in m.modules():
                    self._hooks.append(mod.register_forward_hook(lambda *_: self._sampler.sample()))

    def before_step(self) -> None:
        """Open a step's window: what ran between steps (timeout calibration, the collective stress
        loop, checkpoint staging) does not count toward the training peak."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._sampler is not None:
            self._sampler.peak = self._sampler.in_use()

    def after_step(self) -> None:
        """Close one step: from the second step on (AdamW state exists), update the model peak."""
        self.steps += 1
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.steps > 1:
                self.step_peaks.append(peak)
            return
        if self._sampler is None:
            return
        quiescent = self._sampler.in_use()
        fixed = quiescent - persistent_bytes(self.parts, self.optimizer)
        if self.steps > 1:
            self.step_peaks.append(self._sampler.peak - fixed)
        self._sampler.peak = quiescent

    def report(self) -> dict:
        """``peak_bytes``: the median of the steps' peaks (a step is the unit that repeats; one window
        caught by a between-step allocation freed late must not stand for the run); ``max_bytes``."""
        peaks = sorted(self.step_peaks) or [0]
        return {
            "peak_bytes": int(peaks[len(peaks) // 2]),
            "max_bytes": int(peaks[-1]),
            "steps": self.steps,
            "method": "cuda allocator" if self.device.type == "cuda" else "glibc mallinfo2 minus heap",
        }

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        for h in self._hooks:
            h.remove()
        self._hooks = []
