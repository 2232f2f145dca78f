"""``Relay``: one tracker's calls made on a thread of their own, buffered and retried.

A tracker is a network service (or a disk) that may be down, slow or refusing; training must never
wait on it nor end because of it. The supervisor hands each call to a relay, which returns at once;
the relay's thread makes the calls in order, and a call that raises is retried with a growing wait
(1 s doubling up to ``retry_max_s``) while later calls queue behind it, so the tracker sees the run
in order once it is back. At most ``buffer`` calls wait; past that the oldest metric batches are
dropped (counted), never the calls that open the run or mark a rollback.

Why our own thread and not the trackers' async modes: MLflow's ``log_batch`` has no retrying async
path for a server that is down (its async logging drops a failed batch), TensorBoard's writer has
none needed, and W&B's service process already buffers; one mechanism for all three keeps the
behaviour, the events and ``raysc status`` the same whichever the user picks.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Sink(Protocol):
    """What a tracker implements (``raysc.track.tb_sink``, ``mlflow_sink``, ``wandb_sink``)."""

    name: str

    def open(self, run_id: str | None) -> str:
        """Start or continue the tracker's run (``run_id``: the one this raysc run logged to before);
        return its id."""

    def params(self, params: dict[str, str], tags: dict[str, str]) -> None: ...

    def metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        """Rows of (step, unix time, values)."""

    def text(self, step: int, tag: str, text: str) -> None: ...

    def rewind(self, step: int, why: str) -> None:
        """Steps after ``step`` are re-run: what was logged for them is replaced (or marked)."""

    def close(self, status: str) -> None:
        """End the tracker's run: FINISHED, FAILED or KILLED (stopped on request)."""


@dataclass
class RelayState:
    """What ``raysc status`` and the events say of one tracker."""

    name: str
    run_id: str | None = None
    healthy: bool = True
    down_since: float | None = None
    last_error: str = ""
    sent: int = 0  # metric rows delivered
    dropped: int = 0  # metric rows dropped from a full buffer
    pending: int = 0
    failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "healthy": self.healthy,
            "last_error": self.last_error,
            "sent": self.sent,
            "dropped": self.dropped,
            "pending": self.pending,
            "failures": self.failures,
            **self.extra,
        }


class Relay:
    def __init__(
        self,
        sink: Sink,
        buffer: int,
        retry_max_s: float,
        report: Callable[[str, dict[str, Any]], None],
        run_id: str | None = None,
        on_open: Callable[[str, str], None] | None = None,
        open_lock: threading.Lock | None = None,
    ) -> None:
        """``open_lock``: held while the tracker opens (see ``_do``), shared by one run's relays."""
        self.sink = sink
        self.open_lock = open_lock or threading.Lock()
        self.buffer = buffer
        self.retry_max_s = retry_max_s
        self.report = report  # (event kind, fields): tracker_degraded / tracker_recovered
        self.on_open = on_open  # (tracker, its run id) once opened
        self.state = RelayState(sink.name, run_id)
        self._q: collections.deque[tuple[str, tuple]] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._closed = False  # the close call was delivered (so was everything before it)
        self._abandoned = False  # close() gave up waiting: the thread ends at its next failure
        self._thread = threading.Thread(target=self._loop, name=f"tracker-{sink.name}", daemon=True)
        self._q.append(("open", (run_id,)))
        self._thread.start()

    # ---- called by the supervisor: never blocks on the tracker ----
    def call(self, op: str, *args: Any) -> None:
        with self._cv:
            # one batch for the tracker: merged into the last queued call, never into the first, which
            # the relay's thread may be sending already (rows added to it then would be lost)
            if op == "metrics" and len(self._q) > 1 and self._q[-1][0] == "metrics":
                self._q[-1] = ("metrics", (self._q[-1][1][0] + args[0],))
            else:
                self._q.append((op, args))
            self._shed()
            self.state.pending = self._rows()
            self._cv.notify()

    def close(self, status: str, timeout_s: float) -> bool:
        """Deliver what is queued within ``timeout_s`` (then give up on it), and close the tracker's
        run with ``status``; whether everything was delivered."""
        self.begin_close(status)
        return self.wait_closed(timeout_s)

    def begin_close(self, status: str) -> None:
        """Queue the close of the tracker's run (several relays then close side by side)."""
        with self._cv:
            self._closing = True
            self._q.append(("close", (status,)))
            self._cv.notify()

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the close; give up on what is left after that."""
        self._thread.join(timeout_s)
        if not self._closed:
            with self._cv:
                self._abandoned = True
                self._cv.notify()
        return self._closed

    # ---- the relay's thread ----
    def _rows(self) -> int:
        return sum(len(args[0]) for op, args in self._q if op == "metrics")

    def _shed(self) -> None:
        """Drop the oldest metric rows while more than ``buffer`` rows wait (never from the first
        call, which the relay's thread may be sending)."""
        while self._rows() > self.buffer:
            i = next((i for i, (op, _) in enumerate(self._q) if op == "metrics" and i > 0), None)
            if i is None:
                return
            rows = self._q[i][1][0]
            over = self._rows() - self.buffer
            if len(rows) <= over:
                del self._q[i]
                self.state.dropped += len(rows)
            else:
                self._q[i] = ("metrics", (rows[over:],))
                self.state.dropped += over

    def _loop(self) -> None:
        wait = 1.0
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                op, args = self._q[0]
            try:
                self._do(op, args)
            except Exception as e:  # the tracker refused or is unreachable: keep the call, retry
                self._failed(e)
                if self._abandoned:
                    return  # close() stopped waiting: what is queued stays undelivered (close said so)
                self._pause(wait)
                wait = min(wait * 2, self.retry_max_s)
                continue
            wait = 1.0
            with self._cv:
                self._q.popleft()
                self.state.pending = self._rows()
            if op == "metrics":
                self.state.sent += len(args[0])
            self._recovered()
            if op == "close":
                self._closed = True
                return

    def _pause(self, seconds: float) -> None:
        """Wait before a retry; new calls do not cut it short, a close does (one more try, sooner)."""
        end = time.monotonic() + seconds
        closing = self._closing
        with self._cv:
            while time.monotonic() < end and self._closing == closing and not self._abandoned:
                self._cv.wait(end - time.monotonic())

    def _do(self, op: str, args: tuple) -> None:
        if op == "open":
            # one tracker opens at a time: opening imports its library (and W&B's and MLflow's imports
            # parse source with ``ast``), and CPython 3.11 keeps the ast constructor's recursion depth per
            # interpreter, not per thread (gh-106905): two parsed side by side on two relays' threads
            # failed with "SystemError: AST constructor recursion depth mismatch" and left wandb half
            # imported for the rest of the process (every retry then failed)
            with self.open_lock:
                self.state.run_id = self.sink.open(self.state.run_id)
            if self.on_open is not None:
                self.on_open(self.sink.name, self.state.run_id)
        else:
            getattr(self.sink, op)(*args)

    def _failed(self, e: Exception) -> None:
        st = self.state
        st.failures += 1
        st.last_error = f"{type(e).__name__}: {e}"[:500]
        if st.healthy:
            st.healthy, st.down_since = False, time.monotonic()
            self.report(
                "tracker_degraded",
                {
                    "tracker": st.name,
                    "error": st.last_error,
                    "pending": st.pending,
                    "note": "training goes on; calls are buffered and retried",
                },
            )

    def _recovered(self) -> None:
        st = self.state
        if not st.healthy:
            down = time.monotonic() - (st.down_since or time.monotonic())
            st.healthy, st.down_since, st.last_error = True, None, ""
            self.report(
                "tracker_recovered",
                {"tracker": st.name, "down_s": round(down, 2), "failures": st.failures, "dropped": st.dropped},
            )
