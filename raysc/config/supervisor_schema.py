"""The ``[supervisor]`` section: how the driver keeps a run alive: hang and start timeouts and their
calibration, loss-spike handling (skip / rollback), restarts, warm spares and the worker pool, silent
data corruption checks and fault injection (``raysc.fleet``, docs/resilience.md)."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.faults import KINDS as FAULT_KINDS
from raysc.config.faults import PHASES as FAULT_PHASES
from raysc.config.options import opt


@dataclass
class SupervisorConfig:
    hang_timeout_s: float = opt(
        600.0,
        "treat the fleet as hung when no worker reports progress for this long "
        "(before calibration, and while saving or restoring; a fleet's start-up and setup are "
        "bounded by start_timeout_s instead)",
        gt=0.0,
    )
    start_timeout_s: float = opt(
        60.0,
        "fail when the worker placement group cannot be scheduled in time, or a "
        "worker process has not started within this long (a restart's fleet: "
        "timeout_factor × the run's measured fleet start, when that is more)",
        gt=0.0,
    )
    node_wait_s: float = opt(
        300.0,
        "after a node is lost, how long the restart waits for the fleet to fit again "
        "(on the surviving nodes, or on a replacement node joining) before the run fails",
        gt=0.0,
    )
    spike_policy: str = opt(
        "skip",
        "on a loss spike or a NaN/Inf loss or grad norm: skip the update on every "
        "rank, and after spike_patience spikes in a row accept the new loss level; "
        "rollback = skip, and after spike_patience flagged steps in a row restore "
        "the checkpoint before them and skip skip_batches batches (once per window: "
        "if they are flagged again, the skip rule applies); or off",
        choices=["skip", "rollback", "off"],
    )
    spike_patience: int = opt(
        3,
        "flagged steps in a row that trigger a rollback; under skip, the most loss-spike "
        "updates skipped in a row (the weights do not move meanwhile): the next step at "
        "that level is accepted and the window moves to it",
        min=1,
    )
    router_collapse: str = opt(
        "warn",
        "a mixture of experts whose router collapsed (a layer's tokens on a few experts, or experts that "
        "got no token, for router_window steps): warn (a router_collapse event) or stop (save and stop)",
        choices=["warn", "stop"],
    )
    router_window: int = opt(100, "mixture of experts: the steps a router collapse must last to be one", min=2)
    router_collapse_load: float = opt(
        0.6,
        "mixture of experts: a layer collapsed when its busiest expert's load (max/mean) stays at or above "
        "this fraction of the most it can be (E/top_k, all of a layer's tokens on top_k experts)",
        gt=0.0,
        max=1.0,
    )
    skip_batches: int = opt(200, "batches of data skipped after a rollback (PaLM skipped 200-500)", min=0)
    spike_window: int = opt(128, "steps in the rolling window the spike detector compares against", min=2)
    spike_sigma: float = opt(
        6.0,
        "flag a step whose loss is more than this many standard deviations above the "
        "window's mean (one-sided; the grad norm's z-score is reported, it never flags "
        "a finite step alone)",
        gt=0.0,
    )
    spike_min_history: int = opt(16, "accepted steps seen before loss spikes are judged (NaN/Inf always are)", min=2)
    max_restarts: int = opt(
        3,
        "restarts and rollbacks in a row (no chunk of training completing in between) "
        "before the run gives up; 0 = fail on the first error",
        min=0,
    )
    restart_backoff_s: float = opt(
        1.0, "the first restart is immediate; wait this long before the second, doubled for each further one", min=0.0
    )
    warm_spares: bool = opt(
        True,
        "keep one idle, warm replacement worker per rank (no resources of its own, "
        "in the rank's bundle) so a restart skips process start-up",
    )
    peer_heal: bool = opt(
        False,
        "heal a dead or raising rank from a surviving data-parallel replica (parallel.dp_replicate >= 2, "
        "no tp/pp/cp yet): the other ranks keep their processes and state, only the lost rank is "
        "replaced, its state is copied from the peer and the interrupted step runs again, with no "
        "rollback; where no peer holds its shard, or the heal fails, the run restarts from its "
        "newest checkpoint as without it",
    )
    prepare_spares: bool = opt(
        True,
        "on CPU, the warm spares also join a process group of their own and build "
        "their shards ahead, so a restart only restores the checkpoint (MTTR ~1.1 s "
        "against ~2.7 s for the tiny benchmark model); each spare then holds its "
        "shard's parameters, a second copy in the node's memory. GPU spares stop at "
        "their imports (they get the failed worker's device when they take over)",
    )
    worker_pool_idle_s: float = opt(
        120.0,
        "CPU runs take their worker processes from the cluster's pool (past "
        "Python, Ray and torch imports: a run starts ~2 s sooner per rank on a "
        "busy node) and give them back at a clean end; an idle process is "
        "stopped after this many seconds (0 = every run starts its own)",
        min=0.0,
    )
    sdc_every_steps: int = opt(
        0,
        "compare parameter fingerprints across data-parallel replicas (dp_replicate > 1) every N steps; 0 = off",
        min=0,
    )
    timeout_factor: float = opt(
        4.0,
        "hang and process-group timeouts = this × the step and collective times "
        "measured in the first steps (with timeout_floor_s as the minimum); a later "
        "fleet's start bound = this × the run's measured fleet start",
        min=3.0,
        max=5.0,
    )
    calibrate_steps: int = opt(
        5, "steps (after the first) whose times calibrate the timeouts; 0 = keep hang_timeout_s", min=0
    )
    timeout_floor_s: float = opt(
        30.0,
        "smallest calibrated timeout (covers report batching, scheduling jitter and a shared machine's slow spells)",
        gt=0.0,
    )
    stress_s: float = opt(
        0.0,
        "after calibration, run collectives at full rate for this long under the "
        "calibrated timeout and record any timeout (0 = skip)",
        min=0.0,
    )
    inject: str = opt(
        "",
        "fault injection for drills and tests: comma-separated KIND@STEP[:RANK][/PHASE], "
        f"KIND one of {', '.join(FAULT_KINDS)}, PHASE (where in the step) one of {', '.join(FAULT_PHASES)} "
        "(e.g. 'kill@50:0' or 'kill@50:0/backward')",
    )
