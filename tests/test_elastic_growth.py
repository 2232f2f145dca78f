"""An elastic run's growth request, on this session's Ray: once Ray has placed it, the supervisor's next look
(one non-blocking check at a checkpoint boundary) sees it. (tests/test_elastic.py runs the whole shrink and
growth on an autoscaling cluster, in the other lane: a module there may not use this session's Ray.)"""

from __future__ import annotations

import time
from pathlib import Path

from conftest import TINY
from raysc.config.load import load_config
from raysc.fleet.elastic import Elastic

ROOT = Path(__file__).resolve().parents[1]


def test_a_placed_growth_request_is_seen_at_the_next_look(ray_session):
    from ray.util.placement_group import placement_group_table

    cfg = load_config(
        ROOT / "jobs/configs/tiny.toml",
        [*TINY, "parallel.elastic=true", "parallel.dp_replicate=2", "run.name=growth-check"],
    )
    el = Elastic(cfg)
    el.resize(1)  # a node was lost: the run trains at half its size and asks for the rest
    el.request_growth()
    try:
        deadline = time.monotonic() + 60
        while placement_group_table(el.request)["state"] != "CREATED":
            assert time.monotonic() < deadline, placement_group_table(el.request)
            time.sleep(0.2)
        time.sleep(0.5)  # a boundary comes some time after the placement, never at the same instant
        # one look, as the supervisor's at a boundary: a check that asked Ray anew each time never got its answer
        # within the look, and the run stayed small while the room it asked for sat idle
        assert el.grow_ready()
    finally:
        el.cancel()
    assert el.request is None and not el.grow_ready()
