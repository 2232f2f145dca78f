"""The vocabulary of ``events.jsonl``: every event kind a run records, with one line of meaning.

``EventKind`` is a ``str`` enum, so a record's ``kind`` is the plain string in the file and
``e["kind"] == EventKind.RUN_END`` holds when reading it back. ``RunRecords.event`` accepts
only these kinds. ``docs/events.md`` is generated from this table
(``python -m raysc.fleet.events > docs/events.md``; a test checks that it is current).
"""

from __future__ import annotations

from enum import Enum


class EventKind(str, Enum):
    def __new__(cls, value: str, meaning: str) -> EventKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    def __str__(self) -> str:
        return self.value

    # a run's life
    RUN_START = "run_start", "the supervisor took the run: directory, config hash, parameter count, resume"
    INIT_FROM = (
        "init_from",
        (
            "the run starts from a Hugging Face checkpoint (model.init_from), checked against the "
            "config: source, content SHA-256, tensors, bytes, tokenizer taken from it"
        ),
    )
    DATA_READY = "data_ready", "the training data is packed: tokens, documents, sequences, corpus hash, domains"
    WORKERS_READY = (
        "workers_ready",
        (
            "every worker joined the process group and built its shard (warm: spares used, "
            "prepared: they had joined and built theirs before the failure; "
            "pooled: workers lent by the cluster's worker pool, reused: how many of those "
            "served a run before; started_s: a cold fleet's seconds from its workers' "
            "creation to all up; start_bound_s: the bound its start was held to)"
        ),
    )
    SPARES_READY = (
        "spares_ready",
        (
            "the warm spares started after a chunk of training answer (seconds since their "
            "start; prepared: on CPU they also joined a process group of their own and built "
            "their shards); until then their start-up shares the node's CPUs with training"
        ),
    )
    LAYOUT = (
        "layout",
        (
            "the parallel layout, the node (IP, node id) of each rank and what rank 0 built "
            "(stages, schedule class, weight placements, attention kernel, recompute), "
            "at every fleet start"
        ),
    )
    LAYOUT_WARNING = "layout_warning", "a tensor/context-parallel group spans nodes (slow collectives)"
    RUN_END = "run_end", "the run finished; the fields are its summary"
    VALIDATION_MISSING = (
        "validation_missing",
        (
            "the final validation (or pre-flight probe) failed and could not "
            "be healed; training and its final checkpoint are complete, so "
            "the run ends successfully without it (phase, error)"
        ),
    )
    RUN_FAILED = "run_failed", "the run stopped on an error it could not heal"
    STOP_REQUESTED = "stop_requested", "the driver asked to stop (SIGINT / SIGTERM) at the next agreed step"
    RUN_STOPPED = "run_stopped", "the run stopped on request after saving (aborted: the stop was cut short)"
    DASHBOARD_METRICS_UNAVAILABLE = (
        "dashboard_metrics_unavailable",
        "Ray's metrics could not be set up; the jsonl files are still written",
    )
    TRACKING = "tracking", "a tracker ([track]) opened the run: its name, the tracker's run id, whether it is new"
    TRACKER_DEGRADED = (
        "tracker_degraded",
        ("a tracker refused or did not answer; training goes on, its records are buffered and retried"),
    )
    TRACKER_RECOVERED = "tracker_recovered", "a degraded tracker took the buffered records (seconds down, rows dropped)"
    TRACKER_UNDELIVERED = (
        "tracker_undelivered",
        ("the run ended before a tracker took its last records (metrics.jsonl and events.jsonl have them)"),
    )
    # training signals
    UPDATE_SKIPPED = "update_skipped", "the spike/NaN detector skipped an optimizer update"
    DATA_EPOCH = "data_epoch", "a data domain ran out and started a new seeded permutation"
    SLOW_STEP = "slow_step", "a step took several times the calibrated median (a straggler)"
    ROUTER_COLLAPSE = (
        "router_collapse",
        (
            "a mixture of experts' layer sent its tokens to a few experts, or gave some none, for a whole "
            "window: the layer, dead and busiest experts, their share; action warn or stop (raysc.fleet.router_watch)"
        ),
    )
    SPIKE_ROLLBACK = "spike_rollback", "a loss spike: restored the checkpoint before it and skipped data"
    TIMEOUTS_CALIBRATED = "timeouts_calibrated", "hang and process-group timeouts set from measured step times"
    COLLECTIVE_STRESS = "collective_stress", "the collective stress test under the calibrated timeout"
    # failures and healing
    FAULT_INJECTED = "fault_injected", "a drill fault (supervisor.inject) is about to fire"
    WORKER_DIED = "worker_died", "a worker process died (killed, OOM, node lost)"
    WORKER_ERROR = "worker_error", "a worker raised an exception"
    WORKER_HANG = "worker_hang", "no progress from some ranks for longer than the hang timeout"
    WORKER_TIMEOUT = "worker_timeout", "some ranks did not finish a bounded operation in time"
    RECOVERY_START = (
        "recovery_start",
        (
            "healing a failure: healed_by peer (only the lost ranks replaced, supervisor.peer_heal) or "
            "checkpoint (the whole fleet replaced; peer_heal: why a peer heal did not apply)"
        ),
    )
    RECOVERED = (
        "recovered",
        (
            "training goes on: healed_by checkpoint (a new fleet resumed from the newest checkpoint) or "
            "peer (the lost ranks replaced, their state from surviving replicas: ranks_replaced, sources, "
            "discarded (survivors that undid the interrupted step), bytes_moved, phases_s, pids)"
        ),
    )
    RESTARTS_EXHAUSTED = "restarts_exhausted", "supervisor.max_restarts failures without progress: giving up"
    NODE_LOST = "node_lost", "Ray reports a node of the fleet dead: its ranks, processes and objects are gone"
    RESIZED = (
        "resized",
        (
            "an elastic run changed its data-parallel size (parallel.elastic): from, to, the "
            "dimension, why, seconds, steps lost"
        ),
    )
    NODE_QUARANTINED = "node_quarantined", "a node is suspect; later restarts place workers elsewhere"
    QUARANTINE_IGNORED = (
        "quarantine_ignored",
        "the nodes outside the quarantine cannot hold the fleet: placed on them too",
    )
    SDC_UNAVAILABLE = "sdc_unavailable", "replica checks are set but no rank holds a replica to compare"
    SDC_MISMATCH = "sdc_mismatch", "replicas' parameter fingerprints disagree (silent data corruption)"
    SDC_REPAIRED = "sdc_repaired", "the corrupted replicas were restored from the healthy majority"
    SDC_ROLLBACK = "sdc_rollback", "no majority among replicas: every replica restored from a checkpoint"
    # checkpoints
    CHECKPOINT_STORE_OK = "checkpoint_store_ok", "the checkpoint store answered a write/read/delete probe"
    CHECKPOINT_INTERVAL_ADVICE = "checkpoint_interval_advice", "the save time suggests another checkpoint interval"
    CHECKPOINT_REQUESTED = "checkpoint_requested", "a checkpoint was asked for now (raysc ckpt now, SIGUSR1)"
    CHECKPOINT_SAVE_DELAYED = "checkpoint_save_delayed", "a save waits for the previous one still uploading"
    CHECKPOINT_SAVED = "checkpoint_saved", "a checkpoint was committed (its manifest written)"
    CHECKPOINT_UPLOAD_RETRY = "checkpoint_upload_retry", "a file upload failed transiently and was retried"
    CHECKPOINT_SAVE_FAILED = "checkpoint_save_failed", "a save failed; no manifest, the previous checkpoint stands"
    CHECKPOINT_SAVE_ABANDONED = "checkpoint_save_abandoned", "a save in flight was given up (the fleet is replaced)"
    CHECKPOINT_LAGGING = "checkpoint_lagging", "the newest durable checkpoint lags training after failed saves"
    CHECKPOINT_CLEANUP_FAILED = "checkpoint_cleanup_failed", "deleting old checkpoints (retention) failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped", "a checkpoint was passed over on resume (format, signature, run)"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt", "a checkpoint failed verification; the previous one is tried"
    CHECKPOINT_OVERWRITE_PENDING = (
        "checkpoint_overwrite_pending",
        "--overwrite: another run's checkpoints go after this run's first commit",
    )
    CHECKPOINT_REPLACED = "checkpoint_replaced", "--overwrite: another run's checkpoint at this step was replaced"
    PREVIOUS_RUN_DELETED = "previous_run_deleted", "--overwrite: the other run's checkpoints were deleted"
    RESUMED = "resumed", "training state restored from a checkpoint (layout it was written under)"
    RESUME_CONFIG_CHANGED = "resume_config_changed", "the resumed checkpoint was written under another config"


def events_reference() -> str:
    """``docs/events.md``: the table of event kinds."""
    lines = [
        "# Events",
        "",
        "Every line of a run's `events.jsonl` is one JSON object with `time`, `kind` and fields of its own.",
        "The kinds, in the order a run tends to meet them (generated from `raysc/fleet/events.py`:",
        "`python -m raysc.fleet.events > docs/events.md`).",
        "",
        "| kind | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{k.value}` | {k.meaning} |" for k in EventKind]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(events_reference(), end="")
