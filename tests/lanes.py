"""The two lanes ``make test`` runs side by side (``pytest -n 2``): which module runs in which, the xdist
scheduler that keeps them apart, and each lane's time in the summary. Registered by ``conftest.py``."""

from __future__ import annotations

import time

import pytest

GPU_NOTICE = "{n} GPU tests deselected: run `make test-gpu` (pytest -m gpu) on a CUDA machine"
GPU_DESELECTED = pytest.StashKey[int]()


# `make test` runs the suite in two pytest-xdist workers (`-n 2`), one lane each: the modules that start
# Ray clusters of their own (the multi-node and autoscaling clusters, the `ray start` head, README
# commands on the machine's own Ray, vLLM in a subprocess) or need no Ray, and the rest, on this
# session's Ray (``ray_session``: Serve and vLLM on it too). Each shared thing is still built once, in
# the one lane that uses it, and a module never straddles the lanes (its fixtures would be built
# twice). Measured on 2 cores: the suite kept the cores 44% idle on average, the tests on their own
# clusters most (they wait on nodes, raylets, jobs), which the other lane fills. The lanes are named
# here, not derived from the fixtures, because xdist's controller schedules by test id without
# collecting (and pytest 9 ignores the id suffix that xdist's own ``--dist loadgroup`` relies on).
OWN_CLUSTERS_LANE = {
    "test_multinode.py",
    "test_elastic.py",
    "test_autoscaling.py",
    "test_job_submit.py",
    "test_grafana.py",
    "test_stop.py",
    "test_newcomer.py",
    "test_families.py",
    "test_startup_memory.py",
    "test_scaling.py",
    "test_stability.py",
    "test_materialise.py",
}


def lane(nodeid: str) -> str:
    """The lane of a test id: "own-clusters" or "session-ray"."""
    return "own-clusters" if nodeid.split("::")[0].rsplit("/", 1)[-1] in OWN_CLUSTERS_LANE else "session-ray"


class Lanes:
    """The lanes' scheduler (on xdist's controller); the check that no test of the own-clusters lane
    uses this session's Ray (a second instance beside the other lane's); a worker's count of
    deselected GPU tests carried to the controller, which prints the notice."""

    def __init__(self) -> None:
        self.gpu_deselected = 0
        self.started = time.monotonic()
        self.lane_time: dict[str, list[float]] = {}  # lane -> [seconds in its tests, when its last one ended]

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class LaneScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return lane(nodeid)

        return LaneScheduling(config, log)

    def pytest_collection_modifyitems(self, config, items):
        wrong = sorted(
            {
                item.nodeid.split("::")[0]
                for item in items
                if lane(item.nodeid) == "own-clusters" and "ray_session" in getattr(item, "fixturenames", ())
            }
        )
        if wrong:
            raise pytest.UsageError(
                f"{', '.join(wrong)} use(s) ray_session but sit(s) in the own-clusters lane: "
                f"take the module out of OWN_CLUSTERS_LANE in tests/lanes.py"
            )

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workeroutput"):  # an xdist worker
            session.config.workeroutput["gpu_deselected"] = session.config.stash.get(GPU_DESELECTED, 0)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):  # on the controller, once per worker
        self.gpu_deselected = max(self.gpu_deselected, getattr(node, "workeroutput", {}).get("gpu_deselected", 0))

    def pytest_runtest_logreport(self, report):
        if hasattr(report, "node"):  # on the controller, a worker's report: each lane's load and end
            spent = self.lane_time.setdefault(lane(report.nodeid), [0.0, 0.0])
            spent[0] += report.duration
            spent[1] = time.monotonic() - self.started

    def pytest_terminal_summary(self, terminalreporter):
        if self.gpu_deselected:
            terminalreporter.write_line(GPU_NOTICE.format(n=self.gpu_deselected))
        for name, (spent, ended) in sorted(self.lane_time.items()):
            terminalreporter.write_line(f"lane {name}: {spent:.0f} s in its tests, done {ended:.0f} s after the start")
